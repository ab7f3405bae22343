"""`SpotCheckResult`: the outcome of checking a node's work, as the driver's auditor finds it and the control
plane stores it (after verifying its receipts again)."""

from __future__ import annotations

from dataclasses import dataclass

# What a check covers: a recomputed forward (or the receipts of one), a replica's partial gradient, or a verifier's
# recomputation that other owners' nodes overruled (arceus.training.audit: who checks the checker).
FORWARD, PARTIAL_GRADIENT, VERIFICATION = "forward", "partial", "verification"


@dataclass(frozen=True)
class SpotCheckResult:
    """The outcome of checking a node's work: a recomputed forward, or a receipt it signed."""

    step: int
    micro_batch: int
    stage_index: int  # the stage whose work was checked
    node_id: str
    passed: bool
    detail: str
    verifier_node_id: str = ""  # "" when no forward was recomputed (a receipt check)
    max_abs_diff: float = 0.0
    receipt_sha256: str = ""  # hex: the receiver's signed digest of the compared output
    receipt_signature: str = ""  # hex
    sent_sha256: str = ""  # hex: the producer's signed digest of what it sent (a disagreement's other side)
    sent_signature: str = ""  # hex
    producer_index: int | None = None  # the stage whose output the receipts are about (None: stage_index)
    train_step: int = 0  # the job's step once the checked step ran (the control plane's sink adds it)
    # Replicated stages (arceus/swarm): the checked replica of `stage_index`, and the replicas the compared output
    # went from (of `producer_index`) and to (of the next stage), as the receipts name them; 0 where not replicated.
    replica: int = 0
    producer_replica: int = 0
    receiver_replica: int = 0
    kind: str = "forward"  # what was checked: FORWARD (a forward, or the receipts of one), PARTIAL (a gradient),
    # VERIFICATION (the node's recomputation as another's verifier)
