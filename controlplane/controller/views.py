"""The snapshots the reconciler's rules read: plain, frozen values of what the database holds (filled by
`snapshot.py`), so the rules stay pure and tests build them by hand."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from arceus.placement.solver import Device, LayerProfile, Workload

Conditions = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class NodeView:
    id: str
    ready_status: str
    lease_renewed_at: datetime | None
    lease_duration_seconds: float
    flops: float  # what it is priced and placed by (controlplane/nodes/device_class.py `market_flops`)
    memory_bytes: int
    name: str = ""
    paused: bool = False  # may not work now (its owner's controls): no new stages, its stages handed back
    pause_reason: str = "paused by its owner"
    device_type: str = "cpu"
    price_per_hour: float = 0.0  # the posted price of its device class
    # Its measured link: the worst to a pipeline neighbour (LinkProbeService), else to the control plane
    # (POST /api/agent/probe); unmeasured: unlimited.
    bandwidth_bytes_per_s: float = math.inf
    latency_s: float = 0.0
    relayed: bool = False  # the control plane could not dial it back: callers reach it through a relay
    # Its siblings can open its replicas' exchange: False where the dial-back reached the agent directly but not the
    # exchange listener it registered (`Node.exchange_reachable`); it hosts no replica of a replicated job's stage.
    exchange_reachable: bool = True
    owner: str = ""  # the contributor it belongs to (owner diversity: controlplane/controller/diversity.py)
    # Its agent's own matmul benchmark (`flops_fp32`; 0: none): what a job's timed nodes calibrate an untimed one's
    # speed by (controlplane/controller/calibration.py).
    declared_flops: float = 0.0

    def renewed(self, at: datetime) -> NodeView:
        """This view with another lease renewal (its heartbeat came). A copy of its fields: `dataclasses.replace`
        runs `__init__` again, 7 µs against 0.8 µs, and a reconcile pass does this for 1,000 nodes a second."""
        view = object.__new__(NodeView)
        view.__dict__.update(self.__dict__, lease_renewed_at=at)  # frozen: `__setattr__` refuses, the dict does not
        return view

    def device(self) -> Device:
        """The node in the placement solver's terms."""
        return Device(
            self.id, self.flops, self.memory_bytes, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            latency_s=self.latency_s, price_per_hour=self.price_per_hour, relayed=self.relayed,
        )


@dataclass(frozen=True)
class Requirements:
    """What a job asks of the devices it runs on (all optional)."""

    min_memory_bytes: int = 0
    device_types: tuple[str, ...] = ()  # empty: any
    min_devices: int | None = None  # devices, counting every rank of a tensor-parallel stage
    max_devices: int | None = None
    max_price_per_hour: float | None = None  # for all its devices together
    owner_diversity: bool = True  # no single owner may hold every stage (controlplane/controller/diversity.py)

    def allows(self, node: NodeView) -> bool:
        return node.memory_bytes >= self.min_memory_bytes and (
            not self.device_types or node.device_type in self.device_types
        )


@dataclass(frozen=True)
class TensorParallel:
    """How a job's stages split over nodes: groups of `size` (1: none), for every stage or only `stages`."""

    size: int = 1
    stages: tuple[int, ...] | None = None  # the split stages' indices; None: every stage

    def ranks(self, index: int) -> int:
        """How many nodes stage `index` runs on."""
        return self.size if self.stages is None or index in self.stages else 1

    def nodes(self, stage_count: int) -> int:
        return sum(self.ranks(i) for i in range(stage_count))


