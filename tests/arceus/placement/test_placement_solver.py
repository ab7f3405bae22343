"""solve(): exact on small cases (checked against brute force), memory never exceeded, budget and stage
counts respected, faster devices get proportionately more of the model, and relayed devices pay their link both
ways and are kept off the stages whose links bind."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from arceus.placement.solver import (
    OPTIMIZER_LIBRARY_BYTES,
    PRICE_ROUNDING,
    PRICE_TOLERANCE,
    TRAINING_BYTES_PER_PARAMETER,
    Device,
    LayerProfile,
    PlacementError,
    Workload,
    backward_workspace_bytes,
    heap_kept_bytes,
    layer_training_memory,
    micro_batch_bytes,
    optimizer_step_bytes,
    solve,
    stage_memory,
    stage_seconds,
    stage_state_bytes,
)

WORKLOAD = Workload(micro_batch_size=8, micro_batches=4)
ONE_F_ONE_B = Workload(micro_batch_size=8, micro_batches=4, schedule="1f1b")


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[LayerProfile], list[Device], int, int, float | None]:
    layers = [
        LayerProfile(draw(st.integers(1, 100)) * 1e6, draw(st.integers(0, 5000)), draw(st.integers(0, 4096)),
                     stash_bytes_per_sample=draw(st.integers(0, 1000)))
        for _ in range(draw(st.integers(1, 5)))
    ]
    devices = [
        Device(
            id=f"d{i}",
            flops=draw(st.sampled_from([1e9, 2e9, 4e9, 8e9])),
            memory_bytes=draw(st.integers(50_000, 400_000)),
            bandwidth_bytes_per_s=draw(st.sampled_from([1e6, 1e7, math.inf])),
            latency_s=draw(st.sampled_from([0.0, 0.001, 0.02])),
            price_per_hour=draw(st.sampled_from([0.1, 0.3, 0.9])),
            relayed=draw(st.booleans()),
        )
        for i in range(draw(st.integers(1, 4)))
    ]
    low = draw(st.integers(1, 3))
    high = draw(st.integers(low, 4))
    budget = draw(st.one_of(st.none(), st.sampled_from([0.3, 0.6, 1.5])))
    return layers, devices, low, high, budget


def brute_force(layers, devices, low, high, budget, workload=WORKLOAD) -> list[tuple[float, float]]:
    """(bottleneck, price) of every feasible placement: each ordered choice of k devices and cut points, each
    stage holding what its schedule has in flight on it in a pipeline of k stages."""
    n, found = len(layers), []
    for k in range(low, min(high, n, len(devices)) + 1):
        for chosen in itertools.permutations(devices, k):
            price = sum(d.price_per_hour for d in chosen)
            if budget is not None and price > budget + PRICE_ROUNDING:
                continue
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                spans = list(zip(bounds, bounds[1:], strict=False))
                if all(stage_memory(layers[s:e], workload, in_flight=workload.in_flight(i, k)) <= d.memory_bytes
                       for i, ((s, e), d) in enumerate(zip(spans, chosen, strict=True))):
                    bottleneck = max(stage_seconds(layers[s:e], d, workload, last=e == n,
                                                   input_bytes_per_sample=layers[s - 1].output_bytes_per_sample
                                                   if s else 0)
                                     for (s, e), d in zip(spans, chosen, strict=True))
                    found.append((bottleneck, price))
    return found


# Devices that together cost the budget, 0.6 $/h, but 0.6000000000000001 summed in float fastest first (0.1 + 0.1 +
# 0.1 + 0.3): the fastest placement of parameter-free layers needs all four (found by Hypothesis).
ON_THE_BUDGET = [Device(f"d{i}", flops, 50_000, bandwidth_bytes_per_s=1e6, price_per_hour=price)
                 for i, (flops, price) in enumerate([(1e9, 0.1), (1e9, 0.1), (2e9, 0.1), (1e9, 0.3)])]


@settings(max_examples=300, deadline=None)
@given(problem=problems(), workload=st.sampled_from([WORKLOAD, ONE_F_ONE_B]))
@example(problem=([LayerProfile(1e6, 0, 0)] * 5, ON_THE_BUDGET, 1, 4, 0.6), workload=WORKLOAD)
def test_the_solver_is_within_five_percent_of_the_optimum_and_never_overfills_a_device(problem, workload) -> None:
    layers, devices, low, high, budget = problem
    if workload.schedule == "1f1b":
        high = low  # exact only with the stage count fixed: otherwise a stage must fit the longest pipeline
    feasible = brute_force(layers, devices, low, high, budget, workload)
    if not feasible:
        with pytest.raises(PlacementError):
            solve(layers, devices, workload, min_stages=low, max_stages=high, max_price_per_hour=budget)
        return
    placement = solve(layers, devices, workload, min_stages=low, max_stages=high, max_price_per_hour=budget)
    optimum = min(b for b, _ in feasible)
    assert placement.bottleneck_seconds <= optimum * 1.05  # the acceptance bound
    assert placement.bottleneck_seconds <= optimum * (1 + PRICE_TOLERANCE) + 1e-12  # what it really promises
    # Contiguous cover, distinct devices, memory respected, and the price/bottleneck it reports are true.
    assert placement.stages[0].layer_start == 0 and placement.stages[-1].layer_end == len(layers)
    assert all(a.layer_end == b.layer_start for a, b in itertools.pairwise(placement.stages))
    assert low <= len(placement.stages) <= high
    by_id = {d.id: d for d in devices}
    assert len({s.device_id for s in placement.stages}) == len(placement.stages)
    for index, stage in enumerate(placement.stages):
        held = workload.in_flight(index, len(placement.stages))
        assert stage.memory_bytes == stage_memory(layers[stage.layer_start : stage.layer_end], workload, in_flight=held)
        assert stage.memory_bytes <= by_id[stage.device_id].memory_bytes
    assert math.isclose(placement.bottleneck_seconds, max(s.seconds_per_micro_batch for s in placement.stages))
    assert math.isclose(placement.price_per_hour, sum(by_id[s.device_id].price_per_hour for s in placement.stages))
    if budget is not None:
        assert placement.price_per_hour <= budget + PRICE_ROUNDING
    # No placement as fast (within the tolerance) is cheaper.
    assert all(price >= placement.price_per_hour - 1e-12 for b, price in feasible
               if b <= optimum * (1 + PRICE_TOLERANCE))


@st.composite
def even_problems(draw: st.DrawFn) -> tuple[list[LayerProfile], list[Device], int, int, float | None]:
    """A model of equal blocks (a GPT's) on equally fast devices: many cuts are as fast as the fastest."""
    block = LayerProfile(1e7, draw(st.integers(1000, 5000)), 1024, stash_bytes_per_sample=draw(st.integers(0, 1000)))
    layers = [block] * draw(st.integers(3, 8))
    devices = [Device(f"d{i}", 1e9, draw(st.integers(50_000, 400_000))) for i in range(draw(st.integers(2, 4)))]
    stages = draw(st.integers(2, len(devices)))
    return layers, devices, stages, stages, None


@settings(max_examples=200, deadline=None)
@given(problem=st.one_of(problems(), even_problems()), workload=st.sampled_from([WORKLOAD, ONE_F_ONE_B]))
def test_among_cuts_as_fast_the_fullest_device_is_least_full(problem, workload) -> None:
    """Only the bottleneck stage sets the pace: of every cut of the layers over the chosen devices (in any order) that
    is no slower, none leaves its fullest device (its stage's memory over the device's) less full."""
    layers, devices, low, _, budget = problem
    try:
        placement = solve(layers, devices, workload, min_stages=low, max_stages=low, max_price_per_hour=budget)
    except PlacementError:
        return
    by_id = {d.id: d for d in devices}
    chosen, n, k = [by_id[s.device_id] for s in placement.stages], len(layers), len(placement.stages)

    def fullness(spans: list[tuple[int, int]], order: tuple[Device, ...]) -> float:
        return max(stage_memory(layers[s:e], workload, in_flight=workload.in_flight(i, k)) / d.memory_bytes
                   for i, ((s, e), d) in enumerate(zip(spans, order, strict=True)))

    def seconds(spans: list[tuple[int, int]], order: tuple[Device, ...]) -> float:
        return max(stage_seconds(layers[s:e], d, workload, last=e == n,
                                 input_bytes_per_sample=layers[s - 1].output_bytes_per_sample if s else 0)
                   for (s, e), d in zip(spans, order, strict=True))

    found = fullness([(s.layer_start, s.layer_end) for s in placement.stages], tuple(chosen))
    assert found <= 1.0
    for order in itertools.permutations(chosen):
        for cuts in itertools.combinations(range(1, n), k - 1):
            spans = list(itertools.pairwise([0, *cuts, n]))
            if seconds(spans, order) <= placement.bottleneck_seconds * (1 + 1e-12):
                assert fullness(spans, order) >= found - 1e-12


@settings(max_examples=200, deadline=None)
@given(problem=problems(), relayed=st.sets(st.integers(0, 3)))
def test_relaying_a_device_never_speeds_its_stage_or_the_pipeline_up(problem, relayed) -> None:
    layers, devices, low, high, budget = problem
    direct = [replace(d, relayed=False) for d in devices]
    behind = [replace(d, relayed=i in relayed) for i, d in enumerate(direct)]
    for d, r in zip(direct, behind, strict=True):
        for start in range(len(layers)):
            given_input = layers[start - 1].output_bytes_per_sample if start else 0
            assert stage_seconds(layers[start:], r, WORKLOAD, last=False, input_bytes_per_sample=given_input) >= \
                stage_seconds(layers[start:], d, WORKLOAD, last=False, input_bytes_per_sample=given_input)
    try:
        fast = solve(layers, direct, WORKLOAD, min_stages=low, max_stages=high)
    except PlacementError:
        return  # nothing fits directly: relaying changes no memory, so nothing fits either
    slow = solve(layers, behind, WORKLOAD, min_stages=low, max_stages=high)
    assert slow.bottleneck_seconds >= fast.bottleneck_seconds * (1 - PRICE_TOLERANCE) - 1e-12


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 3), relayed=st.integers(0, 4), activation=st.integers(0, 10**6),
       latency=st.sampled_from([0.0, 0.01]))
