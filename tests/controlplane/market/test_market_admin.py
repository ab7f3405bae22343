"""The market admin: "Re-price now" runs the pricing service; prices and the ledger are read-only."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.market.models import PriceChange

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/market/pricechange/"


def test_reprice_now_posts_prices_for_the_registered_devices(operator: Client, ready_node) -> None:  # noqa: ANN001
    ready_node("laptop")
    assert b"Re-price now" in operator.get(CHANGELIST).content
    response = operator.post(f"{CHANGELIST}reprice/", follow=True)
    [change] = PriceChange.objects.all()
    assert change.device_class == "light-small" and (change.demand, change.supply) == (0.0, 1.0)
    assert [str(m) for m in response.context["messages"]] == [f"re-priced: light-small ${change.price_per_hour:.4f}/h"]
    assert operator.get(f"{CHANGELIST}reprice/").status_code == 405  # a button, not a link


def test_prices_and_the_ledger_cannot_be_edited(operator: Client) -> None:
    change = PriceChange.objects.create(device_class="light-small", price_per_hour=0.1, demand=0, supply=0)
    assert operator.post(f"{CHANGELIST}{change.pk}/change/", {"price_per_hour": "9"}).status_code == 403
    assert PriceChange.objects.get(pk=change.pk).price_per_hour == 0.1
    assert operator.get(f"{CHANGELIST}add/").status_code == 403
    assert operator.get("/admin/market/ledgerentry/add/").status_code == 403
