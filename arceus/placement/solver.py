"""Choose devices for a model's pipeline stages and where to cut it: the marketplace's placement solver.

Pure and Django-free. Stage time per micro-batch is its compute (forward plus a backward of about twice
the cost, over the device's FLOP/s) plus, for every stage but the last, sending its output forward and
receiving the gradient back over the device's link; a device reached through a relay (`Device.relayed`) pays its
link for its inputs too (the previous stage's activations in, their gradients back), since every byte to or from it
crosses the relay, so placement keeps relayed devices off the stages whose links bind and uses their measured link
(through the relay) for both. The pipeline runs at the pace of its slowest stage,
so the solver minimises that bottleneck; a stage never needs more memory than its device has (`stage_memory`:
weights, gradients and optimizer state, plus what autograd keeps for each micro-batch it holds at once: all of
a step's under GPipe, fewer the later the stage under 1F1B); and among placements within `PRICE_TOLERANCE`
of the fastest, the cheapest per hour wins, within the budget, and among those the one with the fewest relayed
devices. On the devices it chose, the layers are then cut so that the fullest device is least full among the cuts no
slower (`_most_headroom`): only the bottleneck stage sets the pace, and the other cuts are free.

The search is exact for this cost model: dynamic programming over (layers placed, set of devices used),
O(n² · d · 2^d) for n layers and d candidate devices, so only the `max_candidates` best devices by speed
are considered (8 by default: under a second in Python for 16 layers), among those with memory for some stage:
a device that cannot hold even the smallest layer with one micro-batch in flight (`holds_a_layer`) can never
be used, so it is dropped before the fastest are taken (a market of small fast devices does not crowd out the
big ones a large model needs).

It is time-bounded (`Budget`: seconds on a clock the caller passes in, so the solver stays pure). The search
runs on growing prefixes of the candidates (the fewest that can hold the stages, then twice as many, ...,
then all of them), each exact, so when the budget runs out the best placement of the last finished prefix
is returned, marked `cut_short`; with none finished it raises PlacementError. The clock is read before
each (stage start, end) pair's costs and every `_CHECK_EVERY` steps of the search.

Tensor parallelism (`tensor_parallel` > 1): a split stage runs on a group of that many devices, Megatron
style. Its transformer blocks (`LayerProfile.tensor_parallel`) divide their weights and compute between
the ranks, at the price of 4 all-reduces of the block's output per micro-batch (2 forward, 2 backward),
each sending the partial sum to every other rank; embeddings, heads and the stashed activations stay
whole on every rank. A group acts as one device as fast as its slowest member, with the memory of its
smallest, the worst link of any, and the price of all. Groups are formed before the search, from
devices of similar speed (consecutive in speed order, fastest first), so the search stays exact for
those groups but does not try every way of grouping the devices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from arceus.model.expected_state import ADAM8BIT_BLOCK
from arceus.pipeline.schedule import peak_in_flight

MIB = 2**20
# Training memory per parameter, by optimizer kind (`arceus.model.expected_state.optimizer_kind`): an fp32
# weight and its gradient, and what the optimizer keeps: SGD's momentum buffer, Adam's two fp32 moments, 8-bit
# Adam's two one-byte moments (plus a float32 scale per ADAM8BIT_BLOCK elements each: `layer_training_memory`).
TRAINING_BYTES_PER_PARAMETER = {"sgd": 8, "sgd-momentum": 12, "adam": 16, "adam8bit": 10}
BYTES_PER_PARAMETER = TRAINING_BYTES_PER_PARAMETER["adam"]
# What an optimizer's library adds to the agent that first builds a stage with it, beyond what every agent loads
# before it measures its own memory (`nodeagent.warm_up`: torch.optim's torch._dynamo and the training kernels):
# bitsandbytes 0.50.2 beside torch 2.13, measured in such a process by bench/stage_peak_memory.py.
OPTIMIZER_LIBRARY_BYTES = {"adam8bit": 50 * MIB}
# Float32 tensors as large as one parameter that an optimizer's step holds at once beside the state, one parameter
# at a time: bitsandbytes 0.50.2's CPU step of 8-bit Adam dequantizes both moments, scales the gradient into a new
# tensor, and takes the second moment's root and its quotient (torch's fused Adam updates in place).
OPTIMIZER_STEP_FLOATS = {"adam8bit": 5}
PRECISIONS = ("fp32", "bf16")
# Under bf16 autocast a layer keeps its matmuls' inputs and outputs in bfloat16: what it keeps beside its input
# takes half its fp32 bytes; each micro-batch's forward also casts the matmuls' weights, and its graph keeps them.
BF16_BYTES_PER_CAST_PARAMETER = 2
BACKWARD_FACTOR = 3.0  # forward + backward ≈ 3 × forward FLOPs
PRICE_TOLERANCE = 0.02  # a placement this much slower than the fastest may win by being cheaper
# Dollars an hour within which two prices are equal, and by which a placement's price may exceed the budget: float
# sums round (0.1 + 0.1 + 0.1 + 0.3 > 0.6 == 0.3 + 0.1 + 0.1 + 0.1, 0.1 + 0.2 > 0.3), and the search sums prices
# fastest first, so without it devices that cost exactly the budget were refused by their speed order, and of two
# placements as cheap the rounding, not the fewer relayed devices, chose.
PRICE_ROUNDING = 1e-9
MAX_CANDIDATES = 8  # candidate units searched by default (the search is exponential in them)
_CHECK_EVERY = 256  # search steps (one candidate set extended by one stage) between two reads of the clock


class PlacementError(ValueError):
    """No placement satisfies the constraints; the message says which one binds and what would help."""


@dataclass(frozen=True)
class Budget:
    """How long one `solve` may search: `seconds` on `clock` (any monotonic clock in seconds; tests count)."""

    seconds: float
    clock: Callable[[], float] = time.monotonic


class _OutOfTime(Exception):
    pass


class _Watch:
    """Raises _OutOfTime once the budget's deadline has passed; `step()` reads the clock every _CHECK_EVERY calls."""

    def __init__(self, budget: Budget | None) -> None:
        self._budget = budget
        self._deadline = None if budget is None else budget.clock() + budget.seconds
        self._steps = 0

    def check(self) -> None:
        if self._budget is not None and self._budget.clock() >= self._deadline:
            raise _OutOfTime

    def step(self) -> None:
        self._steps += 1
        if self._steps % _CHECK_EVERY == 0:
            self.check()


