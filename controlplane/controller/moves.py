"""How many jobs one reconcile pass rewinds to move lost stages, and when it moves none: the guard against a
cascade. When the control plane falls behind, agents' heartbeats time out, their nodes count lost, and every move
is a rewind that gives it more work (docs/BENCHMARKS.md, "The collapse at f343d2a"). As Kubernetes' node lifecycle
controller rate-limits evictions and all but stops them when a large share of a zone's nodes turn unhealthy at once
(--node-eviction-rate, --unhealthy-zone-threshold), a pass moves the lost stages of at most `max_moves` jobs (oldest
first), and none while more than `disruption_threshold` of the nodes hosting stages are silent (at least
`disruption_min_nodes` of them): the control plane or its network is then the likelier fault than the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.common.conditions import UNKNOWN, Condition

# The reasons of a job's Placed condition while its lost stages wait (`Moves.hold`).
MOVES_DEFERRED, NODES_DISRUPTED = "MovesDeferred", "NodesDisrupted"


@dataclass(frozen=True)
class MoveGuard:
    """The settings (ARCEUS_MAX_MOVES_PER_PASS, ARCEUS_DISRUPTION_THRESHOLD, ARCEUS_DISRUPTION_MIN_NODES); the
    defaults guard nothing: every lost stage moves in the pass that finds it."""

    max_moves: int | None = None  # jobs rewound a pass to move lost stages; None: all
    disruption_threshold: float = 1.0  # a share of the nodes hosting stages; 1.0: never disrupted
    disruption_min_nodes: int = 0  # fewer silent nodes than this never count as a disruption

    def disrupted(self, silent: int, hosting: int) -> bool:
        """Whether `silent` of the `hosting` nodes (those hosting stages of active jobs) being silent at once is a
        disruption: more than the threshold's share, and at least the minimum count (a small cluster losing most of
        its few nodes still moves their stages)."""
        return silent >= max(1, self.disruption_min_nodes) and silent > self.disruption_threshold * hosting


class Moves:
    """One pass's moves of lost stages, oldest job first: how many jobs moved, how many were held, and whether the
    next job with a lost stage may move (`hold`: None, else the Placed condition saying why it waits)."""

    def __init__(self, guard: MoveGuard, silent: int, hosting: int) -> None:
        self.guard, self.silent, self.hosting = guard, silent, hosting
        self.disrupted = guard.disrupted(silent, hosting)
        self.moved = self.held = 0

    @property
    def hold(self) -> Condition | None:
        if self.disrupted:
            return Condition(
                "Placed", UNKNOWN, NODES_DISRUPTED,
                f"a node of its stages is silent, as are more than {self.guard.disruption_threshold:.0%} of the nodes "
                "hosting stages: the control plane or its network is the likelier fault, so no lost stage moves "
                "until fewer are silent (ARCEUS_DISRUPTION_THRESHOLD)",
            )
        if self.guard.max_moves is not None and self.moved >= self.guard.max_moves:
            return Condition(
                "Placed", UNKNOWN, MOVES_DEFERRED,
                f"a node of its stages is lost; its stages move in a later pass: at most {self.guard.max_moves} jobs' "
                "lost stages move a pass, the oldest jobs first (ARCEUS_MAX_MOVES_PER_PASS)",
            )
        return None
