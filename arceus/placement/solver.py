"""Choose devices for a model's pipeline stages and where to cut it: the marketplace's placement solver.

Pure and Django-free. Stage time per micro-batch is its compute (forward plus a backward of about twice
the cost, over the device's FLOP/s) plus, for every stage but the last, sending its output forward and
receiving the gradient back over the device's link. The pipeline runs at the pace of its slowest stage,
so the solver minimises that bottleneck; a stage never needs more memory than its device has (weights,
gradients and optimizer state, plus the activations stashed for every micro-batch in flight); and among
placements within `PRICE_TOLERANCE` of the fastest, the cheapest per hour wins, within the budget.

The search is exact for this cost model: dynamic programming over (layers placed, set of devices used),
O(n² · d · 2^d) for n layers and d candidate devices, so only the `max_candidates` best devices by speed
are considered (8 by default: under a second in Python for 16 layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Training memory per parameter: an fp32 weight, its gradient and two optimizer moments (Adam's m and v).
BYTES_PER_PARAMETER = 4 * 4
BACKWARD_FACTOR = 3.0  # forward + backward ≈ 3 × forward FLOPs
PRICE_TOLERANCE = 0.02  # a placement this much slower than the fastest may win by being cheaper


class PlacementError(ValueError):
    """No placement satisfies the constraints; the message says which one binds and what would help."""


@dataclass(frozen=True)
class LayerProfile:
    flops_per_sample: float  # forward
    params: int
    output_bytes_per_sample: int  # the activation this layer hands to the next one


@dataclass(frozen=True)
class Device:
    id: str
    flops: float  # sustained FLOP/s
    memory_bytes: int
    bandwidth_bytes_per_s: float = math.inf  # its link to the other agents
    latency_s: float = 0.0
    price_per_hour: float = 0.0


@dataclass(frozen=True)
class Workload:
    micro_batch_size: int
    micro_batches: int  # in flight per step (GPipe stashes every one's activations)


@dataclass(frozen=True)
class StagePlan:
    device_id: str
    layer_start: int
    layer_end: int
    seconds_per_micro_batch: float
    memory_bytes: int


@dataclass(frozen=True)
class Placement:
    stages: tuple[StagePlan, ...]
    bottleneck_seconds: float  # per micro-batch, of the slowest stage
    price_per_hour: float
    micro_batch_size: int

    @property
    def samples_per_second(self) -> float:
        return self.micro_batch_size / self.bottleneck_seconds if self.bottleneck_seconds > 0 else math.inf


def layer_training_memory(params: int) -> int:
    return params * BYTES_PER_PARAMETER


def stage_memory(layers: Sequence[LayerProfile], workload: Workload) -> int:
    """Bytes a stage holding `layers` needs: weights with gradients and optimizer state, plus every
    in-flight micro-batch's stashed activations."""
    weights = sum(layer_training_memory(layer.params) for layer in layers)
    stash = workload.micro_batches * workload.micro_batch_size * sum(layer.output_bytes_per_sample for layer in layers)
    return weights + stash


def stage_seconds(layers: Sequence[LayerProfile], device: Device, workload: Workload, *, last: bool) -> float:
    """Seconds per micro-batch: compute, plus (unless last) the activation out and the gradient back."""
    compute = BACKWARD_FACTOR * workload.micro_batch_size * sum(layer.flops_per_sample for layer in layers)
    seconds = compute / device.flops
    if not last:
        payload = workload.micro_batch_size * layers[-1].output_bytes_per_sample
        seconds += 2 * (payload / device.bandwidth_bytes_per_s + device.latency_s)
    return seconds