@dataclass(frozen=True)
class LayerProfile:
    flops_per_sample: float  # forward
    params: int
    output_bytes_per_sample: int  # the activation this layer hands to the next one
    stash_bytes_per_sample: int = 0  # what its training forward keeps for the backward, its input included
    kept_output_bytes_per_sample: int = 0  # its output, where the layer keeps that too (counted on a stage's last)
    tensor_parallel: bool = False  # a transformer block: its weights and compute split across a group
    # What decoding one sequence keeps in this layer at most (an attention layer's keys and values over the whole
    # window); 0 for a layer of a model that does not decode.
    kv_cache_bytes_per_sequence: int = 0
    input_bytes_per_sample: int = 0  # what enters it: all activation checkpointing keeps of it
    # Parameters bf16 autocast casts: a layer's matmul weights, counted as all its parameters (its norms' are few);
    # none of a lookup table's.
    cast_params: int = 0
    # Of its stash, what the loss keeps of the model's last layer's output: float32 log-probabilities at any precision.
    loss_bytes_per_sample: int = 0
    largest_tensor_params: int = 0  # elements of its largest parameter tensor (what an optimizer's step works on)


@dataclass(frozen=True)
class Device:
    id: str
    flops: float  # sustained FLOP/s
    memory_bytes: int
    bandwidth_bytes_per_s: float = math.inf  # its link to the other agents
    latency_s: float = 0.0
    price_per_hour: float = 0.0
    relayed: bool = False  # dialled through a relay: its link carries its inputs as well as its outputs


@dataclass(frozen=True)
class Workload:
    micro_batch_size: int
    micro_batches: int  # per step
    schedule: str = "gpipe"  # which decides how many a stage holds at once (`in_flight`)
    optimizer: str = "adam"  # a TRAINING_BYTES_PER_PARAMETER kind: the state each parameter trains with
    # Each micro-batch in flight keeps its layers' inputs only; one layer's activations are recomputed at a time.
    activation_checkpointing: bool = False
    precision: str = "fp32"  # or bf16, which keeps activations narrower and casts weights for each micro-batch
    # The job's staleness (arceus.pipeline.schedule.STALENESS): 1 keeps a second version of the weights and overlaps
    # two steps' micro-batches on a stage.
    staleness: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in TRAINING_BYTES_PER_PARAMETER:
            raise ValueError(
                f"unknown optimizer kind {self.optimizer!r}; known: {', '.join(TRAINING_BYTES_PER_PARAMETER)}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")

    def in_flight(self, stage: int, num_stages: int) -> int:
        """Micro-batches whose activations stage `stage` of `num_stages` holds at once: every one under
        GPipe, at most `num_stages - stage` under 1F1B; with staleness 1, also what the step before still holds."""
        return peak_in_flight(self.schedule, num_stages, self.micro_batches, stage, self.staleness)


@dataclass(frozen=True)
class StagePlan:
    device_ids: tuple[str, ...]  # one device, or a tensor-parallel group's in rank order
    layer_start: int
    layer_end: int
    seconds_per_micro_batch: float
    memory_bytes: int  # per device

    @property
    def device_id(self) -> str:
        """The device of a one-device stage; a group's rank 0."""
        return self.device_ids[0]


