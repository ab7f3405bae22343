"""Strangers against real agent processes: every gRPC method, called by everyone who is not the caller it is for,
is refused with UNAUTHENTICATED or PERMISSION_DENIED and a message that is the same whatever was addressed; the
job trains on meanwhile and ends where an undisturbed run does.

Agent 0 hosts stage 0 of job "victim" and stage 1 of job "other"; agent 1 hosts their other stages.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.contracts.certificates import AGENT_TLS_NAME
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from arceus.v1 import (
    link_probe_pb2,
    link_probe_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
    tensor_parallel_pb2,
    tensor_parallel_pb2_grpc,
)
from arceus.wire.channels import open_channel, pinned_channel_credentials
from arceus.wire.proto_tensor import to_proto
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, rank_credentials, stage_endpoints
from devtools.reference import fetch_weights, reference_run
from nodeagent.callers import NOT_AUTHENTICATED

pytestmark = pytest.mark.slow

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 10]}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
MICRO_BATCHES, SEED, STEPS = 2, 5, 12
OTHER_MODEL = {"type": "mlp", "layer_sizes": [64, 16, 10]}
VICTIM, OTHER = "victim", "other"
# What a caller may do: the victim's next stage sends its previous one gradients.
ALLOWED = {("the victim's neighbour stage, overreaching", "PushStream (gradient)")}


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[AgentProcess]]:
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    common = {"optimizer": OPTIMIZER, "seed": SEED, "micro_batches": MICRO_BATCHES,
              "max_micro_batch_size": max_micro_batch_size(DATASET, MICRO_BATCHES)}
    victim = pipeline_assignments(job_id=VICTIM, model_config=MODEL, boundaries=[0, 1, 2], addresses=addresses,
                                  **common)
    other = pipeline_assignments(job_id=OTHER, model_config=OTHER_MODEL, boundaries=[0, 1, 2],
                                 addresses=addresses[::-1], **common)
    placed = [[victim[0], other[1]], [victim[1], other[0]]]
    started = spawn_static_agents(placed, addresses, tmp_path_factory.mktemp("strangers"))
    try:
        yield started
    finally:
        assert stop_agents(started) == [0, 0]
    for agent in started:  # every refusal is an expected outcome: logged, never a crash
        assert "Traceback" not in agent.log_text()


def channel_as(agent: AgentProcess, token: str | None) -> grpc.Channel:
    """A TLS channel to the agent (its certificate is public: the control plane hands it to callers), with a
    token or none."""
    if token is not None:
        return open_channel(agent.grpc_address, token=token, certificate=agent.certificate)
    credentials = pinned_channel_credentials(agent.certificate)
    return grpc.secure_channel(agent.grpc_address, credentials, options=[("grpc.ssl_target_name_override",
                                                                          AGENT_TLS_NAME)])


# Who calls, with which token; `known_on` lists the agents that host a stage accepting the token (there it is
# PERMISSION_DENIED; elsewhere, UNAUTHENTICATED).
CALLERS: dict[str, tuple[Callable[[], str | None], tuple[int, ...]]] = {
    "a stranger without a token": (lambda: None, ()),
    "a stranger with a made-up token": (lambda: secrets.token_hex(32), ()),
    "another job's driver (another tenant)": (lambda: driver_token(OTHER), (0, 1)),
    "a node of another job (its stage 1, on agent 0)": (lambda: rank_credentials(OTHER, 1, 1, 0, [1, 1]).token, (1,)),
    "the victim's driver of a past generation": (lambda: driver_token(VICTIM, 0), ()),
    "the victim's neighbour stage, overreaching": (lambda: rank_credentials(VICTIM, 1, 1, 0, [1, 1]).token, (0,)),
}


def ref(stage: int) -> stage_pb2.StageRef:
    return stage_pb2.StageRef(job_id=VICTIM, stage_index=stage, generation=1)


def every_method(channel: grpc.Channel, stage: int) -> dict[str, Callable[[], Any]]:
    """Each method of each service the agent serves, called on the victim's stage `stage` with a plausible
    request (what that stage's driver or neighbour would send)."""
    stub = stage_pb2_grpc.StageServiceStub(channel)
    target = ref(stage)
    width = MODEL["layer_sizes"][stage]
    push = stage_pb2.PushTensorRequest(target=target, kind=stage_pb2.ACTIVATION, step=1, micro_batch=0,
                                       tensor=to_proto(torch.zeros(2, width)))
    gradient = stage_pb2.PushTensorRequest(target=target, kind=stage_pb2.GRADIENT, step=1, micro_batch=0,
                                           tensor=to_proto(torch.zeros(2, 32)))
    audit = stage_pb2.AuditRequest(target=target, step=1, micro_batch=0)
    verify = stage_pb2.VerifyForwardRequest(model_config_json=json.dumps(MODEL), layer_start=stage,
                                            layer_end=stage + 1, input=to_proto(torch.zeros(1, width)))
    partial = tensor_parallel_pb2.PushPartialRequest(target=target, step=1, micro_batch=0, op=0, source_rank=1,
                                                     tensor=to_proto(torch.zeros(1, 1, 1)))
    return {
        "PushTensor": lambda: stub.PushTensor(push, timeout=10),
        "PushStream (activation)": lambda: _first_ack(stub.PushStream(iter([push]), timeout=10)),
        "PushStream (gradient)": lambda: _first_ack(stub.PushStream(iter([gradient]), timeout=10)),
        "RunStep": lambda: stub.RunStep(stage_pb2.RunStepRequest(
            target=target, step=1, mode=stage_pb2.TRAIN, num_micro_batches=1, schedule="gpipe", batch_size=2,
            learning_rate=100.0), timeout=10),
        "GetState": lambda: list(stub.GetState(stage_pb2.GetStateRequest(target=target), timeout=10)),
        "SaveState": lambda: stub.SaveState(stage_pb2.SaveStateRequest(target=target, upload_path="/x"), timeout=10),
        "Infer": lambda: stub.Infer(stage_pb2.InferRequest(target=target, session="s", start=0,
                                                           input=to_proto(torch.zeros(1, width))), timeout=10),
        "Audit": lambda: stub.Audit(audit, timeout=10),
        "AuditWeights": lambda: list(stub.AuditWeights(audit, timeout=10)),
        "VerifyForward": lambda: stub.VerifyForward(iter([verify]), timeout=10),
        "AuditPartial": lambda: list(stub.AuditPartial(audit, timeout=10)),
        "VerifyPartial": lambda: list(stub.VerifyPartial(iter([
            stage_pb2.VerifyPartialRequest(target=target, step=1, batch_size=2),
            stage_pb2.VerifyPartialRequest(input=to_proto(torch.zeros(1, width)),
                                           gradient=to_proto(torch.zeros(1, 32))),
        ]), timeout=10)),
        "PushPartial": lambda: tensor_parallel_pb2_grpc.TensorParallelServiceStub(channel).PushPartial(
            partial, timeout=10),
        "ExchangePort": lambda: replica_pb2_grpc.ReplicaServiceStub(channel).ExchangePort(
            replica_pb2.ExchangePortRequest(target=target), timeout=10),
        "Snapshot": lambda: list(replica_pb2_grpc.ReplicaServiceStub(channel).Snapshot(
            replica_pb2.SnapshotRequest(target=target), timeout=10)),
        "CopyState": lambda: replica_pb2_grpc.ReplicaServiceStub(channel).CopyState(replica_pb2.CopyStateRequest(
            target=target, source=stage_pb2.ReplicaPeer(stage_index=stage, replica=1, address="127.0.0.1:1")),
            timeout=10),
    }


def _first_ack(acks: Iterator[stage_pb2.PushAck]) -> None:
    """A push stream answers a refused message with an error ack: raise it as the call's status."""
    ack = next(acks)
    if ack.code:
        raise _Refused(grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == ack.code)), ack.message)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except (grpc.RpcError, _Refused) as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call was answered")


