"""solve() with tensor-parallel stages: a split stage runs on a group of distinct devices whose every
member has room for its share, groups and singles never share a device, the reported costs are the
cost model's, and a split makes room (and time) that one device lacks."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.placement.solver import (
    BACKWARD_FACTOR,
    Device,
    LayerProfile,
    PlacementError,
    Workload,
    solve,
    stage_memory,
    stage_seconds,
)

WORKLOAD = Workload(micro_batch_size=4, micro_batches=2)


def gpt_layers(blocks: int, params: int = 10_000, flops: float = 1e6, hidden: int = 1024) -> list[LayerProfile]:
    """Embedding, `blocks` transformer blocks (the layers a group splits), head."""
    return [
        LayerProfile(flops / 100, params // 10, hidden),
        *(LayerProfile(flops, params, hidden, tensor_parallel=True) for _ in range(blocks)),
        LayerProfile(flops / 10, params // 10, 4 * hidden),
    ]


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[LayerProfile], list[Device], int, int, tuple[int, ...] | None]:
    layers = gpt_layers(draw(st.integers(1, 3)), params=draw(st.integers(1000, 20_000)))
    devices = [
        Device(
            id=f"d{i}",
            flops=draw(st.sampled_from([1e9, 2e9, 4e9])),
            memory_bytes=draw(st.integers(100_000, 1_000_000)),
            bandwidth_bytes_per_s=draw(st.sampled_from([1e7, math.inf])),
            latency_s=draw(st.sampled_from([0.0, 0.001])),
            price_per_hour=draw(st.sampled_from([0.1, 0.5])),
        )
        for i in range(draw(st.integers(2, 7)))
    ]
    size = draw(st.integers(2, 3))
    stages = draw(st.integers(1, len(layers)))
    split = draw(st.one_of(st.none(), st.sets(st.integers(0, stages - 1), min_size=1).map(lambda s: tuple(sorted(s)))))
    return layers, devices, size, stages, split


@settings(max_examples=300, deadline=None)
@given(problem=problems())
def test_split_stages_get_groups_of_distinct_devices_each_with_room_for_its_share(problem) -> None:
    layers, devices, size, stages, split = problem
    fixed = {"min_stages": stages, "max_stages": stages} if split is not None else {}
    try:
        placement = solve(layers, devices, WORKLOAD, tensor_parallel=size, split_stages=split, **fixed)
    except PlacementError:
        return  # what binds is tested below; here: whatever is placed is sound
    by_id = {d.id: d for d in devices}
    used = [d for s in placement.stages for d in s.device_ids]
    assert len(used) == len(set(used))  # no device in two stages, nor twice in one group
    assert placement.stages[0].layer_start == 0 and placement.stages[-1].layer_end == len(layers)
    assert all(a.layer_end == b.layer_start for a, b in itertools.pairwise(placement.stages))
    for index, stage in enumerate(placement.stages):
        ranks = size if split is None or index in split else 1
        assert len(stage.device_ids) == ranks
        members = [by_id[d] for d in stage.device_ids]
        assert stage.memory_bytes == stage_memory(layers[stage.layer_start : stage.layer_end], WORKLOAD, ranks)
        assert all(stage.memory_bytes <= d.memory_bytes for d in members)
    if split is not None:
        assert len(placement.stages) == stages
    assert math.isclose(placement.price_per_hour, sum(by_id[d].price_per_hour for d in used))
    assert math.isclose(placement.bottleneck_seconds, max(s.seconds_per_micro_batch for s in placement.stages))


def test_a_block_too_big_for_any_one_device_fits_split_over_two() -> None:
    layers = gpt_layers(1, params=100_000)  # the block's training state alone: 1.6 MB
    devices = [Device(f"d{i}", 1e9, 1_200_000) for i in range(2)]
    with pytest.raises(PlacementError, match="layer 1 needs"):
        solve(layers, devices, WORKLOAD)
    placement = solve(layers, devices, WORKLOAD, tensor_parallel=2)
    [stage] = placement.stages
    assert sorted(stage.device_ids) == ["d0", "d1"] and stage.memory_bytes <= 1_200_000
    assert stage.memory_bytes == stage_memory(layers, WORKLOAD, 2) < stage_memory(layers, WORKLOAD)


def test_a_split_halves_the_blocks_compute_and_pays_four_all_reduces_per_block() -> None:
    layers = gpt_layers(2)
    device = Device("g", 1e9, 10**9, bandwidth_bytes_per_s=1e8, latency_s=0.001)
    whole = stage_seconds(layers, device, WORKLOAD, last=True)
    split = stage_seconds(layers, device, WORKLOAD, last=True, ranks=2)
    block_compute = BACKWARD_FACTOR * WORKLOAD.micro_batch_size * 2 * 1e6 / 1e9
    all_reduces = 2 * 4 * (WORKLOAD.micro_batch_size * 1024 / 1e8 + 0.001)  # 2 blocks, 1 peer each
    assert split == pytest.approx(whole - block_compute / 2 + all_reduces)


def test_only_the_named_stage_is_split_and_its_group_is_the_fastest_devices() -> None:
    layers = gpt_layers(2)
    devices = [Device("slow", 1e9, 10**9), Device("fast-a", 4e9, 10**9), Device("fast-b", 4e9, 10**9)]
    placement = solve(layers, devices, WORKLOAD, min_stages=2, max_stages=2, tensor_parallel=2, split_stages=[1])
    assert [s.device_ids for s in placement.stages] == [("slow",), ("fast-a", "fast-b")]
    with pytest.raises(PlacementError, match="needs 3 devices for 2 stages"):
        solve(layers, devices[:2], WORKLOAD, min_stages=2, max_stages=2, tensor_parallel=2, split_stages=[1])


def test_every_stage_split_uses_whole_groups_only() -> None:
    layers = gpt_layers(4)
    devices = [Device(f"d{i}", 1e9, 10**9) for i in range(5)]  # two groups of 2; one device left over
    placement = solve(layers, devices, WORKLOAD, tensor_parallel=2)
    assert all(len(s.device_ids) == 2 for s in placement.stages)
    with pytest.raises(PlacementError, match="needs 6 devices for 3 stages"):
        solve(layers, devices, WORKLOAD, min_stages=3, tensor_parallel=2)