@dataclass(frozen=True)
class _Unit:
    """What a stage runs on: one device, or a tensor-parallel group of them acting as one (`device`
    aggregates them: the slowest speed, smallest memory, worst link, summed price)."""

    device: Device
    members: tuple[str, ...]

    @property
    def ranks(self) -> int:
        return len(self.members)

    @classmethod
    def of(cls, devices: Sequence[Device]) -> _Unit:
        if len(devices) == 1:
            return cls(devices[0], (devices[0].id,))
        aggregate = Device(
            id="+".join(d.id for d in devices),
            flops=min(d.flops for d in devices),
            memory_bytes=min(d.memory_bytes for d in devices),
            bandwidth_bytes_per_s=min(d.bandwidth_bytes_per_s for d in devices),
            latency_s=max(d.latency_s for d in devices),
            price_per_hour=sum(d.price_per_hour for d in devices),
            relayed=any(d.relayed for d in devices),
        )
        return cls(aggregate, tuple(d.id for d in devices))


@dataclass(frozen=True)
class Placement:
    stages: tuple[StagePlan, ...]
    bottleneck_seconds: float  # per micro-batch, of the slowest stage
    price_per_hour: float
    micro_batch_size: int
    cut_short: bool = False  # the budget ran out: the best over the fastest candidates only, not over all

    @property
    def samples_per_second(self) -> float:
        return self.micro_batch_size / self.bottleneck_seconds if self.bottleneck_seconds > 0 else math.inf