def test_among_equal_devices_the_direct_ones_are_used_first(stages, relayed, activation, latency) -> None:
    layers = [LayerProfile(1e6, 100, activation) for _ in range(3)]
    devices = [Device(f"d{i}", 1e9, 10**9, bandwidth_bytes_per_s=1e7, latency_s=latency, relayed=i < relayed)
               for i in range(4)]
    placement = solve(layers, devices, WORKLOAD, min_stages=stages, max_stages=stages)
    used_relayed = sum(d.relayed for d in devices if d.id in {s.device_id for s in placement.stages})
    assert used_relayed == max(0, stages - (len(devices) - relayed))  # only when the direct ones run out


def test_of_placements_as_fast_and_as_cheap_the_one_without_a_relayed_device_wins() -> None:
    # 0.3 $/h both ways, though 0.1 + 0.2 sums to 0.30000000000000004 in float: the price ties, so the relay decides.
    devices = [Device("relayed", 2e9, 10**9, price_per_hour=0.3, relayed=True),
               Device("a", 1e9, 10**9, price_per_hour=0.1), Device("b", 1e9, 10**9, price_per_hour=0.2)]
    placement = solve([LayerProfile(1e6, 100, 0)] * 2, devices, WORKLOAD, min_stages=1, max_stages=2)
    assert [s.device_id for s in placement.stages] == ["a", "b"]


