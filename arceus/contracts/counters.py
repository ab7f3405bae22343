"""`StageCounters`: one stage's (or tensor-parallel rank's) cumulative work within a generation, as its
agent counts it. The agent reports it in every RunStep reply, the driver passes it on in its progress,
and the control plane stores it on the stage, on the node's contribution and in the ledger."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCounters:
    index: int  # the stage
    samples: int  # forward samples, training and evaluation
    micro_batches: int
    compute_seconds: float
    bytes_sent: int  # encoded bytes, as they travelled
    bytes_received: int
    node_id: str = ""  # which rank's of a tensor-parallel stage; "": the stage's (its rank 0's)