def layer_training_memory(params: int, optimizer: str = "adam") -> int:
    """Bytes `params` parameters train with under `optimizer` (a TRAINING_BYTES_PER_PARAMETER kind)."""
    scales = 2 * 4 * -(-params // ADAM8BIT_BLOCK) if optimizer == "adam8bit" else 0
    return params * TRAINING_BYTES_PER_PARAMETER[optimizer] + scales


# Inference memory per parameter: the fp32 weight alone (a served stage has no gradients and no optimizer).
BYTES_PER_SERVED_PARAMETER = 4
# Sequences a served stage keeps decoding caches for at once (the least recently used dropped first,
# `arceus.model.decoding`): what bounds its decoding memory, which `stage_inference_memory` reserves.
DECODE_SESSIONS = 4


def stage_inference_memory(layers: Sequence[LayerProfile], sequences: int) -> int:
    """Bytes a stage holding `layers` needs to decode for samplers (a served job: one device, the stage whole):
    its weights, the key/value caches of `sequences` sequences at once, and one sequence's forward as workspace
    (what its training forward would stash for one sample bounds that)."""
    weights = sum(layer.params for layer in layers) * BYTES_PER_SERVED_PARAMETER
    caches = sequences * sum(layer.kv_cache_bytes_per_sequence for layer in layers)
    workspace = sum(layer.stash_bytes_per_sample for layer in layers) + layers[-1].kept_output_bytes_per_sample
    return weights + caches + workspace


def stage_memory(
    layers: Sequence[LayerProfile], workload: Workload, ranks: int = 1, in_flight: int | None = None
) -> int:
    """Bytes a training stage holding `layers` adds to its agent at its peak, on each of its `ranks` devices, beyond
    what the agent measured it holds (`nodeagent.warm_up`): its optimizer's library (`OPTIMIZER_LIBRARY_BYTES`);
    weights with gradients and optimizer state (a tensor-parallel rank's share of the split ones,
    `stage_state_bytes`); what each of the `in_flight` micro-batches it holds at once keeps (`Workload.in_flight`;
    None: all of a step's; `micro_batch_bytes`); one micro-batch's backward (`backward_workspace_bytes`); the
    optimizer step's temporaries (`optimizer_step_bytes`), which the heap's blocks that the micro-batches freed do
    not hold (they are larger than the agent's mmap threshold, `nodeagent.heap`); without recompute what the
    heap keeps beside them (`heap_kept_bytes`); and with staleness 1 the second version of the weights
    (`stale_weights_bytes`)."""
    held = workload.micro_batches if in_flight is None else in_flight
    return (OPTIMIZER_LIBRARY_BYTES.get(workload.optimizer, 0) + stage_state_bytes(layers, ranks, workload.optimizer)
            + workload.staleness * stale_weights_bytes(layers, ranks)
            + held * micro_batch_bytes(layers, workload, ranks) + backward_workspace_bytes(layers, workload, ranks)
            + optimizer_step_bytes(layers, workload.optimizer, ranks) + heap_kept_bytes(layers, workload, ranks))


def stale_weights_bytes(layers: Sequence[LayerProfile], ranks: int = 1) -> int:
    """The float32 weights (a tensor-parallel rank's share of the split ones) a stage keeps a second version of with
    staleness 1: the one the step in flight uses beside the one the next update writes."""
    return sum(4 * -(-layer.params // (ranks if layer.tensor_parallel else 1)) for layer in layers)


def heap_kept_bytes(layers: Sequence[LayerProfile], workload: Workload, ranks: int = 1) -> int:
    """Without activation checkpointing, one more micro-batch's bytes (`micro_batch_bytes`): what glibc's heap keeps
    of the temporaries the forwards free. The peak rises in the second step's backward, once the optimizer's state
    holds heap blocks the first step's activations had freed, by 0.7-1.7 micro-batches' in the stages measured
    (bench/stage_peak_memory.py: docs/BENCHMARKS.md). With recompute, `micro_batch_bytes` counts the heap one
    layer's forward strands."""
    return 0 if workload.activation_checkpointing else micro_batch_bytes(layers, workload, ranks)


def placed_stage_memory(
    layers: Sequence[LayerProfile], workload: Workload, index: int, num_stages: int, ranks: int = 1
) -> int:
    """Bytes stage `index` of a `num_stages` pipeline holding `layers` needs on each of its `ranks` devices, with
    the micro-batches its schedule has in flight there (`Workload.in_flight`). The one figure the solver places
    the stage by, the agent checks its owner's budget against (nodeagent/hosting_plan.py), and a lost or failed
    stage's new node or an added replica's must have (controlplane/controller/rules.py): a stage fits wherever
    it fitted before."""
    return stage_memory(layers, workload, ranks, workload.in_flight(index, num_stages))


def optimizer_step_bytes(layers: Sequence[LayerProfile], optimizer: str, ranks: int = 1) -> int:
    """What `optimizer`'s step holds beside the state at most, on one of `ranks` devices: OPTIMIZER_STEP_FLOATS
    float32 tensors the size of the largest parameter (a tensor-parallel rank's share of a split layer's)."""
    floats = OPTIMIZER_STEP_FLOATS.get(optimizer, 0)
    if not floats:
        return 0
    return 4 * floats * max((-(-layer.largest_tensor_params // (ranks if layer.tensor_parallel else 1))
                             for layer in layers), default=0)


def micro_batch_bytes(layers: Sequence[LayerProfile], workload: Workload, ranks: int = 1) -> int:
    """What one micro-batch holds between its forward through `layers` and its backward. Without activation
    checkpointing, what autograd keeps: each layer's stash (`_layer_stash`) and the last one's output where it keeps
    that, and under bf16 the weights its forward cast (a tensor-parallel rank's share of the split layers'). With it,
    each layer's input and the last one's output (the stage's output, or the loss's log-probabilities), and the heap
    one layer's forward took: the forward frees each layer's activations (and under bf16 its cast weights) after
    the next layer's input, which it keeps, was allocated above them, and glibc's heap cannot shrink below a kept
    block (measured by bench/stage_peak_memory.py: docs/BENCHMARKS.md)."""
    size = workload.micro_batch_size
    if workload.activation_checkpointing:
        kept = sum(layer.input_bytes_per_sample for layer in layers) + layers[-1].output_bytes_per_sample
        stranded = max(size * _layer_stash(layer, workload.precision) + _cast_bytes(layer, workload.precision, ranks)
                       for layer in layers)
        return size * kept + stranded
    stash = sum(_layer_stash(layer, workload.precision) for layer in layers) + layers[-1].kept_output_bytes_per_sample
    return size * stash + sum(_cast_bytes(layer, workload.precision, ranks) for layer in layers)


def backward_workspace_bytes(layers: Sequence[LayerProfile], workload: Workload, ranks: int = 1) -> int:
    """What one micro-batch's backward holds beside the kept activations, at most: the gradients of one layer's
    stash (autograd frees them layer by layer); with activation checkpointing also the recomputed layer's stash
    and cast weights, or under bf16 the forward's autocast cache (every cast weight of the stage, held until
    the forward ends) where that is larger."""
    size = workload.micro_batch_size
    if not workload.activation_checkpointing:
        return size * max(_layer_stash(layer, workload.precision) for layer in layers)
    recompute = max(
        2 * size * _layer_stash(layer, workload.precision) + _cast_bytes(layer, workload.precision, ranks)
        for layer in layers
    )
    return max(recompute, sum(_cast_bytes(layer, workload.precision, ranks) for layer in layers))


def _layer_stash(layer: LayerProfile, precision: str) -> int:
    """What one sample's forward through `layer` keeps for its backward: its input and the loss's log-probabilities
    at their width, and what it keeps beside (halved under bf16 autocast, `BF16_BYTES_PER_CAST_PARAMETER`'s comment)."""
    if precision == "fp32":
        return layer.stash_bytes_per_sample
    whole = layer.input_bytes_per_sample + layer.loss_bytes_per_sample
    return whole + -(-(layer.stash_bytes_per_sample - whole) // 2)


def _cast_bytes(layer: LayerProfile, precision: str, ranks: int) -> int:
    """The bf16 copies of `layer`'s weights one forward makes on one of `ranks` devices (none in fp32)."""
    if precision == "fp32":
        return 0
    return -(-BF16_BYTES_PER_CAST_PARAMETER * layer.cast_params // (ranks if layer.tensor_parallel else 1))


def _room(layers: Sequence[LayerProfile], workload: Workload, unit: _Unit) -> int:
    """How many micro-batches in flight a stage of `layers` on `unit` has memory for (at most a step's, two with
    staleness 1; 0: not even one)."""
    free = unit.device.memory_bytes - stage_memory(layers, workload, unit.ranks, in_flight=0)
    if free < 0:
        return 0
    stash = micro_batch_bytes(layers, workload, unit.ranks)
    most = workload.micro_batches * (1 + workload.staleness)
    return most if stash == 0 else min(most, free // stash)


def stage_state_bytes(layers: Sequence[LayerProfile], ranks: int = 1, optimizer: str = "adam") -> int:
    """Bytes a stage holding `layers` needs on each of its `ranks` devices for weights, gradients and
    `optimizer`'s state (a tensor-parallel rank's share of the split layers), before any activation: the
    least an agent must be able to give it."""
    return sum(
        -(-layer_training_memory(layer.params, optimizer) // (ranks if layer.tensor_parallel else 1))
        for layer in layers
    )


def stage_seconds(
    layers: Sequence[LayerProfile], device: Device, workload: Workload, *, last: bool, ranks: int = 1,
    input_bytes_per_sample: int = 0,
) -> float:
    """Seconds per micro-batch: compute (a tensor-parallel rank's share) and its group's all-reduces,
    plus (unless last) the activation out and the gradient back; on a relayed device, also its input
    (`input_bytes_per_sample`, the previous stage's output; 0 for the first) in and its gradient back."""
    flops = sum(layer.flops_per_sample / ranks if layer.tensor_parallel else layer.flops_per_sample for layer in layers)
    seconds = BACKWARD_FACTOR * workload.micro_batch_size * flops / device.flops
    if ranks > 1:
        for layer in layers:
            if layer.tensor_parallel:
                partial = workload.micro_batch_size * layer.output_bytes_per_sample
                seconds += 4 * ((ranks - 1) * partial / device.bandwidth_bytes_per_s + device.latency_s)
    if not last:
        payload = workload.micro_batch_size * layers[-1].output_bytes_per_sample
        seconds += 2 * (payload / device.bandwidth_bytes_per_s + device.latency_s)
    if device.relayed and input_bytes_per_sample:
        payload = workload.micro_batch_size * input_bytes_per_sample
        seconds += 2 * (payload / device.bandwidth_bytes_per_s + device.latency_s)
    return seconds


def _input_bytes(layers: Sequence[LayerProfile], start: int) -> int:
    """What a stage starting at layer `start` receives per sample (nothing for the first)."""
    return layers[start - 1].output_bytes_per_sample if start else 0


def solve(
    layers: Sequence[LayerProfile],
    devices: Sequence[Device],
    workload: Workload,
    *,
    min_stages: int = 1,
    max_stages: int | None = None,
    max_price_per_hour: float | None = None,
    max_candidates: int = MAX_CANDIDATES,
    tensor_parallel: int = 1,
    split_stages: Collection[int] | None = None,
    budget: Budget | None = None,
) -> Placement:
    """The placement described in the module docstring; PlacementError when none fits (or none was found
    within `budget`; None: no limit).

    `tensor_parallel` > 1 splits stages over groups of that many devices: every stage, or (with
    `split_stages`, which needs the stage count fixed: `min_stages == max_stages`) only those indices."""
    _check(layers, devices, workload, min_stages, max_stages)
    n = len(layers)
    widths = _stage_widths(tensor_parallel, split_stages, min_stages, max_stages, n)
    needed = sum(widths(i) for i in range(min_stages))
    if tensor_parallel > 1 and len(devices) < needed:
        raise PlacementError(
            f"needs {needed} devices for {min_stages} stage{'s' if min_stages != 1 else ''} "
            f"(split ones on {tensor_parallel} devices each), {len(devices)} offered"
        )
    units = _units(devices, tensor_parallel, split_stages, max_candidates, layers, workload)
    if not units:  # not even the smallest layer fits anywhere, so none does: the first is named
        need = stage_memory(layers[:1], workload, tensor_parallel, in_flight=1)
        raise PlacementError(
            f"layer 0 needs {_gib(need)} to train (weights, optimizer state and activations of at least one "
            f"micro-batch) but the largest device has {_gib(max(d.memory_bytes for d in devices))}; use fewer or "
            "smaller micro-batches, smaller layers, or devices with more memory"
        )
    max_stages = min(max_stages or n, n, len(units))
    if min_stages > max_stages:
        unit = "devices (one stage each)" if tensor_parallel == 1 else f"stages (groups of {tensor_parallel} devices)"
        raise PlacementError(
            f"needs at least {min_stages} {unit} but only {min(len(units), n)} can be used "
            f"({len(devices)} devices offered for {n} layers{_without_room(layers, workload, devices)})"
        )
    watch = _Watch(budget)
    # cost[s][e][k]: seconds of layers [s, e) on unit k (inf if not even one micro-batch in flight fits its
    # memory), room[s][e][k]: how many in flight fit (`_room`), filled per unit as the candidate prefixes grow.
    cost = [[[math.inf] * len(units) for _ in range(n + 1)] for _ in range(n)]
    room = [[[0] * len(units) for _ in range(n + 1)] for _ in range(n)]
    found: Placement | None = None
    filled = 0
    for size in _prefix_sizes(len(units), min_stages):
        try:
            for s in range(n):
                for e in range(s + 1, n + 1):
                    watch.check()
                    for k in range(filled, size):
                        unit = units[k]
                        room[s][e][k] = _room(layers[s:e], workload, unit)
                        if room[s][e][k] > 0:
                            cost[s][e][k] = stage_seconds(
                                layers[s:e], unit.device, workload, last=e == n, ranks=unit.ranks,
                                input_bytes_per_sample=_input_bytes(layers, s),
                            )
            filled = size
            found = _search(
                layers, units[:size], cost, room, workload, min_stages, min(max_stages, size), max_price_per_hour,
                widths, watch,
            )
        except _OutOfTime:
            if found is None:
                raise PlacementError(
                    f"the placement search ran out of its {budget.seconds:g} s before finding a placement of "
                    f"{n} layers over {len(units)} candidate devices; use fewer layers or stages, or ask the "
                    "operator for a longer ARCEUS_SOLVER_SECONDS"
                ) from None
            return replace(found, cut_short=True)
        except PlacementError:
            if size == len(units):
                raise
    assert found is not None  # the last prefix is all the units: it returned or raised
    return found


def _prefix_sizes(count: int, fewest: int) -> list[int]:
    """How many of the candidates (fastest first) each search uses: the fewest that could hold the stages,
    doubling, then all."""
    sizes, size = [], max(1, min(fewest, count))
    while size < count:
        sizes.append(size)
        size *= 2
    return [*sizes, count]


def _search(
    layers: Sequence[LayerProfile],
    units: Sequence[_Unit],
    cost: list[list[list[float]]],
    room: list[list[list[int]]],
    workload: Workload,
    min_stages: int,
    max_stages: int,
    max_price_per_hour: float | None,
    widths: Callable[[int], int],
    watch: _Watch,
) -> Placement:
    """The exact search over `units` (the DP of the module docstring); PlacementError when nothing fits."""
    n, d = len(layers), len(units)
    # best[i][mask]: the smallest bottleneck placing layers [0, i) on exactly the units in mask (the
    # next stage's index is the number of units used). The stage count is not known until the end, so a
    # stage must have room for what it holds in flight in the longest pipeline (exact when the count is fixed).
    best: list[dict[int, float]] = [dict() for _ in range(n + 1)]
    back: dict[tuple[int, int], tuple[int, int]] = {}
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for s in range(i):
            for mask, value in best[s].items():
                watch.step()
                used = bin(mask).count("1")
                if used >= max_stages:
                    continue
                held = workload.in_flight(used, max_stages)
                for k in range(d):
                    bit = 1 << k
                    if mask & bit or room[s][i][k] < held or units[k].ranks != widths(used):
                        continue
                    bottleneck = max(value, cost[s][i][k])
                    if bottleneck < best[i].get(mask | bit, math.inf):
                        best[i][mask | bit] = bottleneck
                        back[(i, mask | bit)] = (s, k)
    options = []
    for mask, bottleneck in best[n].items():
        price = sum(units[k].device.price_per_hour for k in range(d) if mask >> k & 1)
        relayed = sum(units[k].device.relayed for k in range(d) if mask >> k & 1)
        if bin(mask).count("1") >= min_stages and (
            max_price_per_hour is None or price <= max_price_per_hour + PRICE_ROUNDING
        ):
            options.append((bottleneck, price, relayed, mask))
    if not options:
        raise PlacementError(_why_not(layers, units, workload, min_stages, max_price_per_hour, best[n]))
    fastest = min(option[0] for option in options)
    fast = [o for o in options if o[0] <= fastest * (1 + PRICE_TOLERANCE)]
    cheapest = min(o[1] for o in fast)
    _, price, _, mask = min((o for o in fast if o[1] <= cheapest + PRICE_ROUNDING), key=lambda o: (o[2], o[0], o[3]))
    try:
        back, bottleneck = _most_headroom(layers, units, cost, workload, mask, best[n][mask], widths, watch)
    except _OutOfTime:  # the search's own cut of the layers stands; the caller sees the time is up at its next check
        bottleneck = best[n][mask]
    return _placement(layers, units, workload, back, mask, bottleneck, price)


def _most_headroom(
    layers: Sequence[LayerProfile],
    units: Sequence[_Unit],
    cost: list[list[list[float]]],
    workload: Workload,
    mask: int,
    limit: float,
    widths: Callable[[int], int],
    watch: _Watch,
) -> tuple[dict[tuple[int, int], tuple[int, int]], float]:
    """The cut of the layers over the units in `mask` (stages in the order of `_search`) whose fullest unit is least
    full (its stage's memory over the unit's), among those whose every stage takes at most `limit` seconds (the
    search's bottleneck, so no slower); its back-pointers and bottleneck. Only the bottleneck stage sets the pace, so
    the search's first cut among equally fast ones left a stage at its device's limit beside one half full
    (docs/BENCHMARKS.md, the 300M run). Exact: a min-max over the same DP, the search's own cut among the candidates."""
    n, count = len(layers), bin(mask).count("1")
    members = [k for k in range(len(units)) if mask >> k & 1]
    fullest: list[dict[int, float]] = [dict() for _ in range(n + 1)]
    fullest[0][0] = 0.0
    back: dict[tuple[int, int], tuple[int, int]] = {}
    for i in range(1, n + 1):
        for s in range(i):
            for used_mask, value in fullest[s].items():
                watch.step()
                used = bin(used_mask).count("1")
                for k in members:
                    bit, unit = 1 << k, units[k]
                    if used_mask & bit or cost[s][i][k] > limit or unit.ranks != widths(used):
                        continue
                    need = placed_stage_memory(layers[s:i], workload, used, count, unit.ranks)
                    if need > unit.device.memory_bytes:
                        continue
                    full = max(value, need / unit.device.memory_bytes)
                    if full < fullest[i].get(used_mask | bit, math.inf):
                        fullest[i][used_mask | bit] = full
                        back[(i, used_mask | bit)] = (s, k)
    bottleneck, i, left = 0.0, n, mask
    while i > 0:
        s, k = back[(i, left)]
        bottleneck, i, left = max(bottleneck, cost[s][i][k]), s, left & ~(1 << k)
    return back, bottleneck


def _stage_widths(
    size: int, split_stages: Collection[int] | None, min_stages: int, max_stages: int | None, n: int
) -> Callable[[int], int]:
    """Stage index -> how many devices run it."""
    if size < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {size}")
    if split_stages is None or size == 1:
        return lambda _index: size
    if min_stages != max_stages:
        raise ValueError(f"split_stages needs min_stages == max_stages, got {min_stages} and {max_stages}")
    if not split_stages or not all(0 <= i < min_stages for i in split_stages):
        raise ValueError(f"split_stages must name stages of 0..{min_stages - 1}, got {sorted(split_stages)}")
    split = frozenset(split_stages)
    return lambda index: size if index in split else 1


def smallest_stage_memory(layers: Sequence[LayerProfile], workload: Workload, ranks: int = 1) -> int:
    """The least memory any stage of `layers` can need on each of its `ranks` devices: its smallest layer alone,
    with one micro-batch in flight (the fewest a stage ever holds). A device with less can hold no stage."""
    return min(stage_memory([layer], workload, ranks, in_flight=1) for layer in layers)


def holds_a_layer(layers: Sequence[LayerProfile], workload: Workload, memory_bytes: int, ranks: int = 1) -> bool:
    """Whether a device of `memory_bytes` could hold some stage of `layers` (`smallest_stage_memory`): those that
    cannot are no candidates, and are dropped before the fastest few are taken."""
    return memory_bytes >= smallest_stage_memory(layers, workload, ranks)


def _without_room(layers: Sequence[LayerProfile], workload: Workload, devices: Sequence[Device]) -> str:
    """", N of them without room for any stage" where some devices hold no layer (else nothing)."""
    small = sum(not holds_a_layer(layers, workload, d.memory_bytes) for d in devices)
    return f", {small} of them without room for any stage" if small else ""


def _units(
    devices: Sequence[Device], size: int, split_stages: Collection[int] | None, max_candidates: int,
    layers: Sequence[LayerProfile], workload: Workload,
) -> list[_Unit]:
    """The candidates, fastest first: single devices, or groups of `size` consecutive devices in speed
    order (all of them, or with `split_stages` as many groups as split stages, from the fastest devices,
    and the rest single). At most `max_candidates`, the groups that split stages need always among them. Only
    devices with memory for some stage count (`holds_a_layer`: as a rank of a group, or alone)."""
    ordered = sorted(devices, key=lambda d: (-d.flops, d.price_per_hour, d.id))
    alone = smallest_stage_memory(layers, workload)
    if size == 1:
        return [_Unit.of([d]) for d in ordered if d.memory_bytes >= alone][:max_candidates]
    as_rank = smallest_stage_memory(layers, workload, size)
    ranked = [d for d in ordered if d.memory_bytes >= as_rank]
    count = len(ranked) // size if split_stages is None else min(len(set(split_stages)), len(ranked) // size)
    groups = [_Unit.of(ranked[g * size : (g + 1) * size]) for g in range(count)]
    if split_stages is None:
        return groups[:max_candidates]
    grouped = {member for g in groups for member in g.members}
    singles = [_Unit.of([d]) for d in ordered if d.id not in grouped and d.memory_bytes >= alone]
    return groups + singles[: max(max_candidates - len(groups), 0)]


def _placement(
    layers: Sequence[LayerProfile],
    units: Sequence[_Unit],
    workload: Workload,
    back: dict[tuple[int, int], tuple[int, int]],
    mask: int,
    bottleneck: float,
    price: float,
) -> Placement:
    stages: list[StagePlan] = []
    i, n = len(layers), len(layers)
    count = bin(mask).count("1")
    while i > 0:
        s, k = back[(i, mask)]
        unit = units[k]
        index = count - 1 - len(stages)
        stages.append(
            StagePlan(
                device_ids=unit.members,
                layer_start=s,
                layer_end=i,
                seconds_per_micro_batch=stage_seconds(
                    layers[s:i], unit.device, workload, last=i == n, ranks=unit.ranks,
                    input_bytes_per_sample=_input_bytes(layers, s),
                ),
                memory_bytes=placed_stage_memory(layers[s:i], workload, index, count, unit.ranks),
            )
        )
        i, mask = s, mask & ~(1 << k)
    return Placement(tuple(reversed(stages)), bottleneck, price, workload.micro_batch_size)


def _why_not(
    layers: Sequence[LayerProfile],
    units: Sequence[_Unit],
    workload: Workload,
    min_stages: int,
    max_price_per_hour: float | None,
    complete: dict[int, float],
) -> str:
    largest = max(unit.device.memory_bytes for unit in units)
    for index, layer in enumerate(layers):
        if all(_room([layer], workload, u) == 0 for u in units):
            need = min(stage_memory([layer], workload, u.ranks, in_flight=1) for u in units)
            return (
                f"layer {index} needs {_gib(need)} to train (weights, optimizer state and activations of "
                f"at least one micro-batch) but the largest device has {_gib(largest)}; use "
                "fewer or smaller micro-batches, smaller layers, or devices with more memory"
            )
    prices = [
        sum(units[k].device.price_per_hour for k in range(len(units)) if mask >> k & 1)
        for mask in complete
        if bin(mask).count("1") >= min_stages
    ]
    if prices and max_price_per_hour is not None:  # placements fit, but none within the budget
        cheapest = min(prices)
        return (
            f"every placement that fits costs more than the budget of ${max_price_per_hour:.4f}/hour "
            f"(the cheapest is ${cheapest:.4f}/hour); raise the budget or wait for cheaper devices"
        )
    devices = sum(unit.ranks for unit in units)
    return (
        f"no split of {len(layers)} layers over {min_stages} or more of the {devices} devices fits "
        f"their memory (the model needs {_gib(stage_memory(layers, workload))} in all); add devices or use a "
        "smaller model"
    )


def _check(
    layers: Sequence[LayerProfile],
    devices: Sequence[Device],
    workload: Workload,
    min_stages: int,
    max_stages: int | None,
) -> None:
    if not layers:
        raise ValueError("a model needs at least one layer to place")
    if not devices:
        raise PlacementError("no device is available")
    if min_stages < 1 or (max_stages is not None and max_stages < min_stages):
        raise ValueError(f"need 1 <= min_stages <= max_stages, got {min_stages} and {max_stages}")
    if workload.micro_batch_size < 1 or workload.micro_batches < 1:
        raise ValueError(f"micro-batch size and count must be >= 1, got {workload}")
    for layer in layers:
        if not math.isfinite(layer.flops_per_sample) or layer.flops_per_sample < 0 or layer.params < 0:
            raise ValueError(f"layer costs must be finite and >= 0, got {layer}")
    for device in devices:
        if not (math.isfinite(device.flops) and device.flops > 0):
            raise ValueError(f"device {device.id} must have positive flops, got {device.flops}")
        if not device.bandwidth_bytes_per_s > 0 or device.latency_s < 0:
            raise ValueError(f"device {device.id} needs a positive bandwidth and a latency >= 0")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