def test_a_relayed_device_is_kept_off_the_stage_whose_links_bind() -> None:
    # The middle stage receives and sends; the ends only one of the two. Heavy activations: links bind.
    layers = [LayerProfile(1e6, 100, 100_000) for _ in range(3)]
    devices = [Device("relayed", 1e9, 10**9, bandwidth_bytes_per_s=1e8, relayed=True),
               Device("a", 1e9, 10**9, bandwidth_bytes_per_s=1e8), Device("b", 1e9, 10**9, bandwidth_bytes_per_s=1e8)]
    placement = solve(layers, devices, WORKLOAD, min_stages=3, max_stages=3)
    # First, it pays only its output: last, input only. In the middle it would pay both.
    assert placement.stages[1].device_id != "relayed"
    relayed_stage = next(s for s in placement.stages if s.device_id == "relayed")
    direct_middle = placement.stages[1]
    assert relayed_stage.seconds_per_micro_batch <= direct_middle.seconds_per_micro_batch


def test_faster_devices_get_proportionately_more_layers() -> None:
    layers = [LayerProfile(1e6, 100, 0) for _ in range(16)]
    devices = [Device("x4", 4e9, 10**9), Device("x2", 2e9, 10**9), Device("x1", 1e9, 10**9), Device("y1", 1e9, 10**9)]
    placement = solve(layers, devices, WORKLOAD, min_stages=4, max_stages=4)
    share = {s.device_id: s.layer_end - s.layer_start for s in placement.stages}
    assert share == {"x4": 8, "x2": 4, "x1": 2, "y1": 2}  # layers in proportion to FLOP/s
    assert placement.bottleneck_seconds == pytest.approx(3 * 8 * 8e6 / 4e9)


