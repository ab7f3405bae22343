"""Posted prices: bounded, monotone in demand and supply, smoothed, and about $0.30/h for a laptop."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.market.pricing import PricingPolicy, base_price, next_price, target_multiplier
from controlplane.nodes.device_class import GIB, device_class

POLICY = PricingPolicy()
CLASSES = [f"{c}-{m}" for c in ("light", "standard", "fast", "accelerator") for m in ("small", "medium", "large")]
counts = st.floats(min_value=0, max_value=1e4, allow_nan=False)
classes = st.sampled_from(CLASSES)
previous = st.one_of(st.none(), st.floats(min_value=0, max_value=100, allow_nan=False))
ROUNDING = 5e-5  # prices are posted to a hundredth of a cent


def test_a_typical_laptop_earns_about_thirty_cents_an_hour_when_the_market_balances() -> None:
    laptop = device_class(flops=1.2e11, memory_bytes=16 * GIB)  # what this machine's CPU measures
    assert laptop == "standard-medium"
    assert next_price(laptop, demand=5, supply=5, previous=None, policy=POLICY) == pytest.approx(0.30)


def test_classes_follow_measured_compute_and_memory() -> None:
    assert device_class(2e10, 4 * GIB) == "light-small"
    assert device_class(3e12, 12 * GIB) == "fast-medium"
    assert device_class(5e13, 80 * GIB) == "accelerator-large"
    prices = [base_price(name, POLICY) for name in ("accelerator-large", "fast-medium", "light-small")]
    assert prices == sorted(prices, reverse=True)
    with pytest.raises(ValueError, match="unknown device class"):
        base_price("quantum-huge", POLICY)


@given(klass=classes, demand=counts, supply=counts, prev=previous)
def test_the_price_stays_inside_the_class_band(klass: str, demand: float, supply: float, prev: float | None) -> None:
    base = base_price(klass, POLICY)
    price = next_price(klass, demand, supply, prev, POLICY)
    assert base * POLICY.min_multiplier - ROUNDING <= price <= base * POLICY.max_multiplier + ROUNDING


@given(klass=classes, low=counts, extra=counts, supply=counts, prev=previous)
def test_more_demand_never_lowers_the_price(klass: str, low: float, extra: float, supply: float, prev) -> None:
    assert next_price(klass, low + extra, supply, prev, POLICY) >= next_price(klass, low, supply, prev, POLICY)


@given(klass=classes, demand=counts, low=counts, extra=counts, prev=previous)
def test_more_supply_never_raises_the_price(klass: str, demand: float, low: float, extra: float, prev) -> None:
    assert next_price(klass, demand, low + extra, prev, POLICY) <= next_price(klass, demand, low, prev, POLICY)


@given(klass=classes, demand=counts, supply=counts, prev=st.floats(min_value=0.01, max_value=5))
def test_each_repricing_moves_part_of_the_way_toward_the_target(klass, demand, supply, prev) -> None:
    base = base_price(klass, POLICY)
    band_prev = min(base * POLICY.max_multiplier, max(base * POLICY.min_multiplier, prev))
    target = base * target_multiplier(demand, supply, POLICY)
    price = next_price(klass, demand, supply, band_prev, POLICY)
    assert min(band_prev, target) - ROUNDING <= price <= max(band_prev, target) + ROUNDING
    assert abs(price - target) <= abs(band_prev - target) + ROUNDING  # never overshoots


def test_the_band_edges_are_no_demand_and_no_supply() -> None:
    assert target_multiplier(0, 10, POLICY) == POLICY.min_multiplier
    assert target_multiplier(3, 0, POLICY) == POLICY.max_multiplier
    assert target_multiplier(4, 1, POLICY) == 2.0  # utilisation 4, elasticity 0.5
    with pytest.raises(ValueError, match=">= 0"):
        target_multiplier(-1, 1, POLICY)