def solve(
    layers: Sequence[LayerProfile],
    devices: Sequence[Device],
    workload: Workload,
    *,
    min_stages: int = 1,
    max_stages: int | None = None,
    max_price_per_hour: float | None = None,
    max_candidates: int = 8,
) -> Placement:
    """The placement described in the module docstring; PlacementError when none fits."""
    _check(layers, devices, workload, min_stages, max_stages)
    n = len(layers)
    max_stages = min(max_stages or n, n, len(devices))
    if min_stages > max_stages:
        raise PlacementError(
            f"needs at least {min_stages} devices (one stage each) but only {min(len(devices), n)} can be used "
            f"({len(devices)} offered for {n} layers)"
        )
    candidates = sorted(devices, key=lambda d: (-d.flops, d.price_per_hour, d.id))[:max_candidates]
    d = len(candidates)
    # cost[s][e][k]: seconds of layers [s, e) on candidate k (inf if it does not fit its memory).
    cost = [[[math.inf] * d for _ in range(n + 1)] for _ in range(n)]
    for s in range(n):
        for e in range(s + 1, n + 1):
            need = stage_memory(layers[s:e], workload)
            for k, device in enumerate(candidates):
                if need <= device.memory_bytes:
                    cost[s][e][k] = stage_seconds(layers[s:e], device, workload, last=e == n)
    # best[i][mask]: the smallest bottleneck placing layers [0, i) on exactly the devices in mask.
    best: list[dict[int, float]] = [dict() for _ in range(n + 1)]
    back: dict[tuple[int, int], tuple[int, int]] = {}
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for s in range(i):
            for mask, value in best[s].items():
                if bin(mask).count("1") >= max_stages:
                    continue
                for k in range(d):
                    bit = 1 << k
                    if mask & bit or cost[s][i][k] == math.inf:
                        continue
                    bottleneck = max(value, cost[s][i][k])
                    if bottleneck < best[i].get(mask | bit, math.inf):
                        best[i][mask | bit] = bottleneck
                        back[(i, mask | bit)] = (s, k)
    options = []
    for mask, bottleneck in best[n].items():
        price = sum(candidates[k].price_per_hour for k in range(d) if mask >> k & 1)
        if bin(mask).count("1") >= min_stages and (max_price_per_hour is None or price <= max_price_per_hour):
            options.append((bottleneck, price, mask))
    if not options:
        raise PlacementError(_why_not(layers, candidates, workload, min_stages, max_price_per_hour, best[n]))
    fastest = min(bottleneck for bottleneck, _, _ in options)
    _, price, mask = min(
        (o for o in options if o[0] <= fastest * (1 + PRICE_TOLERANCE)), key=lambda o: (o[1], o[0], o[2])
    )
    return _placement(layers, candidates, workload, back, mask, best[n][mask], price)


def _placement(
    layers: Sequence[LayerProfile],
    candidates: Sequence[Device],
    workload: Workload,
    back: dict[tuple[int, int], tuple[int, int]],
    mask: int,
    bottleneck: float,
    price: float,
) -> Placement:
    stages: list[StagePlan] = []
    i, n = len(layers), len(layers)
    while i > 0:
        s, k = back[(i, mask)]
        device = candidates[k]
        stages.append(
            StagePlan(
                device_id=device.id,
                layer_start=s,
                layer_end=i,
                seconds_per_micro_batch=stage_seconds(layers[s:i], device, workload, last=i == n),
                memory_bytes=stage_memory(layers[s:i], workload),
            )
        )
        i, mask = s, mask & ~(1 << k)
    return Placement(tuple(reversed(stages)), bottleneck, price, workload.micro_batch_size)


def _why_not(
    layers: Sequence[LayerProfile],
    candidates: Sequence[Device],
    workload: Workload,
    min_stages: int,
    max_price_per_hour: float | None,
    complete: dict[int, float],
) -> str:
    largest = max(device.memory_bytes for device in candidates)
    for index, layer in enumerate(layers):
        need = stage_memory([layer], workload)
        if need > largest:
            return (
                f"layer {index} needs {_gib(need)} to train (weights, optimizer state and activations of "
                f"{workload.micro_batches} micro-batches) but the largest device has {_gib(largest)}; use "
                "fewer or smaller micro-batches, smaller layers, or devices with more memory"
            )
    prices = [
        sum(candidates[k].price_per_hour for k in range(len(candidates)) if mask >> k & 1)
        for mask in complete
        if bin(mask).count("1") >= min_stages
    ]
    if prices and max_price_per_hour is not None:  # placements fit, but none within the budget
        cheapest = min(prices)
        return (
            f"every placement that fits costs more than the budget of ${max_price_per_hour:.4f}/hour "
            f"(the cheapest is ${cheapest:.4f}/hour); raise the budget or wait for cheaper devices"
        )
    return (
        f"no split of {len(layers)} layers over {min_stages} or more of the {len(candidates)} devices fits "
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
