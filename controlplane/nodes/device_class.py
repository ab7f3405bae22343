"""A node's device class: a (compute tier, memory tier) pair from its agent's measured fp32 FLOP/s and memory.
The market prices each class (`controlplane/market/pricing.py`); Prometheus labels the agents with it."""

from __future__ import annotations

from controlplane.nodes.models import Node

GIB = 2**30
# (name, the FLOP/s or memory bytes at or above which a device is in the tier), lowest first
COMPUTE_TIERS = (("light", 0.0), ("standard", 1e11), ("fast", 1e12), ("accelerator", 1e13))
MEMORY_TIERS = (("small", 0), ("medium", 8 * GIB), ("large", 32 * GIB))


def device_class(flops: float, memory_bytes: int) -> str:
    """ "<compute tier>-<memory tier>", e.g. "standard-medium" for a laptop CPU with 16 GiB."""
    return f"{_tier(COMPUTE_TIERS, flops)}-{_tier(MEMORY_TIERS, memory_bytes)}"


def node_device_class(node: Node) -> str:
    return device_class(node.flops_fp32 or 0.0, node.memory_bytes or 0)


def _tier(tiers: tuple[tuple[str, float], ...], value: float) -> str:
    chosen = tiers[0][0]
    for name, floor in tiers:
        if value >= floor:
            chosen = name
    return chosen
