"""Routing a step's micro-batches among replicas: every micro-batch once per stage, shares by speed, spread,
deterministic; the routes' JSON is strict; a repair's reroute moves only the lost replicas' micro-batches."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.errors import SpecError
from arceus.swarm.routing import Routes, reroute, route_step, shares, speeds_update, spread, stage_speeds

speed = st.floats(0.01, 1000.0, allow_nan=False)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[int, list[list[int]], dict[tuple[int, int], float]]:
    """(micro-batches, members per stage, speeds of some members)."""
    m = draw(st.integers(1, 24))
    members = []
    for _ in range(draw(st.integers(1, 5))):
        ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=min(m, 6), unique=True))
        members.append(sorted(ids))
    speeds = {
        (i, k): draw(speed) for i, ids in enumerate(members) for k in ids if draw(st.booleans())
    }
    return m, members, speeds


def quotas(m: int, weights: list[float]) -> list[Fraction]:
    """The proportional shares with members under 1 raised to 1 and the rest re-shared (what `shares`
    promises to stay within 1 of)."""
    exact = [Fraction(w) for w in weights]
    pinned: set[int] = set()
    while True:
        free = [k for k in range(len(weights)) if k not in pinned]
        q = {k: (m - len(pinned)) * exact[k] / sum(exact[j] for j in free) for k in free}
        under = {k for k in free if q[k] < 1}
        if not under:
            return [q.get(k, Fraction(1)) for k in range(len(weights))]
        pinned |= under


@given(pipelines())
def test_every_micro_batch_goes_once_to_a_member_of_each_stage(p: tuple) -> None:
    m, members, speeds = p
    routes = route_step(m, members, speeds)
    assert routes.num_micro_batches == m and routes.num_stages == len(members)
    for i, ids in enumerate(members):
        taken = sorted(mb for k in ids for mb in routes.micro_batches_of(i, k))
        assert taken == list(range(m))
        assert all(len(routes.micro_batches_of(i, k)) >= 1 for k in ids)  # M >= R here


@given(pipelines())
def test_shares_follow_speed_within_one_micro_batch(p: tuple) -> None:
    m, members, speeds = p
    routes = route_step(m, members, speeds)
    for i, ids in enumerate(members):
        weights = stage_speeds(i, ids, speeds)
        counts = [len(routes.micro_batches_of(i, k)) for k in ids]
        expected = quotas(m, weights)
        assert all(abs(c - q) < 1 for c, q in zip(counts, expected, strict=True)), (counts, expected)
        if all(m * Fraction(w) / sum(map(Fraction, weights)) >= 1 for w in weights):  # no member raised to 1
            assert expected == [m * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
        for a in range(len(ids)):
            for b in range(len(ids)):
                if weights[a] > weights[b]:
                    assert counts[a] >= counts[b]  # faster never takes fewer


@given(st.lists(speed, min_size=1, max_size=8), st.integers(0, 24))
def test_shares_give_each_replica_one_sum_to_the_step_and_never_fewer_to_the_faster(
    weights: list[float], extra: int
) -> None:
    m = len(weights) + extra  # R <= micro_batches
    counts = shares(m, weights)
    assert sum(counts) == m and min(counts) >= 1
    for a, b in zip(weights, counts, strict=True):
        assert all(b >= d for c, d in zip(weights, counts, strict=True) if a > c)


@given(pipelines())
def test_routing_is_deterministic(p: tuple) -> None:
    m, members, speeds = p
    again = route_step(m, [list(ids) for ids in members], dict(reversed(speeds.items())))
    assert route_step(m, members, speeds) == again


def test_unknown_speeds_take_the_stage_median_and_none_known_is_equal() -> None:
    assert stage_speeds(0, [1, 2, 3, 4], {(0, 1): 1.0, (0, 2): 3.0, (0, 3): 8.0, (1, 4): 100.0}) == [1.0, 3.0, 8.0, 3.0]
    assert stage_speeds(1, [0, 1], {}) == [1.0, 1.0]
    routes = route_step(6, [[0, 1, 2]], {})
    assert [routes.micro_batches_of(0, k) for k in (0, 1, 2)] == [(0, 3), (1, 4), (2, 5)]


@given(st.lists(st.integers(0, 12), min_size=1, max_size=8).filter(lambda c: sum(c) > 0))
def test_spread_picks_each_member_its_count_evenly(counts: list[int]) -> None:
    picks = spread(counts)
    total = sum(counts)
    assert [picks.count(k) for k in range(len(counts))] == counts
    for k, c in enumerate(counts):  # in every prefix, member k's picks stay near its share: no block
        for n in range(1, total + 1):
            assert abs(picks[:n].count(k) - n * c / total) < 2


def test_a_fast_replica_takes_more_and_spread_interleaves() -> None:
    routes = route_step(8, [[3, 7]], {(0, 3): 300.0, (0, 7): 100.0})
    assert routes.micro_batches_of(0, 3) == (0, 1, 3, 4, 5, 7)
    assert routes.micro_batches_of(0, 7) == (2, 6)
    assert shares(4, [1000.0, 1.0]) == [3, 1]  # the slow one still takes one
    assert shares(3, [2.9, 0.05, 0.05]) == [1, 1, 1]


def test_more_replicas_than_micro_batches_is_an_error() -> None:
    with pytest.raises(ValueError, match="stage 1 has 3 replicas for 2 micro-batches"):
        route_step(2, [[0], [0, 1, 2]], {})
    with pytest.raises(ValueError, match="positive finite"):
        route_step(2, [[0, 1]], {(0, 1): 0.0})
    with pytest.raises(SpecError, match="unique and ascending"):
        route_step(2, [[1, 0]], {})


def test_single_is_replica_zero_everywhere() -> None:
    routes = Routes.single(3, 4)
    assert routes.members == ((0,), (0,), (0,))
    assert routes.of == ((0, 0, 0),) * 4
    assert routes.micro_batches_of(2, 0) == (0, 1, 2, 3)
    assert route_step(4, [[0]] * 3, {}) == routes


@given(pipelines())
def test_json_round_trips(p: tuple) -> None:
    routes = route_step(*p)
    assert Routes.from_json(routes.to_json()) == routes


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ([], "routes", "must be an object"),
        ({"members": [[0]]}, "routes", "missing keys ['of']"),
        ({"members": [[0]], "of": [[0]], "x": 1}, "routes", "unknown keys ['x']"),
        ({"members": [[0, 0]], "of": [[0]]}, "routes.members[0]", "unique and ascending"),
        ({"members": [[0], []], "of": [[0, 0]]}, "routes.members[1]", "at least 1 replica"),
        ({"members": [[0]], "of": [[0, 0]]}, "routes.of[0]", "names 2 replicas for 1 stages"),
        ({"members": [[0, 2]], "of": [[2], [1]]}, "routes.of[1][0]", "replica 1 is not a member of stage 0"),
        ({"members": [[0]], "of": [[True]]}, "routes.of[0][0]", "must be an integer"),
        ({"members": [[0]], "of": []}, "routes.of", "at least 1 micro-batch"),
        ({"members": [["a"]], "of": [[0]]}, "routes.members[0][0]", "must be an integer"),
    ],
)
def test_json_is_strict(data: object, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as caught:
        Routes.from_json(data)
    assert caught.value.field == field
    assert fragment in caught.value.message


def test_json_errors_carry_the_callers_field() -> None:
    with pytest.raises(SpecError) as caught:
        Routes.from_json({"members": [[0]], "of": [[1]]}, field="step.routes")
    assert caught.value.field == "step.routes.of[0][0]"


def test_micro_batches_of_a_stranger_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"replica 5 is not a member of stage 0: \(0,\)"):
        Routes.single(1, 1).micro_batches_of(0, 5)


@given(pipelines(), st.data())
def test_reroute_moves_only_the_lost_replicas_micro_batches(p: tuple, data: st.DataObject) -> None:
    m, members, speeds = p
    routes = route_step(m, members, speeds)
    lost = {
        (i, k)
        for i, ids in enumerate(members)
        for k in data.draw(st.lists(st.sampled_from(ids), max_size=len(ids) - 1))
    }
    new = reroute(routes, lost, speeds)
    for i in range(len(members)):
        assert new.members[i] == tuple(k for k in members[i] if (i, k) not in lost)
    for old_route, new_route in zip(routes.of, new.of, strict=True):
        for i, (a, b) in enumerate(zip(old_route, new_route, strict=True)):
            assert b == a or (i, a) in lost
            assert (i, b) not in lost


def test_reroute_gives_the_lost_share_to_who_finishes_first() -> None:
    routes = route_step(8, [[0, 1, 2]], {})  # 3, 3, 2
    new = reroute(routes, {(0, 2)}, {(0, 0): 1.0, (0, 1): 3.0})
    assert len(new.micro_batches_of(0, 0)) == 3 and len(new.micro_batches_of(0, 1)) == 5
    with pytest.raises(ValueError, match="stage 0 lost every replica"):
        reroute(routes, {(0, 0), (0, 1), (0, 2)}, {})


def test_speeds_update_is_an_ewma() -> None:
    previous = {(0, 0): 10.0, (0, 1): 20.0}
    assert speeds_update(previous, {(0, 0): 20.0, (1, 0): 5.0}, 0.25) == {(0, 0): 12.5, (0, 1): 20.0, (1, 0): 5.0}
    assert speeds_update(previous, {(0, 1): 4.0}, 1.0)[(0, 1)] == 4.0
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        speeds_update(previous, {}, 0.0)
    with pytest.raises(ValueError, match="measured speed of stage 0 replica 1"):
        speeds_update(previous, {(0, 1): float("nan")}, 0.5)