def test_among_equally_fast_placements_the_cheaper_devices_win() -> None:
    layers = [LayerProfile(1e6, 100, 0) for _ in range(2)]
    devices = [Device("pricey", 1e9, 10**9, price_per_hour=0.9), Device("cheap", 1e9, 10**9, price_per_hour=0.2)]
    placement = solve(layers, devices, WORKLOAD)
    # Two stages halve the bottleneck, so both are used; with one stage allowed only, the cheap one.
    assert len(placement.stages) == 2
    single = solve(layers, devices, WORKLOAD, max_stages=1)
    assert [s.device_id for s in single.stages] == ["cheap"] and single.price_per_hour == 0.2


def test_a_slow_link_makes_fewer_stages_faster() -> None:
    layers = [LayerProfile(1e6, 100, 1_000_000) for _ in range(4)]  # 1 MB activations per sample
    devices = [Device(f"d{i}", 1e9, 10**12, bandwidth_bytes_per_s=1e6) for i in range(4)]
    placement = solve(layers, devices, WORKLOAD)
    assert len(placement.stages) == 1  # sending 8 MB over 1 MB/s costs more than computing it all


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        ([Device("a", 1e9, 1000)], {}, "layer 0 needs 0.00 GiB to train"),
        ([Device("a", 1e9, 10**9, price_per_hour=0.5)], {"max_price_per_hour": 0.3},
         r"costs more than the budget of \$0.3000/hour \(the cheapest is \$0.5000/hour\)"),
        ([Device("a", 1e9, 10**9)], {"min_stages": 2}, "needs at least 2 devices"),
        ([], {}, "no device is available"),
        # A device without room for even the smallest layer is no candidate: the error counts it.
        ([Device("big", 1e9, 200_000), Device("tiny", 1e9, 100)], {"min_stages": 2},
         r"only 1 can be used \(2 devices offered for 2 layers, 1 of them without room for any stage\)"),
    ],
)
def test_when_nothing_fits_the_error_says_what_binds(devices, kwargs, message) -> None:
    with pytest.raises(PlacementError, match=message):
        solve([LayerProfile(1e6, 10_000, 8), LayerProfile(1e6, 10, 8)], devices, WORKLOAD, **kwargs)


