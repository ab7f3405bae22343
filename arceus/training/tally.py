"""What the driver vouches for of each agent's work: the counters the control plane stores and bills.

An agent's RunStep reply reports its cumulative counters, but an agent is a stranger's process: it could
claim a billion compute seconds, infinity, or samples it never saw. The driver counts samples and
micro-batches itself (it sent them), takes an agent's compute seconds for a step only up to the wall time the
driver measured for that step's call (compute happens inside the call), and takes byte counts only as
growth of a counter that never runs backwards, up to what the step's messages can carry. An agent that
over-reports is billed what the driver saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from arceus.contracts.counters import StageCounters
from arceus.v1 import stage_pb2


@dataclass
class _Reported:
    compute_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class WorkTally:
    """Cumulative, vouched-for counters of each agent of one pipeline run (one generation)."""

    def __init__(self) -> None:
        self._counted: dict[tuple[int, str], StageCounters] = {}
        self._reported: dict[tuple[int, str], _Reported] = {}

    def record(
        self,
        *,
        index: int,
        node_id: str,
        samples: int,
        micro_batches: int,
        wall_seconds: float,
        max_bytes: int,
        reported: stage_pb2.StageCounters,
    ) -> StageCounters:
        """Add one step of stage `index` on node `node_id` (`samples` in `micro_batches`, its RunStep call
        answered after `wall_seconds`, at most `max_bytes` sent and as many received) and return the agent's
        cumulative counters so far."""
        key = (index, node_id)
        before = self._counted.get(key) or StageCounters(index, 0, 0, 0.0, 0, 0, node_id=node_id)
        last = self._reported.setdefault(key, _Reported())
        compute = _delta(reported.compute_seconds, last.compute_seconds)
        sent = _delta(reported.bytes_sent, last.bytes_sent)
        received = _delta(reported.bytes_received, last.bytes_received)
        if math.isfinite(reported.compute_seconds):
            last.compute_seconds = max(last.compute_seconds, reported.compute_seconds)
        last.bytes_sent = max(last.bytes_sent, reported.bytes_sent)
        last.bytes_received = max(last.bytes_received, reported.bytes_received)
        counted = replace(
            before,
            samples=before.samples + samples,
            micro_batches=before.micro_batches + micro_batches,
            compute_seconds=before.compute_seconds + min(compute, max(0.0, wall_seconds)),
            bytes_sent=before.bytes_sent + int(min(sent, max_bytes)),
            bytes_received=before.bytes_received + int(min(received, max_bytes)),
        )
        self._counted[key] = counted
        return counted


def _delta(now: float, before: float) -> float:
    """How much a cumulative counter grew; 0 for one that shrank or is not a finite number."""
    if not math.isfinite(now) or now <= before:
        return 0.0
    return now - before
