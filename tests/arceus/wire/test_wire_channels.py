"""Who answers (arceus/wire/channels.py `agents_answering`): a live agent pinned to its certificate does; an address
where nothing listens does not, and, asked about an agent that was serving a moment ago, that is known at the
refused connection rather than after the whole timeout. Its replicas' exchange listener (`exchanges_answering`)
answers for its own certificate only; a port that accepts but never speaks TLS costs the timeout, no more."""

from __future__ import annotations

import socket
import time

from arceus.wire.channels import agents_answering, exchanges_answering
from devtools.cluster import free_port
from devtools.pipeline import identity_for
from nodeagent.agent import Agent

TIMEOUT = 60.0


def test_a_refused_connection_is_down_at_once_when_asked(agent: Agent) -> None:
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: a killed agent's port
    targets = [(agent.advertise_address, agent.identity.certificate), (closed, identity_for(closed).certificate)]
    began = time.monotonic()
    assert agents_answering(targets, timeout=TIMEOUT, concurrency=2, refused_is_down=True) == [True, False]
    assert time.monotonic() - began < TIMEOUT / 2  # it did not wait the refused one out


def test_an_impostor_does_not_answer_for_the_pinned_certificate(agent: Agent) -> None:
    wrong = identity_for("elsewhere").certificate
    assert agents_answering([(agent.advertise_address, wrong)], timeout=2.0, concurrency=1) == [False]


def test_an_exchange_listener_answers_for_its_agents_certificate_only(agent: Agent) -> None:
    closed = f"127.0.0.1:{free_port()}"
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts, never handshakes
        muted = f"127.0.0.1:{mute.getsockname()[1]}"
        targets = [(agent.exchange_address, agent.identity.certificate),
                   (agent.exchange_address, identity_for("elsewhere").certificate),
                   (closed, agent.identity.certificate), (muted, agent.identity.certificate)]
        began = time.monotonic()
        assert exchanges_answering(targets, timeout=1.0, concurrency=4) == [True, False, False, False]
        assert time.monotonic() - began < 5.0
