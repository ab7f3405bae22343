"""A node's speed on one job's stage, as the swarm model (arceus.swarm.model) is given it when the reconciler weighs
one more replica (`rules._gains`) and when an estimate predicts a replicated job's samples/s.

The training driver times every node that hosts a stage of a job (controlplane/driver/recording.py `_measure_nodes`):
the FLOPs of the samples it ran over the step's wall time. For a small model that is far below the node's own matmul
benchmark (its agent's `flops_fp32`), the figure a node no driver has timed is priced and placed by
(controlplane/nodes/device_class.py `market_flops`). Set side by side, an untimed node would look as many times faster
than the job's timed ones and the model would route every micro-batch to it. So a node the job's driver has not timed
on a stage (a candidate for one more replica, a replica that has just joined) counts at its benchmark times what the
job's timed nodes showed of theirs: the pooled ratio measured / benchmark of the stage's timed replicas (the same
layers), else of every timed stage of the job, else (nothing timed yet: a job before its first steps, an estimate)
its market figure as it is. Never above its market figure: a calibration only lowers a node's figure, so no claim can
raise it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from arceus.placement.solver import LayerProfile
from arceus.swarm.model import Link, Replica
from controlplane.controller.views import JobView, NodeView


@dataclass(frozen=True)
class Calibration:
    """One job's view of nodes' speeds. `timed`: (node id, stage index) the job's driver timed; `by_stage`: stage
    index -> pooled measured / benchmark of its timed nodes; `overall`: the same over every timed node of the job."""

    timed: frozenset[tuple[str, int]] = frozenset()
    by_stage: Mapping[int, float] = field(default_factory=dict)
    overall: float | None = None

    def flops(self, node: NodeView, index: int) -> float:
        """The FLOP/s `node` is expected to reach on stage `index` of the job."""
        if (node.id, index) in self.timed:
            return node.flops  # measured on this stage of this job: the driver's own figure
        ratio = self.by_stage.get(index, self.overall)
        if ratio is None or node.declared_flops <= 0:
            return node.flops
        return min(node.flops, node.declared_flops * ratio)

    def replica(self, node: NodeView, index: int, layers: Sequence[LayerProfile]) -> Replica:
        """`node` holding a replica of stage `index` (its `layers`), as the swarm model sees it."""
        return _swarm_replica(self.flops(node, index), node, layers)


def calibration(job: JobView, nodes: Mapping[str, NodeView]) -> Calibration:
    """`job`'s calibration from its stage rows the driver timed (`PlacedStage.timed`) on nodes with a benchmark."""
    timed = frozenset((s.node_id, s.index) for s in job.stages if s.timed and s.node_id is not None)
    sums: dict[int, tuple[float, float]] = {}
    for node_id, index in timed:
        node = nodes.get(node_id)
        if node is None or node.declared_flops <= 0:
            continue  # no benchmark to compare its measured speed with
        measured, benchmark = sums.get(index, (0.0, 0.0))
        sums[index] = (measured + node.flops, benchmark + node.declared_flops)
    by_stage = {index: measured / benchmark for index, (measured, benchmark) in sums.items()}
    measured, benchmark = sum(m for m, _ in sums.values()), sum(b for _, b in sums.values())
    return Calibration(timed, by_stage, measured / benchmark if benchmark > 0 else None)


def _swarm_replica(flops: float, node: NodeView, layers: Sequence[LayerProfile]) -> Replica:
    """A node of `flops` FLOP/s holding a replica of the stage of `layers`: its seconds per sample (forward and
    backward: 3x the forward's flops) and `node`'s uplink."""
    per_sample = 3 * sum(layer.flops_per_sample for layer in layers)
    return Replica(max(per_sample, 1.0) / max(flops, 1.0), Link(node.latency_s, node.bandwidth_bytes_per_s * 8))
