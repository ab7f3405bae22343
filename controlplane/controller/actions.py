"""The reconciler's actions: what one pass decided (`rules.plan`), each naming the generation (and status) it was
decided on, so the executor applies it only if the row still has them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from controlplane.controller.views import Conditions


@dataclass(frozen=True)
class MarkNodeUnknown:
    node_id: str
    renewed_at: datetime  # the lease as seen; a heartbeat since then cancels the action
    reason: str
    message: str


@dataclass(frozen=True)
class MovesHeld:
    """A pass held `jobs` jobs' lost stages where they are (controlplane/controller/moves.py): `reason` MovesDeferred
    (past ARCEUS_MAX_MOVES_PER_PASS) or NodesDisrupted (`silent` of the `hosting` nodes silent at once). Nothing
    to write: the executor logs it and counts it in a metric."""

    reason: str
    jobs: int
    silent: int
    hosting: int


@dataclass(frozen=True)
class PlannedStage:
    index: int
    layer_start: int
    layer_end: int
    node_id: str
    rank: int = 0
    replica: int = 0  # its replica id where the job's stages are replicated


@dataclass(frozen=True)
class PlaceJob:
    job_id: str
    generation: int  # the queued job's; the placement gets generation + 1
    stages: tuple[PlannedStage, ...]
    conditions: Conditions
    # The placement needs the stages to recompute their activations (the job did not ask; without, one would not fit).
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class SetCondition:
    """Write the job's conditions (one of them changed) without changing anything else."""

    job_id: str
    generation: int
    status: str
    conditions: Conditions


@dataclass(frozen=True)
class StartDriver:
    job_id: str
    generation: int
    status: str  # PLACING for a first start, RUNNING for a restart
    lease_expires_at: datetime | None  # as seen; another pass that restarted the driver changed it
    conditions: Conditions


@dataclass(frozen=True)
class RequeueJob:
    job_id: str
    generation: int
    reason: str
    message: str


@dataclass(frozen=True)
class RequestHandover:
    """Ask a running job's driver to checkpoint where it is and stop, so stages on draining nodes can
    move without losing work (the move itself follows once the driver let go of its lease)."""

    job_id: str
    generation: int
    conditions: Conditions


@dataclass(frozen=True)
class RewindJob:
    """Bump the generation so every stage rebuilds from the last checkpoint; `moves` re-places stage
    rows: (index, rank, replica, a node id, or None to unplace it: the job then waits as pending). A move names
    one replica: its siblings (a replicated job's other rows of the stage rank) keep their nodes."""

    job_id: str
    generation: int
    status: str
    moves: tuple[tuple[int, int, int, str | None], ...]
    count_restart: bool
    reason: str
    message: str
    culprits: tuple[str, ...] = ()  # the nodes that caused it: they lose their credit for the steps replayed


@dataclass(frozen=True)
class FailJob:
    job_id: str
    generation: int
    reason: str
    message: str
    culprits: tuple[str, ...] = ()  # nodes that caused it: they lose their credit for the steps since the checkpoint


@dataclass(frozen=True)
class SucceedJob:
    """The driver trained the job to the end: it succeeds and its nodes are released."""

    job_id: str
    generation: int
    summary: str


@dataclass(frozen=True)
class RollBackJob:
    """Spot checks caught `node_ids` wrong: rewind to the newest checkpoint their passed checks vouch for, deleting
    the later ones, and move their stages off them (`controlplane/controller/rollback.py`)."""

    job_id: str
    generation: int
    node_ids: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class ServeJob:
    """Place a succeeded job's stages for inference (`stages`: all of them, rank 0 each; moved ones and kept
    ones alike) at the next generation, from its final checkpoint."""

    job_id: str
    generation: int
    stages: tuple[PlannedStage, ...]
    conditions: Conditions


@dataclass(frozen=True)
class StopServing:
    """Release a served job's nodes (a new generation); `serving`: whether the owner's wish stands (the job is
    placed again once nodes have room) or is withdrawn."""

    job_id: str
    generation: int
    serving: bool
    conditions: Conditions


@dataclass(frozen=True)
class DropReplicas:
    """Take replicas of a replicated job's stages off their nodes without a rewind (each stage keeps another, whose
    state the driver's roster goes on with): `replicas` are (index, replica) of its rows, deleted. `fenced`: those
    of them dropped for being fenced too often, (index, replica, fences seen): applied only while each is still
    fenced at least that often and its stage keeps a replica that trains."""

    job_id: str
    generation: int
    status: str
    replicas: tuple[tuple[int, int], ...]
    conditions: Conditions
    fenced: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class AddReplicas:
    """Place more replicas of a running replicated job's stages at its generation (no rewind): `stages` name their
    replica ids from `next_replica` as seen on; each joins by copying a live replica's state."""

    job_id: str
    generation: int
    next_replica: int
    stages: tuple[PlannedStage, ...]
    conditions: Conditions


Action = (
    MarkNodeUnknown | PlaceJob | SetCondition | StartDriver | RequeueJob | RequestHandover | RewindJob | FailJob
    | SucceedJob | RollBackJob | ServeJob | StopServing | DropReplicas | AddReplicas | MovesHeld
)

