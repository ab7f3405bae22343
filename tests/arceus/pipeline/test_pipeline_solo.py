"""Solo actions (no other stage can compute meanwhile): proven against timed runs of the schedules with
random action and transfer times, also when a stage knows which of its inputs have arrived; the
fill/drain actions of GPipe and 1F1B named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.pipeline.schedule import SCHEDULES, Action, Schedule, build_schedule
from arceus.pipeline.solo import SoloPlanner, solo_actions, solo_planner

Interval = tuple[float, float]


def timed_run(schedule: Schedule, duration: dict[tuple[int, int], float], latency: float) -> list[list[Interval]]:
    """(start, end) of every action when each stage runs its list in order and starts an action as soon
    as its input has arrived (`latency` after the producing action ended). Every output is sent on at
    once, so it arrives `latency` after its action ends."""
    n = len(schedule)
    position = [{(a.kind, a.micro_batch): i for i, a in enumerate(actions)} for actions in schedule]
    times: list[list[Interval]] = [[] for _ in schedule]
    while any(len(times[s]) < len(schedule[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            i = len(times[s])
            if i == len(schedule[s]):
                continue
            action = schedule[s][i]
            if action.kind == "F" and s > 0:
                source: tuple[int, int] | None = (s - 1, position[s - 1][("F", action.micro_batch)])
            elif action.kind == "B" and s < n - 1:
                source = (s + 1, position[s + 1][("B", action.micro_batch)])
            else:
                source = None
            if source is not None and len(times[source[0]]) <= source[1]:
                continue
            start = times[s][i - 1][1] if i else 0.0
            if source is not None:
                start = max(start, times[source[0]][source[1]][1] + latency)
            times[s].append((start, start + duration[(s, i)]))
            progressed = True
        assert progressed
    return times


def draw_durations(schedule: Schedule, data: st.DataObject) -> dict[tuple[int, int], float]:
    """A random compute time for every action of every stage."""
    seconds = st.floats(0.01, 10.0)
    return {(s, i): data.draw(seconds) for s, actions in enumerate(schedule) for i in range(len(actions))}


def overlapping(times: list[list[Interval]], stage: int, start: float, end: float) -> list[tuple[int, int]]:
    """(stage, action) of the other stages' actions that run at some moment in [start, end)."""
    return [
        (t, j) for t in range(len(times)) if t != stage for j, (a, b) in enumerate(times[t]) if a < end and start < b
    ]


@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    n=st.integers(1, 5),
    m=st.integers(1, 8),
    train=st.booleans(),
    data=st.data(),
)
def test_no_other_stage_computes_during_a_solo_action(
    name: str, n: int, m: int, train: bool, data: st.DataObject
) -> None:
    schedule = build_schedule(name, n, m, train)
    times = timed_run(schedule, draw_durations(schedule, data), latency=data.draw(st.floats(0.0, 1.0)))
    for s in range(n):
        for (start, end), solo in zip(times[s], solo_actions(schedule, s), strict=True):
            if solo:
                assert overlapping(times, s, start, end) == []


@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    n=st.integers(2, 5),
    m=st.integers(1, 8),
    train=st.booleans(),
    data=st.data(),
)
def test_what_has_arrived_proves_more_actions_solo_and_never_wrongly(
    name: str, n: int, m: int, train: bool, data: st.DataObject
) -> None:
    """At an action's start, the neighbours' outputs that have arrived (their actions ended at least
    `latency` before) join what is known done; a solo verdict on that is still never overlapped."""
    schedule = build_schedule(name, n, m, train)
    planner = SoloPlanner(schedule)
    latency = data.draw(st.floats(0.0, 1.0))
    times = timed_run(schedule, draw_durations(schedule, data), latency)
    for s in range(n):
        for i, (start, end) in enumerate(times[s]):
            arrived = [
                action
                for t, kind in ((s - 1, "F"), (s + 1, "B"))
                if 0 <= t < n
                for action, (_, produced) in zip(schedule[t], times[t], strict=True)
                if action.kind == kind and produced + latency <= start
            ]
            static = planner.solo(s, i)
            if planner.solo(s, i, arrived):
                assert overlapping(times, s, start, end) == []
            else:
                assert not static  # knowing more never takes a solo verdict back


def test_one_f_one_b_second_stage_first_backward_is_solo_once_the_next_forward_is_in() -> None:
    """1F1B on 2 stages: stage 0 runs F0 F1 B0; once F1's activation has reached stage 1, stage 0 can only
    wait for B0's gradient, so stage 1's B0 computes alone."""
    planner = SoloPlanner(build_schedule("1f1b", 2, 4))
    assert str(planner.schedule[1][1]) == "B0"
    assert not planner.solo(1, 1)
    assert not planner.solo(1, 1, [Action("F", 0)])
    assert planner.solo(1, 1, [Action("F", 0), Action("F", 1)])


@given(name=st.sampled_from(sorted(SCHEDULES)), n=st.integers(1, 6), m=st.integers(1, 8), train=st.booleans())
def test_fill_and_drain(name: str, n: int, m: int, train: bool) -> None:
    """The first stage's first forward runs before anyone else computes; on one stage every action is
    solo; in training the first stage's last backward runs after everything else (none compute then)."""
    schedule = build_schedule(name, n, m, train)
    first = solo_actions(schedule, 0)
    assert first[0]
    if n == 1:
        assert all(first)
    if train:
        assert first[-1]


def test_gpipe_two_stages() -> None:
    """Stage 0 computes alone in F0 (stage 1 waits for it) and B0 (stage 1 is done); stage 1 alone in
    F3 and B3, while stage 0 waits for B3's gradient."""
    schedule = build_schedule("gpipe", 2, 4)
    assert _marked(schedule) == ["F0* F1 F2 F3 B3 B2 B1 B0*", "F0 F1 F2 F3* B3* B2 B1 B0"]


def test_one_f_one_b_three_stages() -> None:
    """1F1B keeps every stage busy but for the fill and drain of the first stage."""
    schedule = build_schedule("1f1b", 3, 4)
    assert _marked(schedule) == [
        "F0* F1 F2 B0 F3 B1 B2 B3*",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_forward_only_steps() -> None:
    """Evaluation: the first forward of the first stage and the last forward of the last stage."""
    schedule = build_schedule("gpipe", 3, 3, train=False)
    assert _marked(schedule) == ["F0* F1 F2", "F0 F1 F2", "F0 F1 F2*"]


@given(name=st.sampled_from(sorted(SCHEDULES)), n=st.integers(1, 6), m=st.integers(1, 8))
def test_only_the_first_stage_steps_its_optimizer_alone(name: str, n: int, m: int) -> None:
    """Every stage's last action feeds the first stage's last backward; the other stages finish first
    and step while it still computes."""
    planner = SoloPlanner(build_schedule(name, n, m))
    assert [planner.solo_optimizer_step(s) for s in range(n)] == [True] + [False] * (n - 1)


def test_solo_planner_names_a_schedule() -> None:
    planner = solo_planner("1f1b", 3, 4, True)
    assert planner.schedule == build_schedule("1f1b", 3, 4)
    assert solo_planner("1f1b", 3, 4, True) is planner  # built once per schedule
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        solo_planner("zigzag", 2, 4, True)


def _marked(schedule: Schedule) -> list[str]:
    return [
        " ".join(f"{a}{'*' if solo else ''}" for a, solo in zip(actions, solo_actions(schedule, s), strict=True))
        for s, actions in enumerate(schedule)
    ]
