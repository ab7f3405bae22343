"""What applying a desired state changes in the hosted stages: a pure plan, executed by `HostedStages.apply`
(nodeagent/hosting.py), as the controller's rules are by its executor.

`plan_changes(hosted, failed, desired, rejected, memory)` compares what this agent hosts (each stage's
assignment), the failures it reports, and the whole desired state of a heartbeat answer, and returns the
actions that bring one to the other, in the order they must run:
1. `KeepStage`: a hosted stage the answer lists at the same generation (first: a new assignment cannot take
   the slot of one that stays);
2. `DropStage`: every other hosted stage, before anything is built, so a stage rebuilt at a new generation
   never holds its old weights, gradients and optimizer state beside the new ones;
3. `ReportFailed`: a listed stage that could not be parsed, one that failed to build at this generation
   before (not rebuilt on every answer), one whose slot (job, stage) another stage here holds, one that would
   not fit the owner's memory budget (with the bytes it needs);
4. `BuildStage`: each remaining listed stage, in the answer's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedStage, ObservedState
from arceus.model.expected_state import optimizer_kind
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import DECODE_SESSIONS, Workload, placed_stage_memory, stage_inference_memory


@dataclass(frozen=True)
class MemoryBudget:
    """The owner's budget for this agent's stages (the control plane's controls.max_memory_bytes; None: no cap),
    and what the agent held before any stage (reported at registration: placement leaves it room, so must the
    agent)."""

    max_bytes: int | None = None
    runtime_bytes: int = 0


@dataclass(frozen=True)
class KeepStage:
    stage_id: str
    changed: bool = False  # the answer's assignment differs within the generation (the running stage stays)


@dataclass(frozen=True)
class DropStage:
    stage_id: str


@dataclass(frozen=True)
class ReportFailed:
    observed: ObservedStage


@dataclass(frozen=True)
class BuildStage:
    assignment: Assignment


HostingAction = KeepStage | DropStage | ReportFailed | BuildStage


def plan_changes(
    hosted: Mapping[str, Assignment],
    failed: Mapping[str, ObservedStage],
    desired: Sequence[Assignment],
    rejected: Sequence[ObservedStage] = (),
    memory: MemoryBudget = MemoryBudget(),
) -> list[HostingAction]:
    """The actions that make the hosted stages (`hosted`: stage id → its assignment) match `desired` (the whole
    desired state), given the failures reported so far (`failed`, by stage id) and the listed stages that could
    not be parsed (`rejected`)."""
    wanted = {a.stage_id: a for a in desired}  # a stage listed twice: its last listing, as the answer means
    keeps = [
        KeepStage(stage_id, changed=hosted[stage_id] != assignment)
        for stage_id, assignment in wanted.items()
        if stage_id in hosted and hosted[stage_id].generation == assignment.generation
    ]
    kept = {keep.stage_id for keep in keeps}
    actions: list[HostingAction] = [*keeps]
    actions += [DropStage(stage_id) for stage_id in hosted if stage_id not in kept]
    actions += [ReportFailed(r) for r in rejected]
    slots = {_slot(hosted[stage_id]): stage_id for stage_id in kept}
    for stage_id, assignment in wanted.items():
        if stage_id in kept:
            continue
        earlier = failed.get(stage_id)
        if earlier is not None and earlier.generation == assignment.generation:
            actions.append(ReportFailed(earlier))
            continue
        holder = slots.get(_slot(assignment))
        refusal = (
            f"stage {assignment.stage_index} of job {assignment.job_id} is already hosted here as {holder}"
            if holder is not None
            else memory_refusal(assignment, memory)
        )
        if refusal is not None:
            actions.append(ReportFailed(ObservedStage(stage_id, assignment.generation, ObservedState.FAILED, refusal)))
            continue
        slots[_slot(assignment)] = stage_id
        actions.append(BuildStage(assignment))
    return actions


def memory_refusal(assignment: Assignment, memory: MemoryBudget) -> str | None:
    """Why the stage would not fit the owner's memory budget beside what the agent itself holds, or None:
    the placement's own estimate (weights, gradients, optimizer state and the activations of the micro-batches
    its schedule has in flight on this stage, `arceus.placement.solver.placed_stage_memory`); a stage served for
    inference, its weights and decoding caches (`stage_inference_memory`)."""
    if memory.max_bytes is None:
        return None
    need, held = stage_memory_need(assignment)
    if need + memory.runtime_bytes <= memory.max_bytes:
        return None
    return (
        f"needs {need:,} bytes for its {held} beside the "
        f"{memory.runtime_bytes:,} this agent holds, above the {memory.max_bytes:,} bytes this node's owner offers"
    )


def stage_memory_need(assignment: Assignment) -> tuple[int, str]:
    """The bytes the placement predicts the stage holds, and what they hold."""
    layers = layer_profiles(assignment.spec)[assignment.layer_start : assignment.layer_end]
    if assignment.inference:
        return stage_inference_memory(layers, DECODE_SESSIONS), "weights and decoding caches"
    ranks = assignment.tensor_parallel.size if assignment.tensor_parallel is not None else 1
    workload = Workload(
        assignment.max_micro_batch_size, assignment.micro_batches, assignment.schedule,
        optimizer=optimizer_kind(assignment.optimizer.name, assignment.optimizer.momentum),
        activation_checkpointing=assignment.activation_checkpointing, precision=assignment.precision,
        staleness=assignment.staleness,
    )
    need = placed_stage_memory(layers, workload, assignment.stage_index, assignment.num_stages, ranks)
    return need, "weights, gradients, optimizer state and activations"


def _slot(assignment: Assignment) -> tuple[str, int]:
    """What one agent hosts once: a job's stage (its ranks go to different agents)."""
    return assignment.job_id, assignment.stage_index