def test_under_1f1b_a_later_stage_needs_room_for_fewer_micro_batches() -> None:
    # Two equal layers, each stashing 1 MB per sample; a step of 4 micro-batches of one sample.
    layers = [LayerProfile(1e6, 0, 0, stash_bytes_per_sample=10**6) for _ in range(2)]
    gpipe, one_f_one_b = Workload(1, 4), Workload(1, 4, schedule="1f1b")
    roomy = Device("roomy", flops=2e9, memory_bytes=stage_memory(layers[:1], gpipe))
    small = Device("small", flops=1e9, memory_bytes=stage_memory(layers[:1], gpipe, in_flight=1))
    with pytest.raises(PlacementError):  # GPipe: both stages hold all four micro-batches
        solve(layers, [roomy, small], gpipe, min_stages=2, max_stages=2)
    placement = solve(layers, [roomy, small], one_f_one_b, min_stages=2, max_stages=2)
    assert [s.device_id for s in placement.stages] == ["roomy", "small"]
    # The first stage holds two micro-batches at once, the last one.
    assert [s.memory_bytes for s in placement.stages] == [
        stage_memory(layers[:1], one_f_one_b, in_flight=2), small.memory_bytes
    ]


def test_small_fast_devices_do_not_crowd_out_the_big_ones_a_large_model_needs() -> None:
    # Twenty fast devices too small for any layer, and two slow big ones: only the big ones can hold the model,
    # and they are slower than every small one (the fastest MAX_CANDIDATES are all small).
    layers = [LayerProfile(1e6, 100_000, 8) for _ in range(4)]  # 1.6 MB of training state per layer
    small = [Device(f"fast{i}", 1e12, 1_000_000) for i in range(20)]
    big = [Device("big0", 1e9, 10**9), Device("big1", 1e9, 10**9)]
    placement = solve(layers, small + big, WORKLOAD)
    assert {d for s in placement.stages for d in s.device_ids} <= {"big0", "big1"}
    assert not placement.cut_short


@settings(max_examples=200, deadline=None)
@given(problem=problems(), small=st.integers(0, 12), workload=st.sampled_from([WORKLOAD, ONE_F_ONE_B]))
def test_devices_without_room_for_any_stage_never_change_the_placement(problem, small, workload) -> None:
    """However many fast devices too small for any layer the market holds, the placement is the one found without
    them: the fastest few the search looks at are taken among devices that can hold a stage."""
    layers, devices, low, high, budget = problem
    need = min(stage_memory([layer], workload, in_flight=1) for layer in layers)
    tiny = [Device(f"tiny{i}", 1e15, need - 1, price_per_hour=0.0) for i in range(small)]
    kwargs = {"min_stages": low, "max_stages": high, "max_price_per_hour": budget, "max_candidates": 4}
    try:
        alone = solve(layers, devices, workload, **kwargs)
    except PlacementError:
        with pytest.raises(PlacementError):
            solve(layers, tiny + devices, workload, **kwargs)
        return
    crowded = solve(layers, tiny + devices, workload, **kwargs)
    assert crowded == alone


