"""solve() under a time budget: it stops at its deadline on the largest inputs the control plane accepts,
returning the best placement it has (marked cut short) or saying it ran out. The clock is a counter, so
these tests measure the solver's own reads of time, not wall time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from arceus.placement.solver import Budget, Device, LayerProfile, PlacementError, Workload, solve, stage_memory
from tests.arceus.placement.test_placement_solver import WORKLOAD, problems

LAYERS = [LayerProfile(1e9, 1_000_000, 4096, stash_bytes_per_sample=4096) for _ in range(128)]  # the layer cap
DEVICES = [Device(f"d{i}", flops=1e12 * (1 + i % 7), memory_bytes=2**34, price_per_hour=0.3) for i in range(64)]


class Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads - 1)


def test_a_huge_search_stops_at_its_deadline_without_a_placement_and_says_so() -> None:
    clock = Ticks()
    with pytest.raises(PlacementError, match="ran out of its 500 s .* 128 layers over 8 candidate devices"):
        solve(LAYERS, DEVICES, Workload(8, 8), budget=Budget(500, clock))
    assert clock.reads == 501  # the start, then every check up to the first one past the deadline


def test_a_search_cut_short_returns_the_best_placement_over_the_fastest_candidates() -> None:
    clock = Ticks()
    # 128·129/2 = 8256 (start, end) pairs are costed per candidate prefix: the first prefix (one device)
    # finishes, the second (two) does not.
    placement = solve(LAYERS, DEVICES, Workload(8, 8), budget=Budget(12_000, clock))
    assert clock.reads == 12_001 and placement.cut_short
    assert placement.stages[0].layer_start == 0 and placement.stages[-1].layer_end == len(LAYERS)
    fastest = min(DEVICES, key=lambda d: (-d.flops, d.id))  # the candidates' order
    assert [s.device_id for s in placement.stages] == [fastest.id]
    assert placement.stages[0].memory_bytes == stage_memory(LAYERS, Workload(8, 8)) <= fastest.memory_bytes


@settings(max_examples=100, deadline=None)
@given(problem=problems())
def test_a_budget_that_does_not_run_out_changes_nothing(problem) -> None:  # noqa: ANN001
    layers, devices, low, high, price = problem
    kwargs = {"min_stages": low, "max_stages": high, "max_price_per_hour": price}
    try:
        unbounded = solve(layers, devices, WORKLOAD, **kwargs)
    except PlacementError as exc:
        with pytest.raises(PlacementError) as bounded:
            solve(layers, devices, WORKLOAD, budget=Budget(math.inf, Ticks()), **kwargs)
        assert str(bounded.value) == str(exc)
        return
    assert solve(layers, devices, WORKLOAD, budget=Budget(math.inf, Ticks()), **kwargs) == unbounded
