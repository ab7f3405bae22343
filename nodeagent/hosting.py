"""The stages this agent hosts, kept in sync with the desired state it is given (like a kubelet).

`apply` is level-triggered: the list it receives is the whole desired state. New (stage_id, generation)
pairs are built from their spec, stages not listed are dropped, and a stage that failed to build stays
failed (and reported) until a new generation replaces it. What changes is planned by a pure function
(nodeagent/hosting_plan.py); `HostedStages` carries the plan out.
"""

from __future__ import annotations

import gc
import logging
import ssl
import threading
import time
import traceback
import weakref
from collections.abc import Sequence

import grpc
import torch
from prometheus_client import Histogram

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedStage, ObservedState
from arceus.v1 import stage_pb2
from nodeagent.all_reduce import TensorParallelGroups, stage_group
from nodeagent.callers import Guard
from nodeagent.device import memory_summary
from nodeagent.exchange_stream import Hello
from nodeagent.heap import release_free_memory
from nodeagent.hosting_plan import (
    BuildStage,
    DropStage,
    HostingAction,
    KeepStage,
    MemoryBudget,
    ReportFailed,
    plan_changes,
)
from nodeagent.neighbour_stream import NeighbourHello
from nodeagent.peer_streams import PeerStreams
from nodeagent.rpc import RpcFailure
from nodeagent.stage import (
    CheckpointLoader,
    DatasetReader,
    HostedStage,
    InitialWeightsLoader,
    ProgramLoader,
    build_hosted_stage,
)
from nodeagent.step_grants import StepGrants

log = logging.getLogger(__name__)

# How long a drop waits for calls still running in a dropped stage to end before building anything new.
DROP_GRACE_SECONDS = 10.0