def assert_every_method_refused(agents: list[AgentProcess]) -> int:
    refused = 0
    for caller, (token_of, known_on) in CALLERS.items():
        for index, agent in enumerate(agents):
            with channel_as(agent, token_of()) as channel:
                for method, call in every_method(channel, stage=index).items():
                    if (caller, method) in ALLOWED and index in known_on:
                        continue
                    code, details = refusal(call)
                    if index in known_on:
                        assert code == grpc.StatusCode.PERMISSION_DENIED, (caller, index, method, code, details)
                        assert details in (
                            f"the call's credential does not allow {method.split(' ')[0]} on the stage it addresses",
                            "VerifyForward recomputes only the model of the job whose driver calls it",
                        ), (caller, method, details)
                    else:
                        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED), (
                            caller, index, method, code, details)
                    assert VICTIM not in details and "generation" not in details, details  # learns nothing
                    refused += 1
                probe = link_probe_pb2_grpc.LinkProbeServiceStub(channel).Probe
                if index in known_on:  # a principal of a job hosted there may time its link: filler bytes only
                    assert probe(link_probe_pb2.ProbeRequest(reply_bytes=4), timeout=10).payload == bytes(4)
                else:
                    assert refusal(lambda p=probe: p(link_probe_pb2.ProbeRequest(), timeout=10)) == (
                        grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)
                    refused += 1
    return refused


def test_strangers_are_refused_every_method_while_the_job_trains_as_if_undisturbed(
    agents: list[AgentProcess],
) -> None:
    plan = TrainPlan(
        job_id=VICTIM, generation=1, credential=driver_token(VICTIM, 1),
        stages=stage_endpoints([a.grpc_address for a in agents], [0, 1, 2]), dataset=DATASET, epochs=1,
        learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=SEED, rpc_timeout_seconds=30.0,
        max_steps=STEPS,
    )
    attacks: list[int] = []
    failures: list[BaseException] = []

    def attack() -> None:
        try:
            attacks.append(assert_every_method_refused(agents))
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    attacker = threading.Thread(target=attack)
    attacker.start()
    result = train(plan, RecordingSink())
    attacker.join(timeout=120)
    if failures:
        raise failures[0]
    # Every method on both agents, bar the probes of callers known there and the neighbour's gradient.
    assert attacks and attacks[0] == len(CALLERS) * 2 * 17 - 4 - len(ALLOWED)

    expected = reference_run(
        {"model_config": MODEL, "dataset_config": DATASET, "epochs": 1, "learning_rate": OPTIMIZER["lr"],
         "optimizer": "sgd", "momentum": OPTIMIZER["momentum"], "weight_decay": 0.0, "seed": SEED},
        max_steps=STEPS,
    )
    assert result.steps == STEPS
    weights = fetch_weights(plan)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
