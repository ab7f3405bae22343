"""A replica's side of a step (nodeagent/replicas.py): RunStep's routes checked against the replica, siblings'
shards checked before torch sees them, and the exchange run by several replicas at once (threads of this process,
each replica's shards delivered to the others' `accept` as PushShard would) ending with the same bits on every
replica: the sum in ascending replica id, across several shards per chunk."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from arceus.contracts.credentials import REPLICA_METADATA_KEY, replica_token, token_digest
from arceus.swarm.repair import ReplicaInstructions
from arceus.swarm.routing import Routes
from arceus.v1 import replica_pb2, stage_pb2
from arceus.verify.receipts import ReceiptSigner, ShardFields, verify_shard
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.incoming_push import IncomingPush, MalformedPush, parse_shard
from arceus.wire.proto_tensor import decode_tensor, from_proto, to_proto
from arceus.wire.tls import new_identity
from nodeagent import replicas
from nodeagent.replicas import ReplicaExchange, parse_replica_step
from nodeagent.rpc import RpcFailure

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


def exchange_of(replica: int, total: int = 10, members: tuple[int, ...] = (0, 2, 3)) -> ReplicaExchange:
    """Replica `replica` of stage 1, knowing the tokens of `members` as a RunStep names them."""
    exchange = ReplicaExchange(job_id="j", stage_index=1, generation=1, replica=replica, token=token_of(replica),
                               total_elements=total, max_replicas=4)
    exchange.members.learn(0, [peer(k) for k in members] + [peer(k, stage=2) for k in members])
    return exchange


def shard(**fields) -> IncomingPush[replica_pb2.PushShardRequest] | MalformedPush:
    """A PushShard's request as the sibling's ReplicaService parses its bytes."""
    values = {"step": 1, "epoch": 0, "source_replica": 2, "phase": replica_pb2.REDUCE, "start": 0,
              "tensor": to_proto(torch.zeros(4))}
    return parse_shard(replica_pb2.PushShardRequest(**{**values, **fields}).SerializeToString())


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (shard(source_replica=0), "another replica than 0"),
        (shard(phase=0), "phase must be REDUCE or GATHER"),
        (shard(tensor=to_proto(torch.zeros(2, 2))), "uncompressed float32 vector"),
        (shard(tensor=to_proto(torch.zeros(4, dtype=torch.int32))), "uncompressed float32 vector"),
        (shard(start=7), "elements [7, 11) are outside this stage's 10"),
        (shard(start=-1), "elements [-1, 3)"),
        (shard(step=-1), "step and epoch must be >= 0"),
    ],
)
def test_a_shard_that_does_not_fit_the_stage_is_refused_before_torch_sees_it(
    request_: IncomingPush[replica_pb2.PushShardRequest], words: str
) -> None:
    with pytest.raises(RpcFailure) as info:
        exchange_of(0).accept(request_, digest_of(request_.header.source_replica), wait=0.0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message


def test_a_shard_from_another_replica_than_it_claims_is_refused() -> None:
    receiver = exchange_of(0)
    for presented in (digest_of(3), digest_of(2, stage=2), None):  # a sibling, a neighbour's replica 2, no token
        with pytest.raises(RpcFailure) as info:
            receiver.accept(shard(source_replica=2), presented, wait=0.0)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, presented
        assert info.value.message == "the call's credential does not allow PushShard on the stage it addresses"
    receiver.accept(shard(source_replica=2), digest_of(2), wait=0.0)  # replica 2 itself


def test_a_shard_from_a_replica_that_is_not_a_member_of_its_epoch_or_of_an_epoch_that_is_over_is_refused_at_once(
) -> None:
    receiver = exchange_of(0, members=(0, 2, 3))
    receiver.members.learn(1, [peer(0), peer(3)])  # epoch 1: replica 2 left
    # A replica id no step named (with any token it may hold), and replica 2 in the epoch it is no longer a member
    # of (its own token still valid for the generation): refused at once, before anything is parked.
    for request_, presented in ((shard(source_replica=7, epoch=1), digest_of(7)),
                                (shard(source_replica=7, epoch=1), digest_of(3)),
                                (shard(source_replica=2, epoch=1), digest_of(2))):
        started = time.monotonic()
        with pytest.raises(RpcFailure) as info:
            receiver.accept(request_, presented, wait=5.0)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, request_
        assert time.monotonic() - started < 1.0
    # Epoch 0 is over: replica 2 was a member of it, but its late shard is refused, naming the epoch.
    with pytest.raises(RpcFailure) as info:
        receiver.accept(shard(source_replica=2, epoch=0), digest_of(2), wait=5.0)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "names membership epoch 0, which is over (epoch 1 is the newest here)" in info.value.message
    assert len(receiver.shards) == 0
    receiver.accept(shard(source_replica=3, epoch=1), digest_of(3), wait=0.0)
    assert len(receiver.shards) == 1


def test_a_shard_of_an_epoch_no_step_named_yet_waits_for_it_and_is_then_judged_by_its_members() -> None:
    receiver = exchange_of(0, members=(0, 2))
    with pytest.raises(RpcFailure) as info:  # no RunStep of epoch 1 comes: refused after the wait
        receiver.accept(shard(source_replica=2, epoch=1), digest_of(2), wait=0.2)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "epoch 1" in info.value.message
    outcomes: dict[int, str] = {}

    def push(source: int, presented: str) -> None:
        try:
            receiver.accept(shard(source_replica=source, epoch=1), presented, wait=10.0)
            outcomes[source] = "accepted"
        except RpcFailure as exc:
            outcomes[source] = exc.code.name

    # A joiner (replica 5) and a forger claiming replica 6 push before this replica's RunStep of epoch 1 names the
    # members (0, 2, 5): both wait; then the joiner's shard is taken and the forger's refused.
    pushes = [threading.Thread(target=push, args=(5, digest_of(5))),
              threading.Thread(target=push, args=(6, digest_of(2)))]
    for thread in pushes:
        thread.start()
    time.sleep(0.2)
    assert not outcomes
    receiver.members.learn(1, [peer(0), peer(2), peer(5)])
    for thread in pushes:
        thread.join(10)
    assert outcomes == {5: "accepted", 6: "PERMISSION_DENIED"}


def test_a_forger_among_the_siblings_cannot_fail_the_exchange_or_change_its_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica 9 held a valid replica token of this generation (it was a member once); while 1 and 4 exchange, it
    pushes shards claiming to be replica 4, and as itself, for every element: each is refused, and the exchange
    ends with the members' sum."""
    monkeypatch.setattr("arceus.swarm.exchange.MAX_SHARD_BYTES", 64)
    members, total = (1, 4), 48
    partials = {k: torch.full((total,), float(k)) for k in members}
    exchanges = {k: exchange_of(k, total, members) for k in members}
    refused: list[str] = []

    def forge() -> None:
        for start in range(0, total, 16):
            for source, presented in ((4, digest_of(9)), (9, digest_of(9))):
                request_ = shard(source_replica=source, start=start, tensor=to_proto(torch.full((16,), 1e6)))
                try:
                    exchanges[1].accept(request_, presented, wait=0.1)
                except RpcFailure as exc:
                    refused.append(exc.code.name)

    results, errors = exchange_together(exchanges, partials, beside=forge)
    assert not errors, errors
    assert len(refused) == 2 * 3 and set(refused) == {"PERMISSION_DENIED"}
    for k in members:
        assert torch.equal(results[k], torch.full((total,), 5.0)), k


