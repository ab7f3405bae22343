"""What the driver is told (`TrainPlan`) and what it reports (progress, epoch and final results)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from arceus.contracts.counters import StageCounters
from arceus.contracts.spot_check import SpotCheckResult
from arceus.contracts.transfer import TransferConfig
from arceus.data.config import DatasetOpener
from arceus.errors import SpecError
from arceus.model.expected_state import OPTIMIZER_STATE_KEYS
from arceus.model.precision import check_precision
from arceus.pipeline.schedule import SCHEDULES


@dataclass(frozen=True)
class ReplicaJoin:
    """A replica that joined a running job's stage: the live replica it copied the stage's state from, the bytes
    copied, their SHA-256, and the SHA-256 of the state the joiner then held (equal: it starts as its peer is)."""

    index: int
    replica: int
    source_replica: int
    size_bytes: int
    sha256: str
    state_sha256: str


@dataclass(frozen=True)
class ReplicaFence:
    """A live replica the driver fenced in train step `step` after failures between live replicas
    (`ReplicaRoster.fence`): it takes no micro-batch before it joins again (copying its stage's state anew), at train
    step `until_step` at the earliest."""

    index: int
    replica: int
    until_step: int
    step: int


@dataclass(frozen=True)
class RankEndpoint:
    """Another agent of a tensor-parallel stage: rank 1, 2, ... (the stage's endpoint is its rank 0)."""

    address: str
    node_id: str
    certificate: str  # the TLS certificate its agent registered (PEM): the only one trusted at `address`


@dataclass(frozen=True)
class StageEndpoint:
    index: int
    address: str
    node_id: str
    layer_start: int
    layer_end: int
    certificate: str  # the TLS certificate its agent registered (PEM): the only one trusted at `address`
    public_key: str = ""  # hex Ed25519 key of the node's agent: its receipts verify against it
    owner_id: str = ""  # who contributes the node: a spot check's verifier is another owner's ("": unknown)
    # A tensor-parallel stage's ranks after rank 0 (this endpoint), in rank order; empty for one agent.
    tensor_parallel_ranks: tuple[RankEndpoint, ...] = ()
    replica: int = 0  # which replica of its stage this agent hosts, where stages are replicated (TrainPlan.replicas)
    # Where its replica's exchange listener is dialled, where not at `address`'s host and the port the agent names
    # (stage.proto's ReplicaPeer.exchange_address; a bench's shaped link); "": there.
    exchange_address: str = ""
    # A replica's samples per second of compute as last measured on its node (None: not yet): a driver that takes
    # over the job routes by it from its first step instead of evenly.
    samples_per_second: float | None = None


@dataclass(frozen=True)
class TrainPlan:
    job_id: str
    generation: int
    stages: tuple[StageEndpoint, ...]
    dataset: dict[str, Any]  # a validated dataset_config
    epochs: int
    learning_rate: float
    micro_batches: int
    seed: int
    credential: str  # the driver's data-plane token for this generation (arceus.contracts.credentials)
    rpc_timeout_seconds: float = 60.0
    max_steps: int | None = None
    schedule: str = "gpipe"
    # The job's staleness (arceus.pipeline.schedule.STALENESS), as its stages have it: 1 overlaps consecutive steps
    # on each stage, so its train steps go one RunStep each, chained; 0 lets the driver send windows of steps
    # (arceus.contracts.step_window), which a stage with staleness 1 refuses.
    staleness: int = 0
    # The stages hold the state after `start_step` (0: the initial weights); training resumes after it
    # with the same data order as a run that never stopped.
    start_step: int = 0
    # Save every stage's state every this many steps (0: never periodically), and at the end.
    checkpoint_interval: int = 0
    # Spot checks (arceus.training.audit): the chance that a train step has one micro-batch's forward
    # recomputed on another node (0: no checks, no receipts verified), and the tolerance it must meet.
    # `model` (the job's model_config) is what the verifier rebuilds the stage from.
    audit_rate: float = 0.0
    audit_rtol: float = 1e-4
    audit_atol: float = 1e-5
    model: dict[str, Any] = field(default_factory=dict)
    # The job's transfer setting, as its stages have it: spot checks round recomputations the same way.
    transfer: TransferConfig = TransferConfig()
    precision: str = "fp32"  # the stages' compute precision; spot checks recompute in it
    # The stages' optimizer (an `arceus.model.expected_state.OPTIMIZER_STATE_KEYS` kind): with `model`, the
    # state each stage streams for a checkpoint is checked against what it holds ("": not checked).
    optimizer: str = ""
    # Opens an uploaded dataset's file by id (the control plane's storage) for a config naming one
    # (`dataset_id`, `tokenizer_id`); None where there is no control plane.
    open_dataset: DatasetOpener | None = None
    # Replicated stages (arceus/swarm): every replica of every stage, each at least one; `stages` then names each
    # stage's lowest replica. Empty: one agent (or tensor-parallel group) per stage, as `stages` says.
    replicas: tuple[StageEndpoint, ...] = ()
    # Asked before every step of replicated stages: replicas ready to join (each hosted, not yet a member). Each
    # copies its stage's state from a live replica, peer to peer, then takes micro-batches from that step on.
    replica_joins: Callable[[], Sequence[StageEndpoint]] | None = None
    # Asked before every step of replicated stages: (stage index, replica id) of every replica still placed. A
    # member not among them leaves the roster (its node was taken off the job) unless it is its stage's last.
    replica_placed: Callable[[], Collection[tuple[int, int]]] | None = None
    # Told of every replica that joined: what it copied from which live replica (the control plane shows it).
    replica_joined: Callable[[ReplicaJoin], object] | None = None
    # Told of every live replica fenced (the control plane shows it, and bills none of its time, until it joins again).
    replica_fenced: Callable[[ReplicaFence], object] | None = None

    def check(self) -> None:
        """Raise SpecError if the plan cannot be run (the dataset is checked when it is loaded)."""
        if not self.stages:
            raise SpecError("plan.stages", "a pipeline needs at least one stage")
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            raise SpecError(
                "plan.stages",
                f"stage indices must be 0..{len(self.stages) - 1} in order, "
                f"got {[s.index for s in self.stages]}",
            )
        if self.stages[0].layer_start != 0 or any(
            a.layer_end != b.layer_start for a, b in zip(self.stages, self.stages[1:], strict=False)
        ):
            raise SpecError(
                "plan.stages",
                "stage layer ranges must start at 0 and be contiguous, got "
                + ", ".join(f"[{s.layer_start}, {s.layer_end})" for s in self.stages),
            )
        for name, value in (("epochs", self.epochs), ("micro_batches", self.micro_batches)):
            if value < 1:
                raise SpecError(f"plan.{name}", f"must be at least 1, got {value}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise SpecError("plan.learning_rate", f"must be a positive number, got {self.learning_rate}")
        check_precision(self.precision, "plan.precision")
        if self.optimizer and self.optimizer not in OPTIMIZER_STATE_KEYS:
            raise SpecError(
                "plan.optimizer", f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZER_STATE_KEYS)}"
            )
        if not self.rpc_timeout_seconds > 0:
            raise SpecError("plan.rpc_timeout_seconds", f"must be positive, got {self.rpc_timeout_seconds}")
        if self.max_steps is not None and self.max_steps < 1:
            raise SpecError("plan.max_steps", f"must be at least 1 (or None), got {self.max_steps}")
        for name, value in (("start_step", self.start_step), ("checkpoint_interval", self.checkpoint_interval)):
            if value < 0:
                raise SpecError(f"plan.{name}", f"must be at least 0, got {value}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise SpecError("plan.audit_rate", f"must be within [0, 1], got {self.audit_rate}")
        if self.audit_rate and not self.model:
            raise SpecError("plan.model", "spot checks need the model config to recompute a stage")
        if any(s.tensor_parallel_ranks for s in self.stages):
            if not self.model:
                raise SpecError("plan.model", "gathering a tensor-parallel stage's weights needs the model config")
            if self.audit_rate:
                raise SpecError("plan.audit_rate", "spot checks of tensor-parallel stages are not supported: use 0")
        if self.schedule not in SCHEDULES:
            raise SpecError(
                "plan.schedule", f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}"
            )
        if self.replicas:
            self._check_replicas()

    def _check_replicas(self) -> None:
        by_stage: dict[int, list[StageEndpoint]] = {}
        for endpoint in self.replicas:
            by_stage.setdefault(endpoint.index, []).append(endpoint)
        if sorted(by_stage) != list(range(len(self.stages))):
            raise SpecError("plan.replicas", f"every stage 0..{len(self.stages) - 1} needs at least one replica")
        for index, endpoints in by_stage.items():
            ids = [e.replica for e in endpoints]
            if len(set(ids)) != len(ids):
                raise SpecError("plan.replicas", f"stage {index} names replica ids {ids}: each once")
            if len(ids) > self.micro_batches:
                raise SpecError(
                    "plan.replicas",
                    f"stage {index} has {len(ids)} replicas for {self.micro_batches} micro-batches: every replica "
                    "takes at least one, so use at most micro_batches replicas",
                )
            if min(endpoints, key=lambda e: e.replica) != self.stages[index]:
                raise SpecError("plan.stages", f"stage {index} must be its lowest replica's endpoint")
        if any(e.tensor_parallel_ranks for e in self.replicas):
            raise SpecError("plan.replicas", "a tensor-parallel stage cannot be replicated yet")


@dataclass(frozen=True)
class StageTiming:
    """How one stage (its rank 0, or one replica of a replicated stage) spent one step, as its agent reported it
    within the wall time the driver measured: computing, and waiting for its inputs and sends (the pipeline bubble
    it saw); that wall time, the driver's own clock from the call to the reply (what the market measures speed by:
    no agent shortens it); and the samples and micro-batches the driver routed to it."""

    index: int
    compute_seconds: float
    wait_seconds: float
    wall_seconds: float = 0.0  # 0: not measured
    # A replica's own (a replicated stage has one timing per replica): its node; "": the stage's (its rank 0's).
    node_id: str = ""
    samples: float = 0.0  # the samples it ran forward and backward in the step (0: not counted)
    micro_batches: float = 0.0  # the step's micro-batches it took (a replica: its share of them)


@dataclass
class StepProgress:
    epoch: int  # 1-based
    step: int  # global, 1-based
    total_steps: int
    loss: float
    samples_per_second: float
    seconds: float  # the step's wall time through the whole pipeline
    stages: list[StageCounters] = field(default_factory=list)  # cumulative, after this step
    spot_checks: list[SpotCheckResult] = field(default_factory=list)  # of this step
    timings: list[StageTiming] = field(default_factory=list)  # of this step, one per stage
    # Of this step: the tensor bytes replicas pushed to their siblings (their gradient exchange or sync).
    exchange_bytes: int = 0


@dataclass
class EpochResult:
    epoch: int
    val_loss: float
    val_accuracy: float
    stages: list[StageCounters]


@dataclass(frozen=True)
class UploadTarget:
    """Where a stage's agent uploads its state itself for a checkpoint: `path` on its control plane, and the
    id the sink knows that upload by."""

    upload_id: str
    path: str


@dataclass
class StageStateFile:
    """One stage's weights and optimizer state after a step, as a safetensors file (checkpoint tensor
    names): uploaded by the stage's agent itself (`upload_id`: an UploadTarget's; `path` None), or streamed
    by the driver into `path`, which lives until the sink's `on_checkpoint` returns."""

    index: int
    layer_start: int
    layer_end: int
    path: Path | None
    sha256: str  # hex, as the agent sent it
    size_bytes: int
    upload_id: str = ""


class ProgressSink(Protocol):
    def on_step(self, p: StepProgress) -> None: ...

    def on_epoch(self, r: EpochResult) -> None: ...

    def checkpoint_uploads(self, step: int, stages: list[StageEndpoint]) -> dict[int, UploadTarget]:
        """Where the agents of these stages upload their state for the checkpoint of `step`, by stage index;
        the others' state the driver streams into files for `on_checkpoint`."""
        ...

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None: ...

    def wants_checkpoint(self) -> bool:
        """True to have every stage's state saved before the next step (e.g. to hand a stage over)."""
        ...

    def should_stop(self) -> bool: ...


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float
    val_accuracy: float
    stopped: bool
    stages: list[StageCounters]
    stop_reason: str = ""  # why it stopped where nothing asked it to: an agent refused a step beyond the grant
