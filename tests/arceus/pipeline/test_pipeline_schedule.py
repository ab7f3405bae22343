"""Ordering rules of the pipeline schedules, and a message-passing simulation proving no deadlock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.errors import SpecError
from arceus.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    replica_schedule,
    staleness_check,
)
from arceus.swarm.routing import Routes

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


@st.composite
def routes(draw: st.DrawFn) -> Routes:
    """Any routes: 1-4 replicas per stage (ids not from 0), each micro-batch to any member at each stage."""
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 12))
    members = tuple(
        tuple(sorted(draw(st.sets(st.integers(0, 9), min_size=1, max_size=4)))) for _ in range(n)
    )
    return Routes(members, tuple(tuple(draw(st.sampled_from(ids)) for ids in members) for _ in range(m)))


def simulate_replicas(
    lists: dict[tuple[int, int], list[Action]], route: Routes
) -> dict[tuple[int, int], list[Action]]:
    """Run every replica's list as a sequential process that blocks until its input arrived (sends are
    asynchronous): F(m) on (stage s, replica r) needs F(m) done by stage s-1's replica of m; B(m) needs
    its own F(m) and the B(m) of stage s+1's replica of m. Returns what each ran; fails on a deadlock."""
    n = route.num_stages
    done: set[tuple[int, int, Action]] = set()
    ran: dict[tuple[int, int], list[Action]] = {key: [] for key in lists}
    cursor = dict.fromkeys(lists, 0)
    while any(cursor[key] < len(lists[key]) for key in lists):
        progressed = False
        for (s, r), actions in lists.items():
            if cursor[(s, r)] == len(actions):
                continue
            action = actions[cursor[(s, r)]]
            mb = action.micro_batch
            assert route.of[mb][s] == r
            if action.kind == "F":
                ready = s == 0 or (s - 1, route.of[mb][s - 1], Action("F", mb)) in done
            else:
                ready = (s, r, Action("F", mb)) in done and (
                    s == n - 1 or (s + 1, route.of[mb][s + 1], Action("B", mb)) in done
                )
            if ready:
                done.add((s, r, action))
                ran[(s, r)].append(action)
                cursor[(s, r)] += 1
                progressed = True
        waiting = {key: lists[key][cursor[key]] for key in lists if cursor[key] < len(lists[key])}
        assert progressed, f"deadlock: replicas wait at {waiting}"
    return ran


@given(name=schedule_names, route=routes(), train=st.booleans(), deepest=st.integers(1, 4))
def test_replicas_never_deadlock_whatever_the_routes(name: str, route: Routes, train: bool, deepest: int) -> None:
    lists = {
        (s, r): replica_schedule(name, route.num_stages, s, route.micro_batches_of(s, r), train, replicas=deepest)
        for s in range(route.num_stages)
        for r in route.members[s]
    }
    ran = simulate_replicas(lists, route)
    for s in range(route.num_stages):  # every micro-batch ran once per direction on its routed replica
        assert sorted((a.kind, a.micro_batch) for r in route.members[s] for a in ran[(s, r)]) == sorted(
            [("F", mb) for mb in range(route.num_micro_batches)]
            + ([("B", mb) for mb in range(route.num_micro_batches)] if train else [])
        )


@given(name=schedule_names, n=stages, m=micro_batches, train=st.booleans(), data=st.data())
def test_a_replica_runs_the_jobs_list_restricted_to_its_micro_batches(
    name: str, n: int, m: int, train: bool, data: st.DataObject
) -> None:
    stage = data.draw(st.integers(0, n - 1))
    assert replica_schedule(name, n, stage, range(m), train) == build_schedule(name, n, m, train)[stage]
    mine = sorted(data.draw(st.sets(st.integers(0, m - 1))))
    restricted = [a for a in build_schedule(name, n, m, train)[stage] if a.micro_batch in mine]
    assert replica_schedule(name, n, stage, mine, train) == restricted  # whatever the step's micro-batch count
    for kind in "FB":  # each direction in the job's order
        in_order = [a.micro_batch for a in build_schedule(name, n, m, train)[stage] if a.kind == kind]
        assert [a.micro_batch for a in restricted if a.kind == kind] == [mb for mb in in_order if mb in mine]


@given(n=stages, per_replica=st.integers(1, 6), r=st.integers(1, 4), data=st.data())
def test_evenly_spread_replicas_each_run_one_f_one_b_over_their_own(
    n: int, per_replica: int, r: int, data: st.DataObject
) -> None:
    """Micro-batch m on replica m mod R at every stage: R pipelines side by side, each replica a stage of
    its own 1F1B, keeping as many micro-batches in flight as a stage alone does (so R replicas run R times
    as fast, not as fast as one)."""
    stage, k = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, r - 1))
    mine = list(range(k, per_replica * r, r))
    own = [Action(a.kind, mine[a.micro_batch]) for a in one_f_one_b(n, per_replica)[stage]]
    assert replica_schedule("1f1b", n, stage, mine, replicas=r) == own


