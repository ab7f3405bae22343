"""A relay serves TLS only, as the operator's identity: a client pinned to its certificate is served, a client
pinned to any other certificate, or speaking plaintext, is refused (arceus/relay/__main__.py,
arceus/relay/channel.py). Replicas both behind it exchange exactly over their exchange streams, which it splices
onto the agents' exchange listeners (arceus/relay/dialer.py, nodeagent/relay_attachment.py); a Dial naming no
listener of an agent is refused before anything is held for it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from arceus.contracts.certificates import RELAY_TLS_NAME
from arceus.contracts.credentials import replica_token, token_digest
from arceus.relay import dialer
from arceus.relay.address import relayed_address
from arceus.relay.channel import relay_channel
from arceus.relay.server import LISTENER_KEY, TARGET_KEY
from arceus.relay.tickets import METADATA_KEY as TICKET_KEY
from arceus.relay.tickets import mint_ticket
from arceus.v1 import relay_pb2, relay_pb2_grpc, stage_pb2
from arceus.wire.tls import new_identity
from nodeagent.exchange_stream import exchange_hellos
from nodeagent.peer_streams import PeerStreams
from nodeagent.relay_attachment import RelayAttachment
from nodeagent.replicas import ReplicaExchange
from tests.nodeagent.replica_exchanges import exchange_together

SERVICE = "arceus.v1.RelayService"


def _identity(tmp_path: Path) -> tuple[Path, Path]:
    key, certificate = tmp_path / "relay.key", tmp_path / "relay.pem"
    made = subprocess.run([sys.executable, "-m", "arceus.relay", "--new-identity", "--tls-key", str(key),
                           "--tls-cert", str(certificate)], capture_output=True, text=True, check=True)
    assert "ARCEUS_RELAY_CERTIFICATE_FILE" in made.stdout
    assert key.stat().st_mode & 0o077 == 0  # the key is the owner's alone
    return key, certificate


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[str, str, bytes]]:
    """A relay process: (its address, its certificate, its secret)."""
    key, certificate = _identity(tmp_path)
    secret = secrets.token_hex(32)  # the relay takes the variable's bytes as they are
    process = subprocess.Popen(
        [sys.executable, "-m", "arceus.relay", "--listen", "127.0.0.1:0", "--tls-key", str(key),
         "--tls-cert", str(certificate)],
        env={**os.environ, "ARCEUS_RELAY_SECRET": secret}, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("RELAY READY address="), line
        yield line.strip().partition("address=")[2], certificate.read_text(), secret.encode()
    finally:
        process.terminate()
        process.wait(timeout=10)


def _health(channel: grpc.Channel) -> int:
    return HealthStub(channel).Check(HealthCheckRequest(service=SERVICE), timeout=5).status


def test_a_client_pinned_to_the_relays_certificate_is_served(relay: tuple[str, str, bytes]) -> None:
    address, certificate, _ = relay
    with relay_channel(address, certificate) as channel:
        assert _health(channel) == HealthCheckResponse.SERVING


def test_a_client_pinned_to_another_certificate_is_refused(relay: tuple[str, str, bytes]) -> None:
    address, _, secret = relay
    impostor_pin = new_identity(RELAY_TLS_NAME).certificate  # right name, wrong key: a relay nobody configured
    with relay_channel(address, impostor_pin) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _health(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Nor does an attachment's ticket leave this client: the handshake fails before any call is sent.
        attach = relay_pb2_grpc.RelayServiceStub(channel).Attach(
            relay_pb2.AttachRequest(), metadata=((TICKET_KEY, mint_ticket(secret, "n", 2**40)),),
            timeout=5)
        with pytest.raises(grpc.RpcError) as refused_attach:
            next(attach)
        assert refused_attach.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(relay: tuple[str, str, bytes]) -> None:
    address, _, _ = relay
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _health(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_no_pinned_certificate_opens_no_channel() -> None:
    with pytest.raises(ValueError, match="ARCEUS_RELAY_CERTIFICATE_FILE"):
        relay_channel("127.0.0.1:1", "")


def test_a_relay_without_its_identity_files_does_not_start(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "arceus.relay", "--tls-key", str(tmp_path / "k"),
                          "--tls-cert", str(tmp_path / "c")], capture_output=True, text=True,
                         env={**os.environ, "ARCEUS_RELAY_SECRET": secrets.token_hex(32)})
    assert run.returncode == 2
    assert "--new-identity" in run.stderr


def test_replicas_both_behind_relays_exchange_exactly_through_them(relay: tuple[str, str, bytes]) -> None:
    address, certificate, secret = relay
    members, total = (0, 1), 257
    identities = {k: new_identity() for k in members}
    tokens = {k: replica_token("d" * 64, 1, k) for k in members}
    peers = {k: stage_pb2.ReplicaPeer(stage_index=1, replica=k, address=relayed_address(f"home-{k}"),
                                      certificate=identities[k].certificate, token_digest=token_digest(tokens[k]))
             for k in members}
    wires = {k: PeerStreams(identities[k]) for k in members}
    exchanges = {k: ReplicaExchange(job_id="j", stage_index=1, generation=1, replica=k, token=tokens[k],
                                    total_elements=total, max_replicas=2, streams=wires[k]) for k in members}
    attachments = []
    dialer.use_relays([address], certificate)
    try:
        for k in members:
            wires[k].trust([identities[j].certificate for j in members if j != k])
            wires[k].listen("127.0.0.1", exchange_hellos(lambda hello, sock, k=k: exchanges[k].offer(hello, sock)))
            exchanges[k].learn(0, peers.values())
            # Only the exchange listener: nothing else of these agents is reachable, through the relay or not.
            attachment = RelayAttachment("127.0.0.1", {relay_pb2.EXCHANGE: wires[k].port})
            attachment.assign(address, mint_ticket(secret, f"home-{k}", 2**40), certificate)
            attachments.append(attachment)
        deadline = time.monotonic() + 20
        while any(a.report()["attached"] != address for a in attachments):
            assert time.monotonic() < deadline, [a.report() for a in attachments]
            time.sleep(0.05)

        generator = torch.Generator().manual_seed(3)
        # Magnitudes far apart: a sum in another order, or a byte changed on the way, gives other bits.
        partials = {k: torch.randn(total, generator=generator) * 10.0 ** torch.randint(-6, 6, (total,))
                    for k in members}

        def unasked(_sibling: int) -> int:
            return 1  # the relay picks the listener: a port answered is not dialled (nothing listens at 1)

        results, errors = exchange_together(exchanges, partials, peer_of=peers.__getitem__, port_of=unasked)
        assert not errors, errors
        expected = partials[0].clone().add_(partials[1])
        for k in members:
            assert torch.equal(results[k], expected), k
    finally:
        dialer.use_relays((), "")
        for attachment in attachments:
            attachment.stop()
        for k in members:
            exchanges[k].close()
            wires[k].close()


def test_a_dial_naming_no_listener_of_an_agent_is_refused(relay: tuple[str, str, bytes]) -> None:
    address, certificate, _ = relay
    with relay_channel(address, certificate) as channel:
        replies = relay_pb2_grpc.RelayServiceStub(channel).Dial(
            iter(()), metadata=((TARGET_KEY, "home-0"), (LISTENER_KEY, "ssh")), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            next(replies)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