def exchange_together(
    exchanges: dict[int, ReplicaExchange],
    partials: dict[int, torch.Tensor],
    *,
    options: Callable[[int], dict[str, Any]] = lambda _k: {},
    beside: Callable[[], None] | None = None,
    seconds: float = 30.0,
) -> tuple[dict[int, torch.Tensor], dict[int, BaseException]]:
    """Every replica of `exchanges` sums its partial with its siblings' at once (step 1, epoch 0), each in a thread of
    its own (`beside`, if given, started first in one more), its shards delivered straight to the sibling's exchange
    within `seconds`; `options(k)`: replica k's other arguments of ReplicaExchange.exchange. Their sums and their
    errors."""
    members = tuple(sorted(exchanges))
    results: dict[int, torch.Tensor] = {}
    errors: dict[int, BaseException] = {}

    def run(k: int) -> None:
        try:
            results[k] = exchanges[k].exchange(
                partials[k], step=1, epoch=0, members=members, link=lambda to: _Deliver(exchanges[to]),
                deadline=time.monotonic() + seconds, abort=threading.Event(), **options(k),
            )
        except BaseException as exc:
            errors[k] = exc

    threads = [] if beside is None else [threading.Thread(target=beside)]
    threads += [threading.Thread(target=run, args=(k,)) for k in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * seconds)
    return results, errors


class _Delivered:
    """A finished PushShard future: the shard is in the receiver's mailbox."""

    def result(self, timeout: float | None = None) -> None:
        return None


class _Deliver:
    """What a sibling's ReplicaService does with a PushShard's bytes: parses them, and its exchange accepts the
    shard."""

    def __init__(self, exchange: ReplicaExchange) -> None:
        self.exchange = exchange
        self.push_shard = self

    def future(self, request: bytes, timeout: float, metadata: tuple[tuple[str, str], ...]) -> _Delivered:
        (key, token), = metadata
        assert key == REPLICA_METADATA_KEY
        self.exchange.accept(parse_shard(request), token_digest(token), wait=0.0)
        return _Delivered()