def test_the_memory_model_counts_each_optimizers_state_and_a_device_fits_what_it_allows() -> None:
    # One layer of 100M parameters: fp32 weight and gradient (8 bytes), plus SGD's momentum (4), Adam's moments (8)
    # or 8-bit Adam's (2, and a float32 scale per 256 elements of each moment, and its library's import).
    layer = [LayerProfile(1e6, 100_000_000, 8)]
    state = {kind: stage_memory(layer, Workload(1, 1, optimizer=kind), in_flight=0)
             for kind in ("sgd", "sgd-momentum", "adam", "adam8bit")}
    assert state == {
        "sgd": 800_000_000, "sgd-momentum": 1_200_000_000, "adam": 1_600_000_000,
        "adam8bit": 1_000_000_000 + 2 * 4 * 390_625 + OPTIMIZER_LIBRARY_BYTES["adam8bit"],
    }
    device = Device("d", 1e9, stage_memory(layer, Workload(1, 1, optimizer="adam8bit")))
    assert solve(layer, [device], Workload(1, 1, optimizer="adam8bit")).stages[0].device_id == "d"
    with pytest.raises(PlacementError):
        solve(layer, [device], Workload(1, 1))
    # 8-bit Adam's step (on a CPU) holds five float32 copies of the largest parameter it updates beside the state;
    # fused Adam's step, none; a tensor-parallel rank steps its share of a split layer's. One parameter at a time:
    # a second, smaller layer adds its state only.
    blocks = [LayerProfile(1e6, 12 * 1024**2, 8, largest_tensor_params=4 * 1024**2, tensor_parallel=True),
              LayerProfile(1e6, 1024**2, 8, largest_tensor_params=1024**2)]
    for kind, floats in (("adam8bit", 5), ("adam", 0), ("sgd", 0)):
        workload = Workload(1, 1, optimizer=kind)
        assert stage_memory(blocks, workload, in_flight=0) - stage_memory(blocks[:1], workload, in_flight=0) == (
            layer_training_memory(1024**2, kind)
        )
        assert optimizer_step_bytes(blocks, kind) == floats * 4 * 4 * 1024**2
        assert optimizer_step_bytes(blocks, kind, ranks=4) == floats * 4 * 1024**2
        assert stage_memory(blocks, workload, in_flight=0) == (
            OPTIMIZER_LIBRARY_BYTES.get(kind, 0) + stage_state_bytes(blocks, 1, kind)
            + backward_workspace_bytes(blocks, workload) + floats * 4 * 4 * 1024**2
            + heap_kept_bytes(blocks, workload)
        )
    with pytest.raises(ValueError, match="unknown optimizer kind 'lamb'; known: sgd, sgd-momentum, adam, adam8bit"):
        Workload(1, 1, optimizer="lamb")
    with pytest.raises(ValueError, match="unknown precision 'fp8'; known: fp32, bf16"):
        Workload(1, 1, precision="fp8")


# Four layers that each take 1 MB per sample in and hand 1 MB on, and stash 10 MB per sample (their input included).
FOUR = [LayerProfile(1e6, 0, 10**6, stash_bytes_per_sample=10 * 10**6, input_bytes_per_sample=10**6)] * 4


def test_with_activation_checkpointing_a_micro_batch_keeps_its_layers_inputs_and_the_heap_one_layers_forward() -> None:
    # 8 micro-batches of one sample in flight. Without recompute each keeps every layer's stash, the backward holds
    # one layer's gradients beside them, and the heap keeps one more micro-batch's of the forwards' freed temporaries.
    full, recomputed = Workload(1, 8), Workload(1, 8, activation_checkpointing=True)
    assert heap_kept_bytes(FOUR, full) == 40 * 10**6 and heap_kept_bytes(FOUR, recomputed) == 0
    assert stage_memory(FOUR, full) == (8 + 1) * 40 * 10**6 + 10 * 10**6
    # With it each keeps the four inputs and the last output, and the heap keeps one layer's forward (10 MB) it
    # freed below them; the backward recomputes one layer (its stash and that stash's gradients).
    assert stage_memory(FOUR, recomputed) == 8 * (5 + 10) * 10**6 + 2 * 10 * 10**6


