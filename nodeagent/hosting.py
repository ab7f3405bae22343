"""The stages this agent hosts, kept in sync with the desired state it is given (like a kubelet).

`apply` is level-triggered: the list it receives is the whole desired state. New (stage_id, generation)
pairs are built from their spec, stages not listed are dropped, and a stage that failed to build stays
failed (and reported) until a new generation replaces it.
"""

from __future__ import annotations

import gc
import logging
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
from arceus.model.decoding import DECODE_SESSIONS
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import Workload, stage_inference_memory, stage_memory
from arceus.v1 import stage_pb2
from nodeagent.all_reduce import TensorParallelGroups, stage_group
from nodeagent.callers import Guard
from nodeagent.device import memory_summary
from nodeagent.heap import release_free_memory
from nodeagent.rpc import RpcFailure
from nodeagent.stage import CheckpointLoader, HostedStage, InitialWeightsLoader, ProgramLoader, build_hosted_stage

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
    ) -> None:
        """`build_seconds`: observes each stage build's wall time, labelled by `source` (initial or checkpoint)."""
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

    def apply(self, assignments: Sequence[Assignment], rejected: Sequence[ObservedStage] = ()) -> bool:
        """Make the hosted stages match `assignments`; `rejected` are listed stages that could not even be
        parsed (reported as failed). Returns whether anything changed."""
        with self._apply_lock:
            with self._lock:
                current, failed = dict(self._stages), dict(self._failed)
            before = {stage_id: id(stage) for stage_id, stage in current.items()}
            desired = {a.stage_id: a for a in assignments}
            stages: dict[str, HostedStage] = {}
            new_failed: dict[str, ObservedStage] = {r.stage_id: r for r in rejected}
            # Running stages first, so a new assignment cannot take the slot of one that stays.
            stages.update(_still_hosted(current, desired))
            # The rest go before anything is built: a stage rebuilt at a new generation must not hold its
            # old weights, gradients and optimizer state beside the new ones (nor may `current` keep them).
            dropped = [stage for stage_id, stage in current.items() if stages.get(stage_id) is not stage]
            del current
            self._drop(dropped)
            for stage_id, assignment in desired.items():
                if stage_id in stages:
                    continue
                earlier = failed.get(stage_id)
                if earlier is not None and earlier.generation == assignment.generation:
                    new_failed[stage_id] = earlier
                    continue
                clash = next((s for s in stages.values() if _same_slot(s.assignment, assignment)), None)
                if clash is not None:
                    new_failed[stage_id] = ObservedStage(
                        stage_id,
                        assignment.generation,
                        ObservedState.FAILED,
                        f"stage {assignment.stage_index} of job {assignment.job_id} is already hosted here "
                        f"as {clash.assignment.stage_id}",
                    )
                    continue
                refusal = self._over_budget(assignment)
                if refusal is not None:
                    new_failed[stage_id] = ObservedStage(stage_id, assignment.generation, ObservedState.FAILED, refusal)
                    continue
                group = None
                try:
                    group = stage_group(assignment, max_message_bytes=self._max_message_bytes)
                    if group is not None:  # before the build: peers may push partials as soon as they run
                        self.tensor_parallel.add(group)
                    started = time.perf_counter()
                    stages[stage_id] = build_hosted_stage(
                        assignment,
                        self._device,
                        max_message_bytes=self._max_message_bytes,
                        load_checkpoint=self._load_checkpoint,
                        load_program=self._load_program,
                        load_initial_weights=self._load_initial_weights,
                        tensor_parallel=group,
                    )
                    seconds = time.perf_counter() - started
                    if self._build_seconds is not None:
                        source = "initial" if assignment.checkpoint is None else "checkpoint"
                        self._build_seconds.labels(source=source).observe(seconds)
                    log.info(
                        "built %s (generation %d) in %.2f s: layers [%d, %d) on %s, %s; %s",
                        stage_id,
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
                except Exception as exc:  # a stage that cannot be built is reported, not fatal
                    # The traceback as text: a record holding the exception would hold this frame, and so the
                    # stages in it, in any handler that keeps records.
                    log.error("could not build %s\n%s", stage_id, traceback.format_exc())
                    if group is not None:
                        self.tensor_parallel.remove(group)
                    new_failed[stage_id] = ObservedStage(
                        stage_id,
                        assignment.generation,
                        ObservedState.FAILED,
                        f"could not build the stage: {type(exc).__name__}: {exc}",
                    )
            with self._lock:
                self._stages, self._failed = stages, new_failed
            changed = {k: id(v) for k, v in stages.items()} != before
            if changed:
                release_free_memory()  # what the build used only while loading, and what the old stages left
            return changed or new_failed != failed

    def _over_budget(self, assignment: Assignment) -> str | None:
        """Why the stage would not fit the owner's memory budget beside what the agent itself holds, or None:
        the placement's own estimate (weights, gradients, optimizer state and the activations of the
        micro-batches its schedule has in flight on this stage, `arceus.placement.solver.stage_memory`); a stage
        served for inference, its weights and decoding caches (`stage_inference_memory`)."""
        budget = self.memory_budget
        if budget is None:
            return None
        layers = layer_profiles(assignment.spec)[assignment.layer_start : assignment.layer_end]
        if assignment.inference:
            need, held = stage_inference_memory(layers, DECODE_SESSIONS), "weights and decoding caches"
        else:
            ranks = assignment.tensor_parallel.size if assignment.tensor_parallel is not None else 1
            workload = Workload(assignment.max_micro_batch_size, assignment.micro_batches, assignment.schedule)
            in_flight = workload.in_flight(assignment.stage_index, assignment.num_stages)
            need = stage_memory(layers, workload, ranks, in_flight)
            held = "weights, gradients, optimizer state and activations"
        if need + self.runtime_bytes <= budget:
            return None
        return (
            f"needs {need:,} bytes for its {held} beside the "
            f"{self.runtime_bytes:,} this agent holds, above the {budget:,} bytes this node's owner offers"
        )

    def _drop(self, dropped: list[HostedStage]) -> None:
        """Stop hosting `dropped` and let their memory go: calls still running in them end with ABORTED, and
        the drop waits (up to DROP_GRACE_SECONDS) until they have let go of the stages' tensors. The caller
        passes its only references."""
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
                if s.assignment.job_id == ref.job_id and s.assignment.stage_index == ref.stage_index
            ]
        if not candidates:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND,
                f"this agent hosts no stage {ref.stage_index} of job {ref.job_id!r}",
            )
        stage = candidates[0]
        if stage.assignment.generation != ref.generation:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stage {ref.stage_index} of job {ref.job_id} is at generation "
                f"{stage.assignment.generation} here; the request is for generation {ref.generation}",
            )
        return stage

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
        self.apply([])


def _same_slot(a: Assignment, b: Assignment) -> bool:
    return a.job_id == b.job_id and a.stage_index == b.stage_index


def _still_hosted(current: dict[str, HostedStage], desired: dict[str, Assignment]) -> dict[str, HostedStage]:
    """The hosted stages the desired state keeps at their generation. (A function of its own: a loop
    variable left in `apply` would hold a replaced stage, and its memory, through the rebuild.)"""
    kept = {}
    for stage_id, assignment in desired.items():
        stage = current.get(stage_id)
        if stage is not None and stage.assignment.generation == assignment.generation:
            if stage.assignment != assignment:
                log.warning(
                    "assignment %s changed within generation %d; keeping the running stage", stage_id,
                    assignment.generation,
                )
            kept[stage_id] = stage
    return kept
