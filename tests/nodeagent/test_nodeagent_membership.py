"""A replica's membership epochs (nodeagent/membership.py) guard what other replicas send it.

An agent in this process hosts replica 0 of stage 1 of a 2-stage job; the driver, the replicas of stage 0 and a
sibling are clients with the credentials their assignments carry, over real gRPC. A replica of stage 0 taken off the
job (stopped, then woken with its epoch gone) still pushes the activation of a step it was routed: it is refused,
naming its stale epoch, and is never counted, parked or used, while the member's push of the same micro-batch makes
the step."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import REPLICA_METADATA_KEY, StageCredentials, token_digest
from arceus.swarm.routing import Routes
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import to_proto
from arceus.wire.tls import new_identity
from devtools.pipeline import driver_token, remember_identity, replica_credentials, replicated_pipeline_assignments
from nodeagent.agent import Agent
from nodeagent.call_limits import STREAMS_PER_CALLER
from nodeagent.membership import Membership
from nodeagent.replicas import epoch_waits
from nodeagent.rpc import RpcFailure
from nodeagent.stage import HostedStage

JOB, SAMPLES = "fenced", 4
MLP = {"type": "mlp", "layer_sizes": [64, 32, 10]}
ELSEWHERE = new_identity().certificate  # where the replicas not hosted here listen (never dialled)


def credentials(stage: int, replica: int) -> StageCredentials:
    return replica_credentials(JOB, stage, replica, num_stages=2)


def peer(stage: int, replica: int) -> stage_pb2.ReplicaPeer:
    return stage_pb2.ReplicaPeer(
        stage_index=stage, replica=replica, address=f"127.0.0.1:{9000 + 10 * stage + replica}",
        certificate=ELSEWHERE, token_digest=token_digest(credentials(stage, replica).replica_token),
    )


@pytest.fixture
def agent() -> Iterator[Agent]:
    """Replica 0 of stage 1 (the last), built from the assignment a replicated pipeline gives it."""
    started = Agent(device=torch.device("cpu"))
    started.start()
    remember_identity(started.advertise_address, started.identity)
    stages = replicated_pipeline_assignments(
        job_id=JOB, model_config=MLP, boundaries=[0, 1, 2], addresses=[["127.0.0.1:1"] * 2, ["127.0.0.1:1"] * 2],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2, max_micro_batch_size=SAMPLES,
    )
    started.apply_assignments([Assignment.from_json(stages[1][0])])
    try:
        yield started
    finally:
        started.stop(0)


def hosted(agent: Agent) -> HostedStage:
    (stage,) = agent.registry.stages()
    return stage


def channel(agent: Agent, token: str) -> grpc.Channel:
    return open_channel(agent.grpc_address, token=token, certificate=agent.identity.certificate)


def target() -> stage_pb2.StageRef:
    return stage_pb2.StageRef(job_id=JOB, stage_index=1, generation=1, replica=0)


def eval_step(step: int, epoch: int, members: tuple[tuple[int, ...], ...], of: tuple[tuple[int, ...], ...]
              ) -> stage_pb2.RunStepRequest:
    routes = Routes(members, of)
    peers = [peer(i, k) for i, ids in enumerate(members) for k in ids if (i, k) != (1, 0)]
    return stage_pb2.RunStepRequest(
        target=target(), step=step, mode=stage_pb2.EVAL, num_micro_batches=len(of), schedule="gpipe",
        batch_size=SAMPLES * len(of),
        replicas=stage_pb2.ReplicaStep(routes_json=json.dumps(routes.to_json()), epoch=epoch, peers=peers),
    )


def push(kind: int, step: int, micro_batch: int, tensor: torch.Tensor, epoch: int = 0) -> stage_pb2.PushTensorRequest:
    return stage_pb2.PushTensorRequest(target=target(), kind=kind, step=step, micro_batch=micro_batch,
                                       tensor=to_proto(tensor), epoch=epoch)


def learnt(stage: HostedStage, epoch: int) -> None:
    """Wait until a RunStep named `epoch` here."""
    give_up = time.monotonic() + 10
    while stage.exchange.members.newest < epoch:
        assert time.monotonic() < give_up, f"no RunStep of epoch {epoch} arrived"
        time.sleep(0.01)


def test_a_fenced_replicas_late_activation_is_refused_naming_its_epoch_and_never_counted_or_used(agent: Agent) -> None:
    stage = hosted(agent)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, SAMPLES, 32, generator=generator)
    y = torch.randint(0, 10, (2, SAMPLES), generator=generator)
    member, fenced = credentials(0, 0), credentials(0, 1)
    with (channel(agent, driver_token(JOB)) as driver_channel, channel(agent, member.token) as member_channel,
          channel(agent, fenced.token) as fenced_channel):
        driver = stage_pb2_grpc.StageServiceStub(driver_channel)
        as_member = stage_pb2_grpc.StageServiceStub(member_channel)
        as_fenced = stage_pb2_grpc.StageServiceStub(fenced_channel)
        own = {"member": ((REPLICA_METADATA_KEY, member.replica_token),),
               "fenced": ((REPLICA_METADATA_KEY, fenced.replica_token),)}
        # Epoch 0: both replicas of stage 0 are members, each routes one micro-batch here.
        step = driver.RunStep.future(eval_step(1, 0, ((0, 1), (0,)), ((0, 0), (1, 0))), timeout=30)
        for m in range(2):
            driver.PushTensor(push(stage_pb2.LABELS, 1, m, y[m]), timeout=10)
        as_member.PushTensor(push(stage_pb2.ACTIVATION, 1, 0, x[0]), timeout=10, metadata=own["member"])
        as_fenced.PushTensor(push(stage_pb2.ACTIVATION, 1, 1, x[1]), timeout=10, metadata=own["fenced"])
        assert list(step.result().sample_counts) == [SAMPLES, SAMPLES]

        # Epoch 1: replica 1 of stage 0 was taken off the job. Its late push of the micro-batch now routed to
        # replica 0 (zeros, so that its use would show) is refused, as a unary push and on a stream, naming its
        # stale epoch; claiming the new epoch, it is no member of it.
        step = driver.RunStep.future(eval_step(2, 1, ((0,), (0,)), ((0, 0),)), timeout=30)
        learnt(stage, 1)
        driver.PushTensor(push(stage_pb2.LABELS, 2, 0, y[0]), timeout=10)
        received = stage.bytes_received
        late = push(stage_pb2.ACTIVATION, 2, 0, torch.zeros(SAMPLES, 32))
        with pytest.raises(grpc.RpcError) as info:
            as_fenced.PushTensor(late, timeout=10, metadata=own["fenced"])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("the ACTIVATION of step 2 micro-batch 0 from stage 0 names membership epoch 0, which is over (epoch 1 "
                "is the newest here)") in info.value.details()
        [ack] = as_fenced.PushStream(iter([late]), timeout=10, metadata=own["fenced"])
        assert ack.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "epoch 0, which is over" in ack.message
        late.epoch = 1
        with pytest.raises(grpc.RpcError) as info:
            as_fenced.PushTensor(late, timeout=10, metadata=own["fenced"])
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:  # a member's bearer token without its replica token
            as_member.PushTensor(push(stage_pb2.ACTIVATION, 2, 0, x[0], epoch=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stage.bytes_received == received and stage.mailbox.arrived(2) == [("LABELS", 0)]
        assert not step.done()

        as_member.PushTensor(push(stage_pb2.ACTIVATION, 2, 0, x[0], epoch=1), timeout=10, metadata=own["member"])
        reply = step.result()
    expected, _ = stage.runtime.eval_loss(x[0], y[0])
    assert list(reply.sample_counts) == [SAMPLES] and reply.loss_sums[0] == pytest.approx(expected, rel=1e-6)


def test_an_epoch_no_step_named_waits_for_its_step_briefly_and_one_that_is_over_is_refused_at_once() -> None:
    members = Membership("replica 0", waiting_calls=8)
    digest = token_digest("t")
    members.learn(3, [stage_pb2.ReplicaPeer(stage_index=1, replica=2, token_digest=digest)])
    started = time.monotonic()
    with pytest.raises(RpcFailure) as info:
        members.check(2, 1, 2, digest, what="a shard", method="PushShard", wait=30.0)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "epoch 2, which is over" in info.value.message
    assert time.monotonic() - started < 0.5
    with pytest.raises(RpcFailure) as info:  # never named: refused once the wait (capped) is over
        members.check(5, 1, 2, digest, what="a shard", method="PushShard", wait=0.2)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 5, which no step named here within 0.2 s (newest: 3)" in info.value.message
    with pytest.raises(RpcFailure) as info:
        members.learn(2, [])
    assert "the step names membership epoch 2, which is over (epoch 3 is the newest here)" in info.value.message
    outcome: list[str] = []
    waiting = threading.Thread(target=lambda: outcome.append(_judged(members, 4, digest)))
    waiting.start()
    time.sleep(0.2)
    members.learn(4, [stage_pb2.ReplicaPeer(stage_index=1, replica=2, token_digest=digest)])
    waiting.join(5)
    assert outcome == ["accepted"]
    assert _judged(members, 4, token_digest("someone else")) == "PERMISSION_DENIED"


def test_a_sibling_asking_for_the_exchange_port_is_answered_once_a_step_of_its_epoch_arrived() -> None:
    """What ExchangePort waits for before it answers the dialling sibling: this replica then trusts its certificate
    (nodeagent.replicas.ReplicaExchange.learn), so the stream it opens next is not refused for want of it."""
    members = Membership("replica 1", waiting_calls=8)
    answered: list[float] = []
    what = "a request for the exchange port"
    waiting = threading.Thread(target=lambda: (members.wait_for(0, wait=30.0, what=what),
                                               answered.append(time.monotonic())))
    waiting.start()
    time.sleep(0.2)
    assert not answered  # its RunStep has not come
    members.learn(0, [stage_pb2.ReplicaPeer(stage_index=1, replica=0, token_digest=token_digest("t"))])
    waiting.join(5)
    assert answered
    members.wait_for(0, wait=0.0, what=what)  # known: at once
    with pytest.raises(RpcFailure) as info:
        members.wait_for(3, wait=0.1, what=what)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "a request for the exchange port names membership epoch 3, which no step named here within 0.1 s" in (
        info.value.message)


def _judged(members: Membership, epoch: int, sender: str) -> str:
    try:
        members.check(epoch, 1, 2, sender, what="a shard", method="PushShard", wait=30.0)
    except RpcFailure as exc:
        return exc.code.name
    return "accepted"


def test_once_a_repair_names_the_drivers_new_epoch_nothing_of_the_old_one_is_taken() -> None:
    """The driver asks a survivor what it holds of a step that lost replicas (Holdings) before its RunStep of the
    new epoch comes: from then on a late tensor of the old epoch is refused, so the survivor's report stays true."""
    members = Membership("replica 0", waiting_calls=8)
    digest = token_digest("t")
    members.learn(3, [stage_pb2.ReplicaPeer(stage_index=1, replica=2, token_digest=digest)])
    assert _judged(members, 3, digest) == "accepted"
    members.fence(4)
    with pytest.raises(RpcFailure) as info:
        members.check(3, 1, 2, digest, what="a shard", method="PushShard", wait=30.0)
    assert "names membership epoch 3, which is over (epoch 4 is the newest here)" in info.value.message
    with pytest.raises(RpcFailure):
        members.learn(3, [])
    outcome: list[str] = []
    waiting = threading.Thread(target=lambda: outcome.append(_judged(members, 4, digest)))  # the repair's epoch
    waiting.start()
    time.sleep(0.2)
    members.learn(4, [stage_pb2.ReplicaPeer(stage_index=1, replica=2, token_digest=digest)])
    waiting.join(5)
    assert outcome == ["accepted"]


def test_as_many_calls_may_wait_for_an_epoch_as_a_legitimate_membership_sends_ahead_of_a_replica() -> None:
    """Replicas of a stage are at most the job's micro_batches: with R of them, one push from each of R replicas of
    either neighbouring stage may come before this replica's RunStep names their epoch, and none is refused for it;
    each neighbouring stage is one caller, so the agent's bounds per caller cap it (and keep it within its threads).
    Siblings' exchange streams wait in no call (nodeagent.exchange_stream: one kept per sibling)."""
    for replicas in range(1, 65):
        assert epoch_waits(replicas) == 2 * min(replicas, STREAMS_PER_CALLER)
