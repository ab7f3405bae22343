"""Relay tickets: a relay admits exactly the node the control plane vouched for, until the ticket expires."""

from __future__ import annotations

import pytest

from arceus.relay.address import EXCHANGE, GRPC, relay_order, relayed_address, relayed_listener, relayed_node
from arceus.relay.tickets import TicketError, mint_ticket, verify_ticket

SECRET = b"s" * 32
NODE = "6f1c2a4e-0000-4000-8000-000000000001"


def test_a_ticket_verifies_as_its_node_until_it_expires() -> None:
    ticket = mint_ticket(SECRET, NODE, 1000)
    assert verify_ticket(SECRET, ticket, now=999) == NODE
    with pytest.raises(TicketError, match="expired"):
        verify_ticket(SECRET, ticket, now=1001)


@pytest.mark.parametrize("forge", [
    lambda t: t.replace(NODE, "6f1c2a4e-0000-4000-8000-000000000002"),  # another node
    lambda t: t.replace(".1000.", ".9999."),  # a later expiry
    lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # a changed MAC
    lambda t: "garbage",
])
def test_a_forged_ticket_is_refused(forge) -> None:  # noqa: ANN001
    with pytest.raises(TicketError):
        verify_ticket(SECRET, forge(mint_ticket(SECRET, NODE, 1000)), now=0)


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        mint_ticket(b"short", NODE, 1000)


def test_relayed_addresses_name_their_node_and_nothing_else_does() -> None:
    assert relayed_node(relayed_address(NODE)) == NODE
    assert relayed_node("10.0.0.5:50051") is None
    assert relayed_node(".relayed.invalid:1") is None


def test_a_relayed_address_names_the_listener_reached_and_only_a_known_one() -> None:
    assert relayed_listener(relayed_address(NODE)) == GRPC
    assert relayed_listener(relayed_address(NODE, EXCHANGE)) == EXCHANGE
    assert relayed_node(relayed_address(NODE, EXCHANGE)) == NODE
    assert relayed_listener(f"{NODE}.relayed.invalid:22") is None
    assert relayed_listener("10.0.0.5:1") is None


def test_removing_a_relay_moves_only_the_nodes_it_held() -> None:
    relays = ["a:1", "b:1", "c:1"]
    nodes = [f"node-{i}" for i in range(200)]
    before = {n: relay_order(n, relays)[0] for n in nodes}
    after = {n: relay_order(n, ["a:1", "b:1"])[0] for n in nodes}
    assert {n for n in nodes if before[n] != after[n]} == {n for n in nodes if before[n] == "c:1"}
    assert 40 < sum(r == "c:1" for r in before.values()) < 100  # each relay gets its share