def stage_bounds(
    stages_requested: int | None, requirements: Requirements, split: TensorParallel
) -> tuple[int, int | None]:
    """The stage counts a job allows: the count it asked for, else what its device bounds allow."""
    if stages_requested:
        return stages_requested, stages_requested
    low, high = requirements.min_devices, requirements.max_devices
    return -(-(low or 1) // split.size), None if high is None else max(high // split.size, 1)


@dataclass(frozen=True)
class PlacedStage:
    """One node's part of a stage: the whole stage, or rank `rank` of a tensor-parallel group."""

    index: int
    layer_start: int
    layer_end: int
    node_id: str | None
    generation: int
    rank: int = 0
    restarted_generation: int | None = None  # its node's agent came back as a fresh process at this generation
    # Since when its node's time is held but not yet billed (placed there, or the end of its last ledger entry on
    # the job): what the job's budget must still cover. None: not counted (no budget, or no node).
    held_from: datetime | None = None
    replica: int = 0  # its replica id where the job's stages are replicated
    # The job's driver has timed its node on this stage (its step measures are recorded; a move clears them): the
    # node's measured FLOP/s are this job's (controlplane/controller/calibration.py).
    timed: bool = False
    # A replica added while its job runs that has not copied its stage's state from a sibling yet (`Stage.joining`
    # without `joined`): it holds none of the stage's state, so it cannot stand in for replicas that are gone.
    joining: bool = False
    # The job's driver fenced it (failed steps between live replicas): it takes no micro-batch until it joins again.
    fenced: bool = False
    fences: int = 0  # how often the driver fenced it within its window of train steps (`Stage.fences`)

    @property
    def key(self) -> tuple[int, int, int]:
        """(index, rank, replica): the row among its job's."""
        return self.index, self.rank, self.replica


@dataclass(frozen=True)
class DriverOutcome:
    """The driver's last word, recorded at `generation`: it trained to the end (`status` succeeded, `message` its
    summary) or cannot train the job (`status` failed, with a reason)."""

    generation: int
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class FailedCheck:
    """A spot check of the job's driver, at `generation`, that caught node `node_id` wrong."""

    generation: int
    node_id: str
    node_label: str  # as the job's owner may see it (controlplane/nodes/labels.py)
    detail: str


@dataclass(frozen=True)
class JobView:
    id: str
    status: str
    generation: int
    stages_requested: int | None
    layers: tuple[LayerProfile, ...]
    workload: Workload = Workload(micro_batch_size=1, micro_batches=1)
    owner: str = ""  # who submitted it: its conditions name that user's nodes, and others' by their ids' start
    requirements: Requirements = Requirements()
    stages: tuple[PlacedStage, ...] = ()
    conditions: Conditions = ()
    driver_lease_expires_at: datetime | None = None
    driver_claimed: bool = False  # a driver took the lease (else a started driver task is still queued)
    spec_error: str | None = None  # the stored model_config no longer validates
    node_grace_seconds: float | None = None  # the job's own tolerance for silent nodes
    restarts: int = 0
    max_restarts: int = 5
    handover_requested: bool = False  # the driver was asked to checkpoint and stop, to drain a node
    tensor_parallel: TensorParallel = TensorParallel()
    serving: bool = False  # a succeeded job its owner asked to serve
    # A succeeded job's final checkpoint, stage by stage: (index, layer_start, layer_end); what serving places.
    served_layers: tuple[tuple[int, int, int], ...] = ()
    driver_outcome: DriverOutcome | None = None
    failed_checks: tuple[FailedCheck, ...] = ()  # oldest first
    # Its limits while it trains (`requirements.max_total_usd` in micro-dollars, `requirements.deadline`), what it
    # has been charged, and how long it takes to checkpoint and stop (ARCEUS_JOB_STOP_SECONDS): it is stopped that
    # long before its charges would reach the cap.
    max_total_micros: int | None = None
    deadline: datetime | None = None
    charged_micros: int = 0
    stop_seconds: float = 0.0
    # Replicas per stage (arceus/swarm): at least `replicas_min` placed, more up to `replicas_max` added while it
    # runs; `next_replica`: the id the next replica gets (ids are never reused within a job).
    replicas_min: int = 1
    replicas_max: int = 1
    next_replica: int = 0
    replica_sync_every: int = 1  # its replicas exchange every this many steps (replica_sync: 1, exact, every step)
    # (node id, when) each node last had a replica of the job taken off it (DropReplicas: lost, paused, restarted or
    # failed; `StageContribution.released_at`): a node not heard from since is no place for its replicas.
    released: tuple[tuple[str, datetime], ...] = ()
    # A replica fenced `max_fences` times within its window is dropped (its link or host keeps failing steps), and
    # each node one was dropped from so (node id, when: `fenced_out`) takes none of the job's replicas for
    # `fenced_out_seconds` (ARCEUS_REPLICA_MAX_FENCES, ARCEUS_REPLICA_FENCED_OUT_SECONDS).
    max_fences: int = 3
    fenced_out: tuple[tuple[str, datetime], ...] = ()
    fenced_out_seconds: float = 600.0

    @property
    def replicated(self) -> bool:
        return self.replicas_max > 1


@dataclass(frozen=True)
class StageReport:
    generation: int | None
    state: str
    message: str = ""


@dataclass(frozen=True)
class Desired:
    jobs: tuple[JobView, ...]  # queued, placing, pending and running jobs, and served ones, oldest first


@dataclass(frozen=True)
class Observed:
    nodes: tuple[NodeView, ...]
    # (job id, index, rank, replica) -> what the row's agent reports
    stages: Mapping[tuple[str, int, int, int], StageReport] = field(default_factory=dict)