def test_one_f_one_b_over_a_replicas_own_micro_batches_would_deadlock() -> None:
    """Why replica_schedule restricts the job's list: 1F1B with its warm-up counted in each replica's own
    micro-batches deadlocks on these routes (stage 0 runs B0 before F3, stage 1's replica 1 F3 before B0)."""
    route = Routes(((0,), (0, 1), (0,)), ((0, 1, 0), (0, 0, 0), (0, 0, 0), (0, 1, 0)))
    own = {
        (s, r): [Action(a.kind, route.micro_batches_of(s, r)[a.micro_batch]) for a in one_f_one_b(3, len(mbs))[s]]
        for s in range(3)
        for r in route.members[s]
        if (mbs := route.micro_batches_of(s, r))
    }
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_replicas(own, route)
    lists = {key: replica_schedule("1f1b", 3, key[0], route.micro_batches_of(*key)) for key in own}
    simulate_replicas(lists, route)


def test_replica_schedule_checks_its_arguments() -> None:
    assert replica_schedule("1f1b", 3, 1, []) == []
    with pytest.raises(ValueError, match="unique and ascending"):
        replica_schedule("1f1b", 3, 1, [2, 1])
    with pytest.raises(ValueError, match=r"stage must be in \[0, 3\)"):
        replica_schedule("gpipe", 3, 3, [0])
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        replica_schedule("zigzag", 3, 0, [])
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        replica_schedule("1f1b", 3, 0, [0], replicas=0)
    assert replica_schedule("1f1b", 2, 0, [3, 5], train=False) == [Action("F", 3), Action("F", 5)]


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


def simulate_stale(name: str, n: int, m: int, steps: int, rng: random.Random) -> dict[int, int]:
    """Staleness 1 on every stage: step t's list starts once step t-1's forwards are all done there and step t-2
    finished there; a step finishes (its update) after its actions and after step t-1 finished. Any ready action of
    any started step runs next, picked by `rng`. Returns the most micro-batches each stage held at once; fails on a
    deadlock or where more than two steps run on a stage at once."""
    lists = build_schedule(name, n, m)
    done: set[tuple[int, int, Action]] = set()
    cursor = {(s, t): 0 for s in range(n) for t in range(steps)}
    finished: set[tuple[int, int]] = set()
    held, peak = [0] * n, [0] * n

    def forwards_done(s: int, t: int) -> bool:
        return all((s, t, a) in done for a in lists[s] if a.kind == "F")

    def started(s: int, t: int) -> bool:
        return t == 0 or forwards_done(s, t - 1) and (t < 2 or (s, t - 2) in finished)

    def ready(s: int, t: int, a: Action) -> bool:
        if a.kind == "F":
            return s == 0 or (s - 1, t, a) in done
        return (s, t, Action("F", a.micro_batch)) in done and (s == n - 1 or (s + 1, t, a) in done)

    while len(finished) < n * steps:
        moves = [("act", s, t) for (s, t), c in cursor.items() if c < len(lists[s]) and started(s, t)
                 and ready(s, t, lists[s][c])]
        moves += [("update", s, t) for (s, t), c in cursor.items() if c == len(lists[s]) and (s, t) not in finished
                  and (t == 0 or (s, t - 1) in finished)]
        assert moves, f"deadlock at {cursor}"
        kind, s, t = rng.choice(moves)
        if kind == "update":
            finished.add((s, t))
            continue
        action = lists[s][cursor[(s, t)]]
        done.add((s, t, action))
        cursor[(s, t)] += 1
        held[s] += 1 if action.kind == "F" else -1
        peak[s] = max(peak[s], held[s])
        running = [u for u in range(steps) if started(s, u) and (s, u) not in finished]
        assert len(running) <= 2, f"stage {s} runs steps {running} at once"
    return dict(enumerate(peak))


@given(schedule_names, st.integers(1, 5), st.integers(1, 8), st.randoms(use_true_random=False))
def test_stale_steps_never_deadlock_and_hold_at_most_the_stale_peak(
    name: str, n: int, m: int, rng: random.Random
) -> None:
    peaks = simulate_stale(name, n, m, 4, rng)
    for s, held in peaks.items():
        assert held <= peak_in_flight(name, n, m, s, staleness=1)


@given(schedule_names, stages, micro_batches, st.data())
def test_the_stale_peak_adds_what_a_step_still_holds_after_its_last_forward(
    name: str, n: int, m: int, data: st.DataObject
) -> None:
    s = data.draw(st.integers(0, n - 1))
    actions = build_schedule(name, n, m)[s]
    last_forward = max(i for i, a in enumerate(actions) if a.kind == "F")
    still = sum(1 if a.kind == "F" else -1 for a in actions[: last_forward + 1])
    one = peak_in_flight(name, n, m, s)
    assert peak_in_flight(name, n, m, s, staleness=1) == one + still
    assert one < peak_in_flight(name, n, m, s, staleness=1) <= 2 * one


@pytest.mark.parametrize("bad", [2, -1, True, "1", 0.0, None])
def test_staleness_is_0_or_1(bad: object) -> None:
    with pytest.raises(SpecError, match="must be 0 .synchronous. or 1"):
        staleness_check(bad, "job.staleness")
    assert staleness_check(1) == 1 and staleness_check(0) == 0
