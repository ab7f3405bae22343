"""The plan of what applying a desired state changes in the hosted stages (pure: no stage is built here)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedStage, ObservedState
from devtools.pipeline import pipeline_assignments
from nodeagent.hosting_plan import (
    BuildStage,
    DropStage,
    HostingAction,
    KeepStage,
    MemoryBudget,
    ReportFailed,
    plan_changes,
    stage_memory_need,
)


def _pipeline(job_id: str, layer_sizes: list[int]) -> list[Assignment]:
    raw = pipeline_assignments(
        job_id=job_id, model_config={"layer_sizes": layer_sizes}, boundaries=[0, 1, 2],
        addresses=["127.0.0.1:1", "127.0.0.1:2"], optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2,
        max_micro_batch_size=4,
    )
    return [Assignment.from_json(a) for a in raw]


# Two jobs of two stages each, of different sizes: the slots (job, stage) an agent may be assigned.
SLOTS = _pipeline("small", [8, 6, 4]) + _pipeline("large", [64, 512, 10])


# The assignments an agent may be given: one of the slots, at a generation, perhaps under another stage id (a
# second assignment of one slot), perhaps to serve it for inference, perhaps changed within its generation.
ASSIGNMENTS = [
    replace(slot, stage_id=slot.stage_id + alias, generation=generation, inference=inference, seed=seed)
    for slot in SLOTS for alias in ("", "-alias") for generation in (1, 2, 3) for inference in (False, True)
    for seed in (0, 1)
]
NEEDS = sorted({stage_memory_need(a)[0] for a in ASSIGNMENTS})


def assignments() -> st.SearchStrategy[Assignment]:
    return st.sampled_from(ASSIGNMENTS)


@st.composite
def hosted_stages(draw: st.DrawFn) -> dict[str, Assignment]:
    """What an agent hosts: at most one stage per slot (the plan sees to that)."""
    hosted = {}
    for a in draw(st.lists(assignments(), max_size=4)):
        if all((h.job_id, h.stage_index) != (a.job_id, a.stage_index) for h in hosted.values()):
            hosted[a.stage_id] = a
    return hosted


failures = st.builds(
    lambda a, message: ObservedStage(a.stage_id, a.generation, ObservedState.FAILED, message),
    assignments(), st.sampled_from(["could not build the stage: OSError: disk full", "needs more"]),
)
rejections = st.lists(
    st.builds(lambda i: ObservedStage(f"<assignment {i}>", 0, ObservedState.FAILED, "invalid assignment: x"),
              st.integers(0, 3)),
    max_size=2, unique_by=lambda r: r.stage_id,
)
budgets = st.builds(
    MemoryBudget,
    st.one_of(st.none(), st.sampled_from(NEEDS), st.sampled_from(NEEDS).map(lambda n: n - 1), st.integers(0, 10**9)),
    st.sampled_from([0, 0, 1, 5_000]),
)


@st.composite
def situations(draw: st.DrawFn) -> tuple[dict[str, Assignment], dict[str, ObservedStage], list[Assignment],
                                         list[ObservedStage], MemoryBudget]:
    hosted = draw(hosted_stages())
    failed = {f.stage_id: f for f in draw(st.lists(failures, max_size=3)) if f.stage_id not in hosted}
    desired = draw(st.lists(st.one_of(assignments(), st.sampled_from(list(hosted.values()) or SLOTS)), max_size=6))
    return hosted, failed, desired, draw(rejections), draw(budgets)


def _of(actions: list[HostingAction], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def _ids(actions: list[HostingAction]) -> list[str]:
    return [a.assignment.stage_id if isinstance(a, BuildStage) else
            a.observed.stage_id if isinstance(a, ReportFailed) else a.stage_id for a in actions]


@given(situations())
def test_every_hosted_stage_is_kept_or_dropped_and_never_both(situation: tuple) -> None:
    hosted, _, desired, _, _ = situation
    actions = plan_changes(*situation)
    kept, dropped = _ids(_of(actions, KeepStage)), _ids(_of(actions, DropStage))
    assert sorted(kept + dropped) == sorted(hosted)
    assert not set(kept) & set(dropped)
    wanted = {a.stage_id: a for a in desired}
    assert set(kept) == {s for s, a in hosted.items() if s in wanted and wanted[s].generation == a.generation}


@given(situations())
def test_every_drop_comes_before_every_build(situation: tuple) -> None:
    """A stage replaced by its next generation frees its memory before its successor is built."""
    actions = plan_changes(*situation)
    kinds = [type(a) for a in actions]
    if DropStage in kinds and BuildStage in kinds:
        assert max(i for i, k in enumerate(kinds) if k is DropStage) < kinds.index(BuildStage)
    keeps = [i for i, k in enumerate(kinds) if k is KeepStage]
    assert keeps == list(range(len(keeps)))  # the running stages hold their slots before anything new


@given(situations())
def test_every_listed_stage_has_one_outcome_and_one_slot_holds_one_stage(situation: tuple) -> None:
    hosted, _, desired, rejected, _ = situation
    actions = plan_changes(*situation)
    outcomes = [a for a in actions if not isinstance(a, DropStage) and a not in [ReportFailed(r) for r in rejected]]
    assert sorted(_ids(outcomes)) == sorted({a.stage_id for a in desired})
    running = [hosted[a.stage_id] for a in _of(actions, KeepStage)] + [a.assignment for a in _of(actions, BuildStage)]
    slots = [(a.job_id, a.stage_index) for a in running]
    assert len(slots) == len(set(slots))
    last_listing = {a.stage_id: a for a in desired}
    assert all(b.assignment is last_listing[b.assignment.stage_id] for b in _of(actions, BuildStage))
    assert [a.observed for a in _of(actions, ReportFailed)][: len(rejected)] == rejected  # reported as they came


@given(situations())
def test_a_stage_that_cannot_fit_is_reported_failed_with_its_bytes(situation: tuple) -> None:
    hosted, failed, desired, rejected, memory = situation
    actions = plan_changes(*situation)
    reports = {a.observed.stage_id: a.observed for a in _of(actions, ReportFailed)}
    for a in _of(actions, BuildStage):
        assert memory.max_bytes is None or stage_memory_need(a.assignment)[0] + memory.runtime_bytes <= memory.max_bytes
    for stage_id, report in reports.items():
        if "needs " in report.message and "this node's owner offers" in report.message:
            assignment = {a.stage_id: a for a in desired}[stage_id]
            need = stage_memory_need(assignment)[0]
            assert memory.max_bytes is not None and need + memory.runtime_bytes > memory.max_bytes
            assert f"needs {need:,} bytes" in report.message
            assert f"above the {memory.max_bytes:,} bytes" in report.message


@given(situations())
def test_a_failure_at_the_listed_generation_is_reported_again_not_rebuilt(situation: tuple) -> None:
    hosted, failed, desired, _, _ = situation
    actions = plan_changes(*situation)
    wanted = {a.stage_id: a for a in desired}
    built = set(_ids(_of(actions, BuildStage)))
    for stage_id, failure in failed.items():
        if stage_id in wanted and wanted[stage_id].generation == failure.generation:
            assert ReportFailed(failure) in actions and stage_id not in built
        elif stage_id not in wanted:
            assert ReportFailed(failure) not in actions  # a stage no longer listed is no longer reported


@given(situations())
def test_once_carried_out_the_plan_asks_for_nothing_more(situation: tuple) -> None:
    """Level-triggered: planning again from what the plan left (its builds succeeded) keeps everything."""
    hosted, _, desired, rejected, memory = situation
    actions = plan_changes(*situation)
    after = {a.stage_id: hosted[a.stage_id] for a in _of(actions, KeepStage)}
    after |= {a.assignment.stage_id: a.assignment for a in _of(actions, BuildStage)}
    reported = {a.observed.stage_id: a.observed for a in _of(actions, ReportFailed)}
    again = plan_changes(after, reported, desired, rejected, memory)
    assert not _of(again, DropStage) and not _of(again, BuildStage)
    assert sorted(_ids(_of(again, KeepStage))) == sorted(after)
    assert {a.observed.stage_id: a.observed for a in _of(again, ReportFailed)} == reported


def test_a_new_generation_drops_the_old_then_builds_and_a_same_generation_change_keeps_it() -> None:
    old, other = SLOTS[0], SLOTS[1]
    new = replace(old, generation=2)
    assert plan_changes({old.stage_id: old, other.stage_id: other}, {}, [new]) == [
        DropStage(old.stage_id), DropStage(other.stage_id), BuildStage(new)
    ]
    assert plan_changes({old.stage_id: old}, {}, [replace(old, seed=7)]) == [KeepStage(old.stage_id, changed=True)]
    assert plan_changes({old.stage_id: old}, {}, [old]) == [KeepStage(old.stage_id)]


def test_the_budget_is_the_stages_need_beside_what_the_agent_holds() -> None:
    stage = SLOTS[3]
    need = stage_memory_need(stage)[0]
    assert plan_changes({}, {}, [stage], memory=MemoryBudget(need + 5_000, 5_000)) == [BuildStage(stage)]
    [refused] = plan_changes({}, {}, [stage], memory=MemoryBudget(need + 4_999, 5_000))
    assert isinstance(refused, ReportFailed) and refused.observed.generation == stage.generation
    assert refused.observed.message == (
        f"needs {need:,} bytes for its weights, gradients, optimizer state and activations beside the 5,000 this "
        f"agent holds, above the {need + 4_999:,} bytes this node's owner offers"
    )
    served = replace(stage, inference=True)  # weights and decoding caches only: less than training needs
    assert stage_memory_need(served) == (stage_memory_need(served)[0], "weights and decoding caches")
    assert stage_memory_need(served)[0] < need


def test_a_second_stage_of_a_slot_is_refused_whether_it_runs_or_is_listed_first() -> None:
    running = SLOTS[0]
    newcomer = replace(running, stage_id="other-id")
    refusal = f"stage 0 of job small is already hosted here as {running.stage_id}"
    assert plan_changes({running.stage_id: running}, {}, [newcomer, running]) == [
        KeepStage(running.stage_id), ReportFailed(ObservedStage("other-id", 1, ObservedState.FAILED, refusal)),
    ]
    assert plan_changes({}, {}, [running, newcomer]) == [
        BuildStage(running), ReportFailed(ObservedStage("other-id", 1, ObservedState.FAILED, refusal)),
    ]
