"""A replica's side of a step (nodeagent/replicas.py): RunStep's routes checked against the replica, siblings'
streams checked before they reach the exchange and their frames before a payload is read, and the exchange run by
several replicas at once (threads of this process, each with an agent's listener of its own, over real mutual-TLS
streams on loopback) ending with the same bits on every replica: the sum in ascending replica id, across several
shards per chunk; a silent, aborted or dead sibling fails it in time."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from arceus.contracts.credentials import replica_token, token_digest
from arceus.swarm.repair import ReplicaInstructions
from arceus.swarm.routing import Routes
from arceus.v1 import stage_pb2
from arceus.verify.receipts import ReceiptSigner, ShardFields, verify_shard
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.tls import TlsIdentity, new_identity
from devtools.shaper import ShaperThread
from nodeagent.exchange_stream import FRAME, REDUCE, Hello, exchange_hellos
from nodeagent.peer_streams import PeerStreams
from nodeagent.replicas import ReplicaExchange, parse_replica_step
from nodeagent.rpc import RpcFailure
from tests.nodeagent.replica_exchanges import exchange_together, port

CERTIFICATE = new_identity().certificate
DRIVER_TOKEN = "d" * 64


def token_of(replica: int, stage: int = 1) -> str:
    return replica_token(DRIVER_TOKEN, stage, replica)


def digest_of(replica: int, stage: int = 1) -> str:
    return token_digest(token_of(replica, stage))


def peer(replica: int, stage: int = 1) -> stage_pb2.ReplicaPeer:
    return stage_pb2.ReplicaPeer(stage_index=stage, replica=replica, token_digest=digest_of(replica, stage))
ROUTES = Routes(((0, 1), (2,), (0, 3, 4)), ((0, 2, 0), (1, 2, 3), (0, 2, 4), (1, 2, 0)))


def run_step(routes: Routes = ROUTES, peers: list[tuple[int, int]] | None = None, **fields) -> stage_pb2.RunStepRequest:
    if peers is None:
        peers = [(i, k) for i, ids in enumerate(routes.members) for k in ids]
    step = stage_pb2.ReplicaStep(
        routes_json=json.dumps(routes.to_json()), epoch=3,
        peers=[stage_pb2.ReplicaPeer(stage_index=i, replica=k, address=f"10.0.0.{i}:{5000 + k}",
                                     certificate=CERTIFICATE, token_digest=digest_of(k, i)) for i, k in peers],
    )
    return stage_pb2.RunStepRequest(step=1, num_micro_batches=routes.num_micro_batches, replicas=step, **fields)


def test_a_replica_takes_the_micro_batches_its_routes_give_it_and_knows_its_peers() -> None:
    plan = parse_replica_step(run_step(), stage_index=2, num_stages=3, replica=0)
    assert plan.micro_batches == (0, 3) and plan.epoch == 3 and plan.most_replicas == 3
    assert plan.members(2) == (0, 3, 4)
    assert plan.peers[(1, 2)].address == "10.0.0.1:5002"


@pytest.mark.parametrize(
    ("request_", "replica", "words"),
    [
        (run_step(), 1, "replica 1 is not a member of stage 2"),
        (run_step(peers=[(2, 0), (2, 3), (2, 4)]), 0, "lacks stage/replica [(1, 2)]"),
        (run_step(peers=[(1, 2), (2, 3), (2, 3), (2, 4)]), 0, "names stage 2 replica 3 twice"),
        (stage_pb2.RunStepRequest(num_micro_batches=4, replicas=stage_pb2.ReplicaStep(
            routes_json=json.dumps(ROUTES.to_json()), peers=[stage_pb2.ReplicaPeer(
                stage_index=2, replica=3, address="10.0.0.2:5003", certificate=CERTIFICATE)])), 0,
         "stage 2 replica 3's token_digest is no SHA-256"),
        (stage_pb2.RunStepRequest(num_micro_batches=4, replicas=stage_pb2.ReplicaStep(routes_json="{")), 0,
         "not JSON"),
        (stage_pb2.RunStepRequest(num_micro_batches=2, replicas=stage_pb2.ReplicaStep(
            routes_json=json.dumps(ROUTES.to_json()))), 0, "route 4 micro-batches; the step has 2"),
        (stage_pb2.RunStepRequest(num_micro_batches=4, replicas=stage_pb2.ReplicaStep(
            routes_json=json.dumps({"members": [[0], [0], [1, 0]], "of": [[0, 0, 0]] * 4}))), 0,
         "replicas.routes.members[2]"),
    ],
)
def test_routes_that_do_not_fit_the_replica_are_refused_naming_what_is_wrong(
    request_: stage_pb2.RunStepRequest, replica: int, words: str
) -> None:
    with pytest.raises(RpcFailure) as info:
        parse_replica_step(request_, stage_index=2, num_stages=3, replica=replica)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message


def repair_json(**fields) -> str:
    return json.dumps({**ReplicaInstructions().to_json(), **fields})


def test_a_resumed_step_names_the_replicas_repair_instructions() -> None:
    # Stage 1 replica 2 takes micro-batches 0..3; their routes go on to stage 2's replicas 0, 3, 4 and 0.
    request = run_step(mode=stage_pb2.TRAIN)
    request.replicas.repair_json = repair_json(recompute=[1, 3], resend_outputs=[[0, 0]], skip_input_gradient=[3])
    plan = parse_replica_step(request, stage_index=1, num_stages=3, replica=2)
    assert plan.repair == ReplicaInstructions(recompute=(1, 3), resend_outputs=((0, 0),), skip_input_gradient=(3,))
    assert parse_replica_step(run_step(), stage_index=1, num_stages=3, replica=2).repair is None


@pytest.mark.parametrize(
    ("fields", "mode", "words"),
    [
        ({"recompute": [1]}, stage_pb2.EVAL, "only a train step is repaired"),
        ({"recompute": [9]}, stage_pb2.TRAIN, "names micro-batches [9], which the routes do not give this replica"),
        ({"resend_outputs": [[1, 0]]}, stage_pb2.TRAIN, "micro-batch 1 to replica 0 is not where its route goes"),
        ({"resend_input_gradients": [[0, 1]]}, stage_pb2.TRAIN, "resend_input_gradients: micro-batch 0 to replica 1"),
        ({"recompute": [-1]}, stage_pb2.TRAIN, "replicas.repair.recompute[0]"),
        ({"skip": [1]}, stage_pb2.TRAIN, "unknown keys ['skip']"),
    ],
)
def test_repair_instructions_that_do_not_fit_the_routes_are_refused(fields: dict, mode: int, words: str) -> None:
    request = run_step(mode=mode)
    request.replicas.repair_json = repair_json(**fields)
    with pytest.raises(RpcFailure) as info:
        parse_replica_step(request, stage_index=1, num_stages=3, replica=2)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message


IDENTITIES = {k: new_identity() for k in range(8)}


def sibling(k: int, stage: int = 1) -> stage_pb2.ReplicaPeer:
    """Replica k of `stage` as a RunStep names it: its agent's certificate and its token's digest."""
    return stage_pb2.ReplicaPeer(stage_index=stage, replica=k, address=f"127.0.0.1:{5000 + k}",
                                 certificate=IDENTITIES[k].certificate, token_digest=digest_of(k, stage))


@pytest.fixture
def replicas_of() -> Iterator[Callable[..., dict[int, ReplicaExchange]]]:
    """Replicas of stage 1 of job "j", each on an agent of its own (its own PeerStreams listening on loopback,
    handing streams to it as an agent's registry does), knowing `members`' tokens and certificates at epoch 0."""
    opened: list[tuple[ReplicaExchange, PeerStreams]] = []

    def make(members: tuple[int, ...], total: int, known: tuple[int, ...] | None = None,
             ) -> dict[int, ReplicaExchange]:
        exchanges = {}
        for k in members:
            wire = PeerStreams(IDENTITIES[k])
            exchange = ReplicaExchange(job_id="j", stage_index=1, generation=1, replica=k, token=token_of(k),
                                       total_elements=total, max_replicas=8, streams=wire)
            wire.listen("127.0.0.1",
                        exchange_hellos(lambda hello, sock, exchange=exchange: adopt(exchange, hello, sock)))
            exchange.learn(0, [sibling(j) for j in (members if known is None else known)])
            exchanges[k] = exchange
            opened.append((exchange, wire))
        return exchanges

    yield make
    for exchange, wire in opened:
        exchange.close()
        wire.close()


def adopt(exchange: ReplicaExchange, hello: Hello, sock: ssl.SSLSocket) -> None:
    """What an agent's registry does with a stream (nodeagent.hosting.HostedStages.adopt_stream)."""
    if (hello.job_id, hello.stage_index, hello.generation, hello.target) != ("j", 1, 1, exchange.replica):
        raise RpcFailure(grpc.StatusCode.NOT_FOUND, "no such replica here")
    exchange.offer(hello, sock)


def test_every_replica_ends_with_the_same_bits_the_ascending_sum_of_every_partial_step_after_step(
    monkeypatch: pytest.MonkeyPatch, replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    monkeypatch.setattr("arceus.swarm.exchange.MAX_SHARD_BYTES", 64)  # 16 floats a shard: several per chunk
    members, total = (1, 4, 6), 101
    exchanges = replicas_of(members, total)
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):  # the second step over the same streams
        # Values of very different magnitudes: floating-point addition in another order would give other bits.
        partials = {k: torch.randn(total, generator=generator) * 10.0 ** torch.randint(-6, 6, (total,))
                    for k in members}
        results, errors = exchange_together(exchanges, partials, peer_of=sibling, step=step)
        assert not errors, errors
        expected = partials[1].clone().add_(partials[4]).add_(partials[6])
        for k in members:
            assert torch.equal(results[k], expected), (step, k)
    assert all(e.bytes_sent > 0 for e in exchanges.values())


def test_a_sibling_whose_exchange_failed_on_its_side_alone_dials_anew_and_the_next_exchange_goes_through(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    exchanges = replicas_of((0, 1), 10)
    partials = {k: torch.full((10,), float(k + 1)) for k in (0, 1)}
    assert not exchange_together(exchanges, partials, peer_of=sibling, step=1)[1]
    exchanges[0]._close_streams()  # what a failure of replica 0's exchange alone does; replica 1 still holds its end
    results, errors = exchange_together(exchanges, partials, peer_of=sibling, step=2, seconds=10)
    assert not errors, errors
    assert all(torch.equal(results[k], torch.full((10,), 3.0)) for k in (0, 1))


def test_a_sibling_whose_step_names_an_exchange_address_is_dialled_there_not_at_the_port_it_answers(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    exchanges = replicas_of((0, 1), 10)
    partials = {k: torch.full((10,), float(k + 1)) for k in (0, 1)}
    with ShaperThread() as shaper:
        # A link of 0.3 s one way in front of replica 1's listener (what a shaped bench puts there).
        link = shaper.address(f"127.0.0.1:{port(exchanges[1])}", delay_s=0.3, rate_bps=1e9)

        def peer_of(k: int) -> stage_pb2.ReplicaPeer:
            named = sibling(k)
            if k == 1:
                named.exchange_address = link
                named.address = "127.0.0.1:1"  # nothing listens at its host's ports: only the link leads to it
            return named

        started = time.monotonic()
        results, errors = exchange_together(exchanges, partials, peer_of=peer_of, port_of=asked)
    assert not errors, errors
    assert all(torch.equal(results[k], torch.full((10,), 3.0)) for k in (0, 1))
    assert time.monotonic() - started >= 0.6  # the link's delay, both ways: the stream went through it


def asked(_sibling: int) -> int:
    """A port nothing listens at: a stream that went there would fail."""
    return 1


def test_an_audited_exchange_keeps_each_siblings_signed_shards_and_refuses_an_unsigned_one(
    monkeypatch: pytest.MonkeyPatch, replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    monkeypatch.setattr("arceus.swarm.exchange.MAX_SHARD_BYTES", 64)
    members, total = (1, 4), 40
    signers = {k: ReceiptSigner() for k in members}
    keys = {k: s.public_key_hex for k, s in signers.items()}
    partials = {k: torch.randn(total) for k in members}
    kept: dict[int, list[stage_pb2.ShardReceipt]] = {k: [] for k in members}
    exchanges = replicas_of(members, total)

    def audited(unsigned: int | None, step: int) -> dict[int, BaseException]:
        """Both replicas exchange on an audited step, `unsigned` sending its shards without signing them."""
        _, errors = exchange_together(
            exchanges, partials, peer_of=sibling, seconds=10, step=step,
            options=lambda k: {"sign": None if k == unsigned else signers[k].sign, "keys": keys, "kept": kept[k]},
        )
        return errors

    errors = audited(unsigned=None, step=1)
    assert not errors, errors
    # Replica 1 owns elements [0, 20), replica 4 [20, 40): each kept the other's shards of its chunk, each signed
    # by the sender over the values it summed.
    for k, other, (start, end) in ((1, 4, (0, 20)), (4, 1, (20, 40))):
        shards = sorted(kept[k], key=lambda s: s.start)
        assert [(s.source_replica, s.start, s.start + s.length) for s in shards] == [(other, start, 16 + start),
                                                                                    (other, 16 + start, end)]
        for s in shards:
            fields = ShardFields("j", 1, 1, 1, 0, other, s.start, s.length, s.sha256)
            verify_shard(keys[other], fields, s.signature)
            assert s.sha256 == tensor_digest(partials[other][s.start : s.start + s.length])
    # A sibling that sends its shards unsigned on an audited step fails the step at the replica that keeps them.
    errors = audited(unsigned=4, step=2)
    assert isinstance(errors.get(1), RpcFailure) and errors[1].code == grpc.StatusCode.PERMISSION_DENIED
    assert "replica 4's shard at element 0 of audited step 2 is not signed by it" in errors[1].message


def dial_raw(exchange: ReplicaExchange, identity: TlsIdentity, hello: Hello) -> ssl.SSLSocket:
    """A stream to `exchange`'s listener as a sibling's agent holding `identity` dials it."""
    return PeerStreams(identity).dial("127.0.0.1:1", "", port(exchange), IDENTITIES[exchange.replica].certificate,
                                      hello.pack(), time.monotonic() + 10, peer=f"replica {exchange.replica}")


def hello(source: int, *, epoch: int = 0, token: str | None = None, job: str = "j", target: int = 0) -> Hello:
    return Hello(job, 1, 1, target, source, epoch, token_of(source) if token is None else token)


def closed_by_listener(sock: ssl.SSLSocket, within: float = 10.0) -> bool:
    """Whether the other end closed `sock` (after whatever it sent) within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except (ssl.SSLError, OSError):
        pass
    return True


def test_a_stream_from_a_stranger_another_job_or_a_replica_that_is_not_what_it_claims_is_refused(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    """Anyone can reach the listener's port: a stranger's certificate fails the handshake, and a sibling's agent
    naming another job, an epoch that is over, or a token that is not the replica's it names is closed before its
    stream reaches the exchange."""
    receiver = replicas_of((0,), 10, known=(0, 2, 3))[0]
    with pytest.raises((RpcFailure, ssl.SSLError)):  # a certificate no step named: the handshake fails
        stranger = dial_raw(receiver, new_identity(), hello(2))  # (TLS 1.3: the dialer may learn it on its first read)
        stranger.settimeout(10)
        stranger.recv(1)
    for refused in (hello(2, job="other"), hello(2, token=token_of(3)), hello(0), hello(9, token=token_of(9))):
        assert closed_by_listener(dial_raw(receiver, IDENTITIES[2], refused)), refused
    receiver.learn(1, [sibling(0), sibling(3)])  # epoch 1: replica 2 left
    assert closed_by_listener(dial_raw(receiver, IDENTITIES[2], hello(2, epoch=0)))
    assert closed_by_listener(dial_raw(receiver, IDENTITIES[2], hello(2, epoch=1)))
    assert all(receiver._offers.kept(k) is None for k in range(8))


def test_a_sibling_that_waited_for_the_epoch_dials_at_once_and_its_stream_is_taken(
    monkeypatch: pytest.MonkeyPatch, replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    """ExchangePort answers a joiner's sibling once this replica knows the epoch, and the sibling dials at once: its
    certificate must already be trusted then, however long trusting it takes (a new agent's first step)."""
    receiver = replicas_of((2,), 8, known=(2,))[2]
    trust = receiver._wire.trust
    monkeypatch.setattr(receiver._wire, "trust", lambda certificates: (time.sleep(0.3), trust(certificates)))
    dialled: list[ssl.SSLSocket] = []

    def sibling_asks_then_dials() -> None:
        receiver.members.wait_for(1, wait=10, what="the test's ExchangePort")
        dialled.append(dial_raw(receiver, IDENTITIES[0], hello(0, epoch=1, target=2)))

    dialler = threading.Thread(target=sibling_asks_then_dials)
    dialler.start()
    receiver.learn(1, [sibling(0), sibling(2)])
    dialler.join(10)
    deadline = time.monotonic() + 5
    while receiver._offers.kept(0) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver._offers.kept(0) is not None, "the listener refused the stream of a sibling the epoch names"
    assert not closed_by_listener(dialled[0], within=0.3)


def test_a_stream_of_an_epoch_still_to_come_waits_for_it_and_is_then_judged_by_its_members(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    """A joiner's stream may come before this replica's RunStep names the epoch: it is kept, one per replica id, and
    the exchange takes it only as the member the epoch names (its token and its certificate)."""
    receiver = replicas_of((2,), 8, known=(0, 2))[2]
    forged = dial_raw(receiver, IDENTITIES[0], hello(0, epoch=1, token=token_of(5), target=2))  # kept for now
    time.sleep(0.3)
    receiver.learn(1, [sibling(0), sibling(2)])
    with pytest.raises(RpcFailure) as info:
        receiver.exchange(torch.zeros(8), step=1, epoch=1, members=(0, 2), peers={0: sibling(0)},
                          port_of=lambda _k: 0, deadline=time.monotonic() + 5, abort=threading.Event())
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "claiming replica 0" in info.value.message
    assert closed_by_listener(forged)


def test_streams_of_epochs_no_step_named_hold_one_slot_per_sibling_and_no_thread(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    """A holder of a sibling's certificate and token opening stream after stream of epochs that never come: each
    newer one replaces the one kept before (closed), so the replica keeps at most one per sibling id, and no call or
    thread waits for any of them."""
    receiver = replicas_of((2,), 8, known=(0, 2))[2]
    threads = threading.active_count()
    streams = [dial_raw(receiver, IDENTITIES[0], hello(0, epoch=epoch, target=2)) for epoch in range(1, 9)]
    deadline = time.monotonic() + 10
    while receiver._offers.kept(0) != ((8, digest_of(0)),) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [k for k in range(8) if receiver._offers.kept(k)] == [0] and receiver._offers.kept(0)[0][0] == 8
    assert all(closed_by_listener(stream) for stream in streams[:-1])
    assert threading.active_count() == threads


def test_a_frame_other_than_the_one_due_is_refused_before_its_payload_is_read(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    receiver = replicas_of((1,), 8, known=(0, 1))[1]
    sock = dial_raw(receiver, IDENTITIES[0], hello(0, target=1))
    # Replica 1 owns elements [4, 8): replica 0's REDUCE shard of them is due; this one claims 2**40 elements.
    sock.sendall(FRAME.pack(b"AXF1", 1, 0, REDUCE, 4, 2**40, 0))
    with pytest.raises(RpcFailure) as info:
        receiver.exchange(torch.zeros(8), step=1, epoch=0, members=(0, 1), peers={0: sibling(0)},
                          port_of=lambda _k: 0, deadline=time.monotonic() + 10, abort=threading.Event())
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "of 1099511627776 elements where its REDUCE shard of step 1 epoch 0 at element 4 of 4 elements was due" \
        in info.value.message
    assert closed_by_listener(sock)


def test_a_silent_sibling_fails_the_exchange_at_its_deadline_or_as_soon_as_the_step_is_aborted_and_a_dead_one_at_once(
    replicas_of: Callable[..., dict[int, ReplicaExchange]],
) -> None:
    receiver = replicas_of((1,), 8, known=(0, 1))[1]

    def exchange(abort: threading.Event, seconds: float) -> RpcFailure:
        with pytest.raises(RpcFailure) as info:
            receiver.exchange(torch.zeros(8), step=1, epoch=0, members=(0, 1), peers={0: sibling(0)},
                              port_of=lambda _k: 0, deadline=time.monotonic() + seconds, abort=abort)
        return info.value

    silent = dial_raw(receiver, IDENTITIES[0], hello(0, target=1))  # opens its stream, then sends nothing (SIGSTOP)
    failure = exchange(threading.Event(), 0.5)
    assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "replica 0 sent no REDUCE shard at element 4 of step 1" in failure.message
    assert closed_by_listener(silent)  # a failed exchange closes its streams: the next opens them anew
    silent = dial_raw(receiver, IDENTITIES[0], hello(0, target=1))
    abort = threading.Event()
    threading.Timer(0.3, abort.set).start()
    started = time.monotonic()
    assert exchange(abort, 60).code == grpc.StatusCode.CANCELLED
    assert time.monotonic() - started < 5  # not the minute its deadline allowed
    dead = dial_raw(receiver, IDENTITIES[0], hello(0, target=1))
    dead.close()  # (SIGKILL)
    started = time.monotonic()
    failure = exchange(threading.Event(), 60)
    assert failure.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5
