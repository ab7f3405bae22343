"""A node's device class: a (compute tier, memory tier) pair from the fp32 FLOP/s the training driver measured of it
(`market_flops`) and its memory. The market prices each class (`controlplane/market/pricing.py`) and the placement
reads the same FLOP/s; Prometheus labels the agents with the class."""

from __future__ import annotations

import math

from controlplane.nodes.models import Node

GIB = 2**30
# (name, the FLOP/s or memory bytes at or above which a device is in the tier), lowest first
COMPUTE_TIERS = (("light", 0.0), ("standard", 1e11), ("fast", 1e12), ("accelerator", 1e13))
MEMORY_TIERS = (("small", 0), ("medium", 8 * GIB), ("large", 32 * GIB))
# A device no driver has timed yet counts as at most this (the standard tier's floor: a laptop's class and price).
UNMEASURED_FLOPS = 1e11


def market_flops(declared: float | None, measured: float | None) -> float:
    """The fp32 FLOP/s a device is priced and placed by: what the training driver measured of it, its agent's
    declared (or self-measured) figure only an upper bound its owner may offer below; UNMEASURED_FLOPS at most until
    a driver has measured it. A node cannot raise its class by claiming, only by being timed."""
    ceiling = measured if measured is not None and math.isfinite(measured) else UNMEASURED_FLOPS
    return max(0.0, min(declared or 0.0, ceiling))


def device_class(flops: float, memory_bytes: int) -> str:
    """ "<compute tier>-<memory tier>", e.g. "standard-medium" for a laptop CPU with 16 GiB."""
    return f"{_tier(COMPUTE_TIERS, flops)}-{_tier(MEMORY_TIERS, memory_bytes)}"


def node_device_class(node: Node) -> str:
    return device_class(market_flops(node.flops_fp32, node.flops_measured), node.memory_bytes or 0)


def _tier(tiers: tuple[tuple[str, float], ...], value: float) -> str:
    chosen = tiers[0][0]
    for name, floor in tiers:
        if value >= floor:
            chosen = name
    return chosen
