"""Reachability, measured (controlplane/nodes/reachability.py): a sweep dials back every node whose reachability is
unknown, records an agent that answers as `direct` and one that does not as `relayed` (which placement then sees),
and registrations queue one sweep on the reachability queue, not one each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.agents.services import node_register
from controlplane.celery import CHECK_REACHABILITY_TASK, REACHABILITY_QUEUE, app
from controlplane.common.dispatch import dequeued
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.nodes.models import Node, Reachability
from controlplane.nodes.reachability import nodes_check_reachability
from controlplane.nodes.services import node_create
from devtools.cluster import free_port
from devtools.pipeline import identity_for
from nodeagent.agent import Agent

pytestmark = pytest.mark.django_db


@pytest.fixture
def reachability_queue() -> Iterator[object]:
    """The real reachability queue, empty before and after, with no sweep marked queued."""
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(REACHABILITY_QUEUE)
        queue.clear()
        dequeued(CHECK_REACHABILITY_TASK)
        try:
            yield queue
        finally:
            queue.clear()
            dequeued(CHECK_REACHABILITY_TASK)
            queue.close()


def register(user: User, name: str, address: str, certificate: str, exchange_address: str = "") -> Node:
    node, _ = node_create(owner=user, name=name)
    return node_register(node=node, grpc_address=address, tls_certificate=certificate, device_type="cpu",
                         device_name="cpu", memory_bytes=2**30, flops_fp32=1e9, now=timezone.now(),
                         exchange_address=exchange_address)


def test_a_sweep_records_an_answering_agent_direct_and_a_silent_one_relayed(user: User, agent: Agent,
                                                                             settings) -> None:  # noqa: ANN001
    settings.ARCEUS_REACHABILITY_TIMEOUT_SECONDS = 1.0
    answering = register(user, "open", agent.advertise_address, agent.identity.certificate)
    silent_address = f"127.0.0.1:{free_port()}"  # nothing listens: a router that drops the dial, as seen from here
    silent = register(user, "behind-a-router", silent_address, identity_for(silent_address).certificate)
    impostor = register(user, "wrong-certificate", agent.advertise_address, identity_for("elsewhere").certificate)
    assert {n.reachability for n in (answering, silent, impostor)} == {Reachability.UNKNOWN}

    assert nodes_check_reachability() == {Reachability.DIRECT: 1, Reachability.RELAYED: 2, Reachability.UNKNOWN: 0}
    found = dict(Node.objects.filter(owner=user).values_list("name", "reachability"))
    # An agent that answers but not as the certificate its node registered is not the node's agent.
    assert found == {"open": Reachability.DIRECT, "behind-a-router": Reachability.RELAYED,
                     "wrong-certificate": Reachability.RELAYED}
    nothing = {Reachability.DIRECT: 0, Reachability.RELAYED: 0, Reachability.UNKNOWN: 0}
    assert nodes_check_reachability() == nothing  # nothing left unknown
    devices = {view.name: view.device() for view in node_views(registered_nodes())}
    assert not devices["open"].relayed and devices["behind-a-router"].relayed  # placement's view


def test_an_address_answers_for_one_node_at_a_time(user: User, agent: Agent, settings) -> None:  # noqa: ANN001
    """A node found direct at an address keeps it only while its own key answers there: when another node's agent
    answers at that address, the older node is dialled again and, its key gone from there, found relayed."""
    settings.ARCEUS_REACHABILITY_TIMEOUT_SECONDS = 1.0
    earlier = register(user, "earlier", agent.advertise_address, identity_for("an earlier agent").certificate)
    Node.objects.filter(pk=earlier.pk).update(reachability=Reachability.DIRECT)  # found there by an earlier sweep
    register(user, "now", agent.advertise_address, agent.identity.certificate)
    assert nodes_check_reachability() == {Reachability.DIRECT: 1, Reachability.RELAYED: 0, Reachability.UNKNOWN: 1}
    assert nodes_check_reachability() == {Reachability.DIRECT: 0, Reachability.RELAYED: 1, Reachability.UNKNOWN: 0}
    found = dict(Node.objects.filter(owner=user).values_list("name", "reachability"))
    assert found == {"earlier": Reachability.RELAYED, "now": Reachability.DIRECT}


def test_registrations_queue_one_sweep_until_it_starts(user: User, reachability_queue,  # noqa: ANN001
                                                       django_capture_on_commit_callbacks) -> None:  # noqa: ANN001
    with django_capture_on_commit_callbacks(execute=True):
        for i in range(3):
            register(user, f"n{i}", f"127.0.0.1:{5000 + i}", identity_for(f"127.0.0.1:{5000 + i}").certificate)
    assert reachability_queue.qsize() == 1  # one sweep dials all three
    message = reachability_queue.get(timeout=1)
    assert message.headers["task"] == CHECK_REACHABILITY_TASK
    message.ack()
    dequeued(CHECK_REACHABILITY_TASK)  # what the sweep does as it starts: a later registration needs another
    with django_capture_on_commit_callbacks(execute=True):
        register(user, "late", "127.0.0.1:5009", identity_for("127.0.0.1:5009").certificate)
    assert reachability_queue.qsize() == 1


def test_a_direct_nodes_exchange_listener_is_dialled_too_and_one_that_does_not_answer_hosts_no_replica(
    user: User, api: APIClient, agent: Agent, settings  # noqa: ANN001
) -> None:
    """Siblings dial a direct node's replicas' exchange at the address it registered: the sweep dials it there too
    (a TLS handshake pinned to its certificate). An agent whose advertised exchange address leads nowhere (a router
    port forward never set up), or to another agent's listener, is direct but hosts no replica; a relayed node's
    exchange is reached through its relay, so it is not dialled."""
    settings.ARCEUS_REACHABILITY_TIMEOUT_SECONDS = 1.0
    with contextlib.ExitStack() as stack:
        unforwarded, elsewhere, unsaid = (
            Agent(device=torch.device("cpu"), exchange_port=free_port(),
                  advertise_exchange=f"127.0.0.1:{free_port()}"),  # nothing listens there
            Agent(device=torch.device("cpu")), Agent(device=torch.device("cpu")))
        for started in (unforwarded, elsewhere, unsaid):
            started.start()
            stack.callback(started.stop, grace=1)
        register(user, "open", agent.advertise_address, agent.identity.certificate, agent.exchange_address)
        node = register(user, "unforwarded", unforwarded.advertise_address, unforwarded.identity.certificate,
                        unforwarded.exchange_address)
        # a listener indeed, but the first agent's: not this node's
        register(user, "elsewhere", elsewhere.advertise_address, elsewhere.identity.certificate,
                 agent.exchange_address)
        register(user, "unsaid", unsaid.advertise_address, unsaid.identity.certificate)  # an agent that does not say
        silent = f"127.0.0.1:{free_port()}"
        register(user, "relayed", silent, identity_for(silent).certificate, agent.exchange_address)
        assert nodes_check_reachability() == {Reachability.DIRECT: 4, Reachability.RELAYED: 1,
                                              Reachability.UNKNOWN: 0}
    found = {name: (reachability, exchange) for name, reachability, exchange in Node.objects.filter(owner=user)
             .values_list("name", "reachability", "exchange_reachable")}
    assert found == {
        "open": (Reachability.DIRECT, True),
        "unforwarded": (Reachability.DIRECT, False),
        "elsewhere": (Reachability.DIRECT, False),
        "unsaid": (Reachability.DIRECT, None),  # siblings ask its gRPC port where its listener is
        "relayed": (Reachability.RELAYED, None),
    }
    views = {view.name: view for view in node_views(registered_nodes())}  # placement's view
    assert {name for name, view in views.items() if not view.exchange_reachable} == {"unforwarded", "elsewhere"}
    assert api.get(f"/api/nodes/{node.id}").json()["exchange_reachable"] is False  # its owner sees why
    # its agent registering again (a new process, its port forward perhaps fixed) is dialled afresh
    again = node_register(node=node, grpc_address=unforwarded.advertise_address,
                          tls_certificate=unforwarded.identity.certificate, device_type="cpu", device_name="cpu",
                          memory_bytes=2**30, flops_fp32=1e9, now=timezone.now(),
                          exchange_address=unforwarded.exchange_address)
    assert (again.reachability, again.exchange_reachable) == (Reachability.UNKNOWN, None)