def test_every_replica_ends_with_the_same_bits_the_ascending_sum_of_every_partial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replicas, "MAX_SHARD_BYTES", 64)  # (shard_bounds reads exchange's own)
    monkeypatch.setattr("arceus.swarm.exchange.MAX_SHARD_BYTES", 64)  # 16 floats a shard: several per chunk
    members, total = (1, 4, 6), 101
    generator = torch.Generator().manual_seed(0)
    # Values of very different magnitudes: floating-point addition in another order would give other bits.
    partials = {k: torch.randn(total, generator=generator) * 10.0 ** torch.randint(-6, 6, (total,)) for k in members}
    results, errors = exchange_together({k: exchange_of(k, total, members) for k in members}, partials)
    assert not errors, errors
    expected = partials[1].clone().add_(partials[4]).add_(partials[6])
    for k in members:
        assert torch.equal(results[k], expected), k


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


class _Silent:
    """A PushShard to a sibling that went silent (SIGSTOP): it never completes before its deadline."""

    def __init__(self) -> None:
        self.push_shard, self.cancelled = self, False

    def future(self, request: bytes, timeout: float, metadata: object) -> _Silent:
        return self

    def result(self, timeout: float | None = None) -> None:
        time.sleep(timeout or 0)
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_replica_pushing_to_a_silent_sibling_stops_as_soon_as_its_step_is_aborted() -> None:
    # One element: replica 0 owns it, has replica 2's part already, and pushes the sum back to 2, which never answers.
    silent, abort, receiver = _Silent(), threading.Event(), exchange_of(0, total=1, members=(0, 2))
    receiver.accept(shard(source_replica=2, tensor=to_proto(torch.ones(1))), digest_of(2), wait=0.0)
    threading.Timer(0.2, abort.set).start()
    started = time.monotonic()
    with pytest.raises(RpcFailure) as info:
        receiver.exchange(torch.zeros(1), step=1, epoch=0, members=(0, 2), link=lambda to: silent,
                          deadline=time.monotonic() + 60, abort=abort)
    assert info.value.code == grpc.StatusCode.CANCELLED and silent.cancelled
    assert time.monotonic() - started < 5  # not the minute its deadline allowed


def test_an_audited_exchange_keeps_each_siblings_signed_shards_and_refuses_an_unsigned_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("arceus.swarm.exchange.MAX_SHARD_BYTES", 64)
    members, total = (1, 4), 40
    signers = {k: ReceiptSigner() for k in members}
    keys = {k: s.public_key_hex for k, s in signers.items()}
    partials = {k: torch.randn(total) for k in members}
    kept: dict[int, list[stage_pb2.ShardReceipt]] = {k: [] for k in members}

    def audited(unsigned: int | None) -> dict[int, BaseException]:
        """Both replicas exchange on an audited step, `unsigned` pushing its shards without signing them."""
        _, errors = exchange_together(
            {k: exchange_of(k, total, members) for k in members}, partials, seconds=10,
            options=lambda k: {"sign": None if k == unsigned else signers[k].sign, "keys": keys, "kept": kept[k]},
        )
        return errors

    errors = audited(unsigned=None)
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
    # A sibling that pushes its shards unsigned on an audited step fails the step at the replica that keeps them.
    errors = audited(unsigned=4)
    assert isinstance(errors.get(1), RpcFailure) and errors[1].code == grpc.StatusCode.PERMISSION_DENIED
    assert "replica 4's shard at element 0 of audited step 1 is not signed by it" in errors[1].message


def test_a_shards_wire_bytes_parse_as_the_request_carrying_its_values() -> None:
    """The exchange sends a shard's values copied once into the request's bytes: any parser sees the message a
    PushShardRequest with that tensor would be (its values bit for bit, from a slice of a larger vector too)."""
    header = replica_pb2.PushShardRequest(
        target=stage_pb2.StageRef(job_id="j", stage_index=1, generation=2, replica=3), step=7, epoch=1,
        source_replica=4, phase=replica_pb2.GATHER, start=5,
    )
    values = torch.randn(300, generator=torch.Generator().manual_seed(0))[5:205]
    wire = replicas.shard_request_bytes(header, values)
    parsed = replica_pb2.PushShardRequest.FromString(wire)
    expected = replica_pb2.PushShardRequest()
    expected.CopyFrom(header)
    expected.tensor.CopyFrom(to_proto(values))
    assert parsed == expected
    assert torch.equal(from_proto(parsed.tensor), values)
    # As the receiver parses them: the header apart, the values a view of the received bytes.
    received = parse_shard(wire)
    assert isinstance(received, IncomingPush) and received.data.obj is wire
    expected.tensor.ClearField("data")
    assert received.header == expected
    assert torch.equal(decode_tensor(received.header.tensor, received.data, received.scales, received.indices,
                                     copy=False), values)


def test_bytes_that_are_no_shard_are_refused_as_invalid() -> None:
    with pytest.raises(RpcFailure) as info:
        exchange_of(0).accept(parse_shard(b"\x3a\x05\x1a\x09"), digest_of(2), wait=0.0)  # a tensor record cut short
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the message is not a PushShardRequest" in info.value.message
