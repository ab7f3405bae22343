"""Ordering rules of the pipeline schedules, and a message-passing simulation proving no deadlock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
)

stages = st.integers(1, 8)
micro_batches = st.integers(1, 16)
schedule_names = st.sampled_from(sorted(SCHEDULES))


def simulate(schedule: Schedule) -> int:
    """Run every stage's list as a sequential process that blocks until its input message arrived:
    F(m) on stage s needs stage s-1's F(m); B(m) needs stage s+1's B(m) (the last stage its own F(m)).
    Returns the number of rounds; fails on a deadlock."""
    n = len(schedule)
    done: set[tuple[int, Action]] = set()
    cursor = [0] * n
    rounds = 0
    while any(cursor[s] < len(schedule[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            if cursor[s] == len(schedule[s]):
                continue
            action = schedule[s][cursor[s]]
            if action.kind == "F":
                ready = s == 0 or (s - 1, Action("F", action.micro_batch)) in done
            else:
                ready = (s, Action("F", action.micro_batch)) in done and (
                    s == n - 1 or (s + 1, Action("B", action.micro_batch)) in done
                )
            if ready:
                done.add((s, action))
                cursor[s] += 1
                progressed = True
        assert progressed, (
            f"deadlock: stages wait at {[schedule[s][cursor[s] : cursor[s] + 1] for s in range(n)]}"
        )
        rounds += 1
    return rounds


@given(name=schedule_names, n=stages, m=micro_batches, train=st.booleans())
def test_every_micro_batch_runs_exactly_once_per_direction(name: str, n: int, m: int, train: bool) -> None:
    schedule = build_schedule(name, n, m, train)
    assert len(schedule) == n
    for actions in schedule:
        forwards = [a.micro_batch for a in actions if a.kind == "F"]
        backwards = [a.micro_batch for a in actions if a.kind == "B"]
        assert forwards == list(range(m))  # forwards always in order
        assert sorted(backwards) == (list(range(m)) if train else [])


@given(name=schedule_names, n=stages, m=micro_batches)
def test_forward_precedes_backward_on_every_stage(name: str, n: int, m: int) -> None:
    for actions in build_schedule(name, n, m):
        position = {(a.kind, a.micro_batch): i for i, a in enumerate(actions)}
        assert all(position[("F", mb)] < position[("B", mb)] for mb in range(m))


@given(name=schedule_names, n=stages, m=micro_batches, train=st.booleans())
def test_schedules_never_deadlock(name: str, n: int, m: int, train: bool) -> None:
    simulate(build_schedule(name, n, m, train))


@given(n=stages, m=micro_batches)
def test_gpipe_shape(n: int, m: int) -> None:
    expected = [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
    assert gpipe(n, m) == [expected] * n
    assert gpipe(n, m, train=False) == [expected[:m]] * n


@given(n=stages, m=micro_batches)
def test_one_f_one_b_bounds_activations_in_flight(n: int, m: int) -> None:
    for stage, actions in enumerate(one_f_one_b(n, m)):
        assert [a.micro_batch for a in actions if a.kind == "B"] == list(range(m))
        assert peak_in_flight("1f1b", n, m, stage) == min(n - stage, m)
        assert peak_in_flight("gpipe", n, m, stage) == m


def test_peak_in_flight_counts_forwards_not_yet_backed() -> None:
    assert [peak_in_flight("1f1b", 3, 4, stage) for stage in range(3)] == [3, 2, 1]  # F0 F1 F2 B0 F3 ...
    with pytest.raises(ValueError, match=r"stage must be in \[0, 3\)"):
        peak_in_flight("1f1b", 3, 4, 3)


def test_one_f_one_b_example() -> None:
    assert [" ".join(map(str, s)) for s in one_f_one_b(3, 4)] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


@pytest.mark.parametrize(
    ("args", "fragment"), [((0, 4), "at least 1 stage"), ((2, 0), "at least 1 micro-batch")]
)
def test_invalid_sizes(args: tuple[int, int], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        gpipe(*args)


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)