def test_under_bf16_a_micro_batch_keeps_narrower_activations_and_its_own_cast_of_the_weights() -> None:
    # The four layers with 1M parameters each, cast for their matmuls: every micro-batch's forward casts them anew
    # (2 bytes each) and its graph keeps the casts; what a layer keeps beside its input is bfloat16, half as wide.
    layers = [replace(layer, params=10**6, cast_params=10**6) for layer in FOUR]
    bf16, fp32 = Workload(1, 8, precision="bf16"), Workload(1, 8)
    assert micro_batch_bytes(layers, fp32) == 40 * 10**6
    assert micro_batch_bytes(layers, bf16) == 4 * 5_500_000 + 4 * 2 * 10**6
    # A lookup table (an embedding taking token ids) is not cast.
    assert micro_batch_bytes([replace(layers[0], cast_params=0)], bf16) == 5_500_000
    # With recompute, nothing is cast ahead; the forward's autocast cache holds every cast weight at once, which the
    # backward's workspace counts where it is larger than one layer's recompute.
    recomputed = replace(bf16, activation_checkpointing=True)
    assert micro_batch_bytes(layers, recomputed) == 5 * 10**6 + 5_500_000 + 2 * 10**6
    assert backward_workspace_bytes(layers, recomputed) == 2 * 5_500_000 + 2 * 10**6
    wide = [replace(layer, params=10**7, cast_params=10**7) for layer in FOUR]
    assert backward_workspace_bytes(wide, recomputed) == 4 * 2 * 10**7
    # A tensor-parallel rank casts its share of a split layer.
    split = [replace(layer, tensor_parallel=True) for layer in layers]
    assert micro_batch_bytes(split, bf16, ranks=2) == micro_batch_bytes(layers, bf16) - 4 * 10**6


@st.composite
def stages(draw: st.DrawFn) -> tuple[list[LayerProfile], Workload]:
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        inp = draw(st.integers(0, 10**4))
        params = draw(st.integers(0, 10**6))
        layers.append(LayerProfile(
            1e6, params, draw(st.integers(0, 10**4)), stash_bytes_per_sample=inp + draw(st.integers(0, 10**5)),
            input_bytes_per_sample=inp, cast_params=draw(st.sampled_from([0, params])),
            tensor_parallel=draw(st.booleans()),
        ))
    workload = Workload(
        draw(st.integers(1, 16)), draw(st.integers(1, 8)), draw(st.sampled_from(["gpipe", "1f1b"])),
        optimizer=draw(st.sampled_from(sorted(TRAINING_BYTES_PER_PARAMETER))),
        activation_checkpointing=draw(st.booleans()), precision=draw(st.sampled_from(["fp32", "bf16"])),
    )
    return layers, workload


@settings(max_examples=300, deadline=None)
@given(stage=stages(), ranks=st.sampled_from([1, 2, 4]))
def test_a_stage_needs_its_fixed_part_plus_the_same_bytes_for_each_micro_batch_in_flight(stage, ranks) -> None:
    layers, workload = stage
    fixed = stage_memory(layers, workload, ranks, in_flight=0)
    assert fixed >= stage_state_bytes(layers, ranks, workload.optimizer)
    each = micro_batch_bytes(layers, workload, ranks)
    for held in range(1, workload.micro_batches + 1):
        assert stage_memory(layers, workload, ranks, in_flight=held) == fixed + held * each
    assert stage_memory(layers, workload, ranks) == fixed + workload.micro_batches * each
    # More ranks never need more of each; bf16 keeps activations at most as wide as fp32 and at least half as
    # wide, and the weights' casts besides.
    assert micro_batch_bytes(layers, workload, 2 * ranks) <= each
    fp32 = micro_batch_bytes(layers, replace(workload, precision="fp32"), ranks)
    bf16 = micro_batch_bytes(layers, replace(workload, precision="bf16"), ranks)
    assert fp32 <= 2 * bf16 and bf16 <= fp32 + sum(2 * layer.cast_params for layer in layers)
    # Without recompute or casts, a micro-batch's bytes are its samples' (twice the samples, twice the bytes).
    if workload.precision == "fp32":
        assert micro_batch_bytes(layers, replace(workload, micro_batch_size=2 * workload.micro_batch_size), ranks) == (
            2 * each
        )