class HostedStages:
    def __init__(
        self,
        device: torch.device,
        *,
        max_message_bytes: int,
        load_checkpoint: CheckpointLoader | None = None,
        build_seconds: Histogram | None = None,
        load_program: ProgramLoader | None = None,
        load_initial_weights: InitialWeightsLoader | None = None,
        streams: PeerStreams | None = None,
        read_dataset: DatasetReader | None = None,
    ) -> None:
        """`build_seconds`: observes each stage build's wall time, labelled by `source` (initial or checkpoint);
        `streams`: the agent's exchange streams, which its replicas of replicated stages exchange over;
        `read_dataset`: how its stages read an uploaded dataset's rows."""
        self._streams = streams
        self._read_dataset = read_dataset
        self._device = device
        self._build_seconds = build_seconds
        self._load_checkpoint = load_checkpoint
        self._load_program = load_program
        self._load_initial_weights = load_initial_weights
        self._max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._apply_lock = threading.Lock()
        self._stages: dict[str, HostedStage] = {}
        # The owner's budget for this agent (the control plane's controls.max_memory_bytes), and what the agent
        # held before any stage (reported at registration: placement leaves it room, and so does the agent).
        self.memory_budget: int | None = None
        self.runtime_bytes = 0
        self._failed: dict[str, ObservedStage] = {}
        # The all-reduce groups of hosted tensor-parallel stages (TensorParallelService resolves here);
        # each lives as long as its stage.
        self.tensor_parallel = TensorParallelGroups()
        # The train steps the control plane granted each job (its heartbeat replies'): RunStep runs no step beyond.
        self.grants = StepGrants()

    def apply(self, assignments: Sequence[Assignment], rejected: Sequence[ObservedStage] = ()) -> bool:
        """Make the hosted stages match `assignments`; `rejected` are listed stages that could not even be
        parsed (reported as failed). Returns whether anything changed. The changes are planned
        (nodeagent/hosting_plan.py), then carried out here."""
        with self._apply_lock:
            with self._lock:
                hosted = {stage_id: stage.assignment for stage_id, stage in self._stages.items()}
                failed = dict(self._failed)
            memory = MemoryBudget(self.memory_budget, self.runtime_bytes)
            actions = plan_changes(hosted, failed, assignments, rejected, memory)
            return self._execute(actions, failed)

    def _execute(self, actions: Sequence[HostingAction], failed: dict[str, ObservedStage]) -> bool:
        """Carry out a plan (in its order: keeps, drops, then reports and builds); whether anything changed."""
        with self._lock:
            stages = {a.stage_id: self._stages[a.stage_id] for a in actions if isinstance(a, KeepStage)}
            dropped = [self._stages[a.stage_id] for a in actions if isinstance(a, DropStage)]
        for stage_id in (a.stage_id for a in actions if isinstance(a, KeepStage) and a.changed):
            log.warning(
                "assignment %s changed within generation %d; keeping the running stage", stage_id,
                stages[stage_id].assignment.generation,
            )
        changed = bool(dropped)
        self._drop(dropped)  # takes them out of `_stages`, so `dropped` holds their last references
        new_failed: dict[str, ObservedStage] = {}
        for action in actions:
            if isinstance(action, ReportFailed):
                new_failed[action.observed.stage_id] = action.observed
            elif isinstance(action, BuildStage):
                outcome = self._build(action.assignment)
                if isinstance(outcome, HostedStage):
                    stages[action.assignment.stage_id], changed = outcome, True
                else:
                    new_failed[outcome.stage_id] = outcome
        with self._lock:
            self._stages, self._failed = stages, new_failed
        if changed:
            release_free_memory()  # what the build used only while loading, and what the old stages left
        return changed or new_failed != failed

    def _build(self, assignment: Assignment) -> HostedStage | ObservedStage:
        """The stage built from its assignment, or, if it cannot be built, its failure to report."""
        group = None
        try:
            group = stage_group(assignment, max_message_bytes=self._max_message_bytes)
            if group is not None:  # before the build: peers may push partials as soon as they run
                self.tensor_parallel.add(group)
            started = time.perf_counter()
            stage = build_hosted_stage(
                assignment,
                self._device,
                max_message_bytes=self._max_message_bytes,
                load_checkpoint=self._load_checkpoint,
                load_program=self._load_program,
                load_initial_weights=self._load_initial_weights,
                tensor_parallel=group,
                streams=self._streams,
                read_dataset=self._read_dataset,
            )
            seconds = time.perf_counter() - started
            if self._build_seconds is not None:
                source = "initial" if assignment.checkpoint is None else "checkpoint"
                self._build_seconds.labels(source=source).observe(seconds)
            log.info(
                "built %s (generation %d) in %.2f s: layers [%d, %d) on %s, %s; %s",
                assignment.stage_id,
                assignment.generation,
                seconds,
                assignment.layer_start,
                assignment.layer_end,
                self._device,
                "initial weights"
                if assignment.checkpoint is None
                else f"resumed from the checkpoint of step {assignment.checkpoint.step}",
                memory_summary(self._device),
            )
            return stage
        except Exception as exc:  # a stage that cannot be built is reported, not fatal
            # The traceback as text: a record holding the exception would hold this frame, and so the
            # stages in it, in any handler that keeps records.
            log.error("could not build %s\n%s", assignment.stage_id, traceback.format_exc())
            if group is not None:
                self.tensor_parallel.remove(group)
            return ObservedStage(
                assignment.stage_id,
                assignment.generation,
                ObservedState.FAILED,
                f"could not build the stage: {type(exc).__name__}: {exc}",
            )

    def _drop(self, dropped: list[HostedStage], *, release: bool = True) -> None:
        """Stop hosting `dropped` and let their memory go: calls still running in them end with ABORTED, and
        the drop waits (up to DROP_GRACE_SECONDS) until they have let go of the stages' tensors, unless
        `release` is false (nothing is built after it). The caller passes its only references."""
        if not dropped:
            return
        with self._lock:
            self._stages = {k: v for k, v in self._stages.items() if all(v is not d for d in dropped)}
        runtimes = [(old.assignment.stage_id, weakref.ref(old.runtime)) for old in dropped]
        for old in dropped:
            log.info("dropped %s (generation %d)", old.assignment.stage_id, old.assignment.generation)
            old.close()
            if old.tensor_parallel is not None:
                self.tensor_parallel.remove(old.tensor_parallel)
        del old
        dropped.clear()
        if not release:
            return
        # A call woken by close() still holds its stage until it unwinds; autograd graphs of an interrupted step
        # hold reference cycles, hence the collections.
        give_up = time.monotonic() + DROP_GRACE_SECONDS
        while True:
            gc.collect()
            held = [stage_id for stage_id, runtime in runtimes if runtime() is not None]
            if not held or time.monotonic() >= give_up:
                break
            time.sleep(0.05)
        if held:
            log.warning(
                "%s still referenced %.0f s after being dropped; its memory stays beside the next stage's",
                ", ".join(held),
                DROP_GRACE_SECONDS,
            )
        # Before anything is built: the dropped gradients and optimizer state sit in the heaps of the threads that
        # ran its steps, which a build on this thread would not reuse, so the new stage would add to them.
        release_free_memory()
        log.info("memory after the drop: %s", memory_summary(self._device))

    def resolve(self, ref: stage_pb2.StageRef) -> HostedStage:
        """The hosted stage a request addresses; NOT_FOUND or FAILED_PRECONDITION otherwise."""
        with self._lock:
            candidates = [
                s
                for s in self._stages.values()
                if s.assignment.job_id == ref.job_id
                and s.assignment.stage_index == ref.stage_index
                and (s.assignment.replica or 0) == ref.replica
            ]
        if not candidates:
            replica = f" replica {ref.replica}" if ref.replica else ""
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND,
                f"this agent hosts no stage {ref.stage_index}{replica} of job {ref.job_id!r}",
            )
        stage = candidates[0]
        if stage.assignment.generation != ref.generation:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stage {ref.stage_index} of job {ref.job_id} is at generation "
                f"{stage.assignment.generation} here; the request is for generation {ref.generation}",
            )
        return stage

    def adopt_stream(self, hello: Hello, sock: ssl.SSLSocket) -> None:
        """Hand a sibling's exchange stream (nodeagent.exchange_stream) to the hosted replica its hello names;
        RpcFailure (the stream is closed) where none is hosted here."""
        stage = self.resolve(stage_pb2.StageRef(job_id=hello.job_id, stage_index=hello.stage_index,
                                                generation=hello.generation, replica=hello.target))
        if stage.exchange is None or stage.assignment.replica is None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} is not replicated")
        stage.exchange.offer(hello, sock)

    def adopt_neighbour_stream(self, hello: NeighbourHello, sock: ssl.SSLSocket) -> None:
        """Hand a previous stage's neighbour stream (nodeagent.neighbour_stream) to the stage its hello names;
        RpcFailure (the stream is closed) where none is hosted here or it refuses the stream."""
        stage = self.resolve(stage_pb2.StageRef(job_id=hello.job_id, stage_index=hello.target,
                                                generation=hello.generation))
        stage.neighbours.offer(hello, sock)

    def guards(self) -> list[Guard]:
        """Whose calls this agent accepts: its hosted stages' credentials, and those of the tensor-parallel
        ranks still being built (their peers may already push partials)."""
        with self._lock:
            hosted = [stage.guard for stage in self._stages.values()]
        return hosted + self.tensor_parallel.guards()

    def stages(self) -> list[HostedStage]:
        with self._lock:
            return list(self._stages.values())

    def observed(self) -> list[ObservedStage]:
        with self._lock:
            ready = [
                ObservedStage(s.assignment.stage_id, s.assignment.generation, ObservedState.READY)
                for s in self._stages.values()
            ]
            return ready + list(self._failed.values())

    def close(self) -> None:
        """Stop hosting every stage as the agent stops. No full collection waits for their memory: nothing is
        built after them (a collection costs ~0.3 s in a large process, and tests stop many agents)."""
        with self._apply_lock:
            with self._lock:
                dropped = list(self._stages.values())
            self._drop(dropped, release=False)
