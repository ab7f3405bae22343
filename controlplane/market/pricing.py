"""Posted prices: pure functions of a device's class and the market's demand and supply.

A device class is a (compute tier, memory tier) pair (`controlplane/nodes/device_class.py`). Each class has a
base price relative to a typical laptop (`PricingPolicy.baseline_per_hour`, about $0.30/hour). The price in
force moves with utilisation (demand / supply): up when jobs want more devices than are offered, down when
devices sit idle, bounded to a band around the base price and smoothed so one busy minute does not whipsaw
contributors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Each tier's price factor vs. the standard tier (the tiers: controlplane/nodes/device_class.py)
COMPUTE_FACTORS = {"light": 0.6, "standard": 1.0, "fast": 3.0, "accelerator": 10.0}
MEMORY_FACTORS = {"small": 0.8, "medium": 1.0, "large": 1.3}


@dataclass(frozen=True)
class PricingPolicy:
    baseline_per_hour: float = 0.30  # a standard-medium device: a typical laptop
    min_multiplier: float = 0.5  # the price never drops below half the class's base ...
    max_multiplier: float = 3.0  # ... nor rises above three times it
    elasticity: float = 0.5  # price ∝ utilisation ** elasticity inside the band
    smoothing: float = 0.3  # each repricing moves this fraction of the way to the target


def base_price(device_class_name: str, policy: PricingPolicy) -> float:
    """The class's price per hour when demand and supply balance."""
    compute, _, memory = device_class_name.partition("-")
    try:
        return policy.baseline_per_hour * COMPUTE_FACTORS[compute] * MEMORY_FACTORS[memory]
    except KeyError:
        raise ValueError(f"unknown device class {device_class_name!r}") from None


def target_multiplier(demand: float, supply: float, policy: PricingPolicy) -> float:
    """Utilisation (demand / supply) ** elasticity, clamped to the band. No supply with demand waiting
    is the top of the band; no demand at all is the bottom."""
    if demand < 0 or supply < 0:
        raise ValueError(f"demand and supply must be >= 0, got {demand} and {supply}")
    if demand == 0:
        return policy.min_multiplier
    if supply == 0:
        return policy.max_multiplier
    raw = (demand / supply) ** policy.elasticity
    return min(policy.max_multiplier, max(policy.min_multiplier, raw))


def next_price(
    device_class_name: str, demand: float, supply: float, previous: float | None, policy: PricingPolicy
) -> float:
    """The posted price after one repricing: `smoothing` of the way from `previous` (None: the base
    price) to the target, rounded to a hundredth of a cent; always inside the class's band."""
    base = base_price(device_class_name, policy)
    target = base * target_multiplier(demand, supply, policy)
    start = base if previous is None or not math.isfinite(previous) else previous
    low, high = base * policy.min_multiplier, base * policy.max_multiplier
    price = min(high, max(low, start + policy.smoothing * (target - start)))
    return round(price, 4)

