"""Registration proves possession (controlplane/nodes/possession.py, arceus/contracts/possession.py): a node registers
a certificate only by signing a fresh challenge of its own with the certificate's key; a key belongs to one node; and
registrations are throttled per owner and per client address."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.possession import possession_sign
from arceus.wire.tls import TlsIdentity, new_identity
from controlplane.common.errors import ApplicationError
from controlplane.nodes.models import Node
from controlplane.nodes.possession import (
    CHALLENGE_SECONDS,
    registration_challenge_new,
    registration_possession_check,
)
from controlplane.nodes.services import node_create
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db

CAPABILITIES = {"device_type": "cpu", "device_name": "cpu", "memory_bytes": 2**33, "flops_fp32": 1e10}


def agent_of(owner: User, name: str, address: str = "203.0.113.9") -> tuple[Node, APIClient]:
    node, token = node_create(owner=owner, name=name)
    client = APIClient(REMOTE_ADDR=address)
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return node, client


def body(address: str, identity: TlsIdentity) -> dict[str, Any]:
    return {"grpc_address": address, "capabilities": CAPABILITIES, "tls_certificate": identity.certificate}


def test_another_nodes_certificate_is_refused_and_the_victim_keeps_its_own(user: User, other_user: User) -> None:
    victim_identity = new_identity()
    victim, victim_agent = agent_of(user, "victim")
    assert agent_register(victim_agent, body("198.51.100.7:50051", victim_identity), victim_identity).status_code == 200

    thief, thief_agent = agent_of(other_user, "thief")
    # The thief has the victim's certificate and address (both public) but not its key: he signs with his own.
    stolen = agent_register(thief_agent, body("198.51.100.7:50051", victim_identity), new_identity())
    assert stolen.status_code == 400
    assert stolen.json()["errors"] == {
        "tls_proof": ["is not a signature of this challenge by the certificate's key: only the holder of the key "
                      "may register the certificate"]
    }
    thief.refresh_from_db()
    assert not thief.is_registered and thief.tls_certificate == ""
    victim.refresh_from_db()
    assert victim.tls_certificate == victim_identity.certificate

    missing = thief_agent.post("/api/agent/register", body("198.51.100.8:1", new_identity()), format="json")
    assert missing.status_code == 400 and set(missing.json()["errors"]) == {"challenge", "tls_proof"}


def test_a_proof_made_for_another_nodes_challenge_is_refused(user: User) -> None:
    mine, my_agent = agent_of(user, "mine")
    other, _ = agent_of(user, "other")
    identity = new_identity()
    challenge = registration_challenge_new(node=other, now=timezone.now())
    proof = possession_sign(identity.key_pem, challenge, identity.certificate)
    answer = my_agent.post("/api/agent/register", {**body("198.51.100.9:1", identity), "challenge": challenge,
                                                  "tls_proof": proof}, format="json")
    assert answer.status_code == 400
    assert answer.json()["errors"] == {
        "challenge": ["not a challenge issued to this node; POST /api/agent/challenge for one"]
    }


def test_a_challenge_expires(user: User) -> None:
    node, _ = agent_of(user, "slow")
    identity = new_identity()
    issued = timezone.now()
    challenge = registration_challenge_new(node=node, now=issued)
    proof = possession_sign(identity.key_pem, challenge, identity.certificate)
    registration_possession_check(node=node, challenge=challenge, certificate=identity.certificate, proof=proof,
                                  now=issued + timedelta(seconds=CHALLENGE_SECONDS - 1))
    with pytest.raises(ApplicationError, match="challenge: expired"):
        registration_possession_check(node=node, challenge=challenge, certificate=identity.certificate, proof=proof,
                                      now=issued + timedelta(seconds=CHALLENGE_SECONDS + 1))


def test_a_key_belongs_to_one_node(user: User) -> None:
    """Even its holder cannot register one key for two nodes (an owner who copied --tls-key-file)."""
    shared = new_identity()
    first, first_agent = agent_of(user, "first")
    _, second_agent = agent_of(user, "second")
    assert agent_register(first_agent, body("198.51.100.10:1", shared), shared).status_code == 200
    again = agent_register(second_agent, body("198.51.100.11:1", shared), shared)
    assert again.status_code == 409
    assert again.json()["detail"] == (
        "tls_certificate: its key is registered by another node; each node's agent needs its own key (leave "
        "--tls-key-file out and the agent makes one)"
    )
    assert agent_register(first_agent, body("198.51.100.10:1", shared), shared).status_code == 200  # its own again
    fresh = new_identity()  # the first node's agent restarted with a new key: the old one is free again
    assert agent_register(first_agent, body("198.51.100.10:1", fresh), fresh).status_code == 200
    assert agent_register(second_agent, body("198.51.100.11:1", shared), shared).status_code == 200


def test_100_rapid_registrations_are_throttled_per_owner(user: User, other_user: User) -> None:
    identity = new_identity()
    _, client = agent_of(user, "flood", address="203.0.113.20")
    answers = [agent_register(client, body("198.51.100.12:1", identity), identity).status_code for _ in range(100)]
    assert answers[:30] == [200] * 30  # ARCEUS_THROTTLE_AGENT_REGISTER_OWNER: 30/min
    assert set(answers[30:]) == {429}
    refused = agent_register(client, body("198.51.100.12:1", identity), identity)
    assert int(refused["Retry-After"]) > 0 and "throttled" in refused.json()["detail"]
    # Another owner's node from another address is not held back by this owner's flood.
    other = new_identity()
    _, elsewhere = agent_of(other_user, "elsewhere", address="203.0.113.21")
    assert agent_register(elsewhere, body("198.51.100.13:1", other), other).status_code == 200


def test_registrations_from_one_address_are_throttled_across_owners(user: User) -> None:
    owners = [User.objects.create_user(f"owner-{i}", password="x") for i in range(4)]
    answers = []
    for i in range(70):  # spread over owners so that no owner reaches its own limit
        identity = new_identity()
        _, client = agent_of(owners[i % 4], f"n{i}", address="203.0.113.30")
        answers.append(agent_register(client, body(f"198.51.100.{i}:1", identity), identity).status_code)
    assert answers[:60] == [200] * 60 and set(answers[60:]) == {429}  # ARCEUS_THROTTLE_AGENT_REGISTER_ADDRESS
