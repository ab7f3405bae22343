"""Spot checks through real agents on loopback: receipts verify, honest forwards pass, a stage that
perturbs its activations is caught, receipts that do not verify blame the stage that signed them, and
a receiver whose account differs from its producer's is caught instead of framing the producer."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.contracts.transfer import transfer_config_from_json
from arceus.data.config import validate_dataset_config
from arceus.training.audit import Auditor
from arceus.training.driver import train
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from arceus.training.stage_client import StageClient
from arceus.v1 import stage_pb2
from arceus.verify.receipts import RECEIVED, SENT, ReceiptError, ReceiptFields, ReceiptSigner, verify_receipt
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity
from devtools.reference import fetch_weights
from nodeagent import step
from nodeagent.agent import Agent
from nodeagent.rpc import RpcFailure
from nodeagent.servicer import StageServicer
from nodeagent.stage import HostedStage
from tests.nodeagent.dishonest_forward import make_dishonest, noise

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[list[Agent]]:
    """Three stages; an indirect parameter may set the job's `transfer` and `precision` (default fp32)."""
    options = getattr(request, "param", {})
    started = [Agent(device=torch.device("cpu")) for _ in range(3)]
    for agent in started:
        agent.start()
        remember_identity(agent.advertise_address, agent.identity)
    stages = pipeline_assignments(
        job_id="audited",
        model_config=MODEL,
        boundaries=BOUNDARIES,
        addresses=[a.advertise_address for a in started],
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
        seed=3,
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
        transfer=options.get("transfer"),
        precision=options.get("precision", "fp32"),
    )
    for agent, stage in zip(started, stages, strict=True):
        agent.apply_assignments([Assignment.from_json(stage)])
    try:
        yield started
    finally:
        for agent in started:
            agent.stop(1)


def plan_for(agents: list[Agent], **overrides: object) -> TrainPlan:
    plan = TrainPlan(
        job_id="audited",
        generation=1, credential=driver_token("audited", 1),
        stages=tuple(
            StageEndpoint(i, a.advertise_address, f"node-{i}", BOUNDARIES[i], BOUNDARIES[i + 1],
                          public_key=a.signer.public_key_hex, certificate=identity_for(a.advertise_address).certificate)
            for i, a in enumerate(agents)
        ),
        dataset=DATASET,
        epochs=1,
        learning_rate=0.05,
        micro_batches=MICRO_BATCHES,
        seed=3,
        rpc_timeout_seconds=20.0,
        max_steps=6,
        audit_rate=1.0,
        model=MODEL,
    )
    return replace(plan, **overrides)


def spot_checks(plan: TrainPlan) -> list:
    sink = RecordingSink()
    train(plan, sink)
    return [c for p in sink.steps for c in p.spot_checks]


def test_honest_stages_pass_every_spot_check(agents: list[Agent]) -> None:
    checks = spot_checks(plan_for(agents))
    assert len(checks) == 6 and all(c.passed for c in checks), [c.detail for c in checks if not c.passed]
    assert {c.stage_index for c in checks} <= {0, 1}  # producers: the last stage sends no activations
    for c in checks:
        assert c.verifier_node_id != c.node_id and len(bytes.fromhex(c.receipt_signature)) == 64
        assert c.max_abs_diff <= 1e-5


@pytest.mark.parametrize(
    "agents",
    [
        {"transfer": {"activations": "int8", "gradients": "int8"}},
        {"transfer": {"activations": "bf16"}},
        {"precision": "bf16"},
    ],
    indirect=True,
)
def test_honest_stages_pass_through_lossy_transfers_and_a_cheat_is_still_caught(
    agents: list[Agent], request: pytest.FixtureRequest
) -> None:
    # The receiver holds the rounded activation: the check rounds the recomputation the same way; with bf16
    # compute the verifier recomputes under bf16 autocast too.
    options = request.node.callspec.params["agents"]
    transfer = transfer_config_from_json(options.get("transfer"))
    precision = options.get("precision", "fp32")
    checks = spot_checks(plan_for(agents, transfer=transfer, precision=precision))
    assert len(checks) == 6 and all(c.passed for c in checks), [c.detail for c in checks if not c.passed]
    for agent in agents[:2]:
        runtime = agent.registry.stages()[0].runtime
        make_dishonest(runtime, lambda out, _key: out + 0.05)
    checks = spot_checks(plan_for(agents, transfer=transfer, precision=precision))
    assert checks and not any(c.passed for c in checks)


def test_a_stage_that_perturbs_its_activations_fails_its_spot_checks(
    agents: list[Agent]
) -> None:
    # Both producers cheat, so whichever the driver samples is caught.
    for agent in agents[:2]:
        runtime = agent.registry.stages()[0].runtime
        make_dishonest(runtime, noise)
    checks = spot_checks(plan_for(agents))
    assert len(checks) == 6 and not any(c.passed for c in checks)
    for c in checks:
        assert c.node_id == f"node-{c.stage_index}" and "differs from the recomputation" in c.detail
        assert c.max_abs_diff > 1e-3


def test_receipts_that_do_not_verify_fail_the_stage_that_signed_them(agents: list[Agent]) -> None:
    plan = plan_for(agents)
    impostor = replace(plan.stages[2], public_key=ReceiptSigner().public_key_hex)
    checks = spot_checks(replace(plan, stages=(*plan.stages[:2], impostor), audit_rate=0.0001))
    assert checks and all(not c.passed and c.stage_index == 2 for c in checks)
    assert "does not verify against the node's public key" in checks[0].detail


def test_a_receiver_that_signs_for_a_tampered_activation_is_caught_not_its_producer(
    agents: list[Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stage 1 claims (signs for, keeps and trains on) activations other than those stage 0 sent.
    honest_receive = step._receive

    def lying_receive(stage: HostedStage, step: int, kind: int, *args: object) -> torch.Tensor:
        x = honest_receive(stage, step, kind, *args)
        return x + 0.05 if kind == stage_pb2.ACTIVATION and stage.assignment.stage_index == 1 else x

    monkeypatch.setattr(step, "_receive", lying_receive)
    checks = spot_checks(plan_for(agents, audit_rate=0.0001))  # the disagreement alone triggers a recomputation
    assert len(checks) == 6 and not any(c.passed for c in checks)
    for c in checks:
        assert (c.node_id, c.stage_index, c.producer_index) == ("node-1", 1, 0), c.detail
        assert "signed for an activation other than the one stage 0 sent" in c.detail
        assert c.sent_sha256 != c.receipt_sha256 and len(bytes.fromhex(c.sent_signature)) == 64


def test_a_stage_that_refuses_its_audit_fails_the_check(agents: list[Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    """Answering an audit with an error (rather than being out of reach) is no way out of being checked."""

    def refuse(self: StageServicer, request: stage_pb2.AuditRequest, *args: object) -> None:
        raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "not telling")

    monkeypatch.setattr(StageServicer, "_audit_record", refuse)
    checks = spot_checks(plan_for(agents))
    assert len(checks) == 6 and not any(c.passed for c in checks)
    for c in checks:
        assert c.node_id == f"node-{c.stage_index}" and c.stage_index in (0, 1), c
        assert c.detail.endswith("FAILED_PRECONDITION: not telling") and "refused its audit" in c.detail


def test_every_producer_signs_what_it_sent_and_the_digests_agree(agents: list[Agent]) -> None:
    checks = spot_checks(plan_for(agents))
    assert all(c.passed for c in checks)
    for c in checks:
        assert c.sent_sha256 == c.receipt_sha256 and c.producer_index == c.stage_index
        fields = ReceiptFields("audited", c.stage_index + 1, 1, c.step, c.micro_batch, bytes.fromhex(c.sent_sha256),
                               SENT)
        verify_receipt(agents[c.stage_index].signer.public_key_hex, fields, bytes.fromhex(c.sent_signature))
        with pytest.raises(ReceiptError):  # a "sent" signature is no receiver's receipt
            verify_receipt(agents[c.stage_index].signer.public_key_hex, replace(fields, role=RECEIVED),
                           bytes.fromhex(c.sent_signature))


class LiveWeights(RecordingSink):
    """Records the first stage's weights as they are right after each step (the driver's audit done)."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.agent, self.seen = agent, []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.seen.append(self.agent.registry.stages()[0].runtime.named_weights())


def test_a_retained_steps_optimizer_step_waits_and_training_ends_as_without_audits(agents: list[Agent]) -> None:
    """An audit reads the weights a retained step's forwards used in place, not a copy: the step's optimizer
    step waits for the stage's next call. The run ends on the same weights as one without audits."""
    audited = LiveWeights(agents[0])
    train(plan_for(agents, max_steps=4), audited)
    assert len(audited.steps) == 4 and all(c.passed for p in audited.steps for c in p.spot_checks)
    audited_weights = fetch_weights(plan_for(agents))
    for agent in agents:  # the same job again from its seeded weights, without audits
        # Only the assignment is kept: a reference to the hosted stage would hold it past its drop, which then
        # waits out its grace (10 s on each agent) before the stage is built again.
        assignment = agent.registry.stages()[0].assignment
        agent.apply_assignments([])
        agent.apply_assignments([assignment])
    plain = LiveWeights(agents[0])
    train(plan_for(agents, max_steps=4, audit_rate=0.0), plain)
    # After audited step k the weights are still those of plain step k - 1: the optimizer step waited.
    for k in range(1, 4):
        assert all(torch.equal(audited.seen[k][n], plain.seen[k - 1][n]) for n in plain.seen[k]), k
        assert not any(torch.equal(audited.seen[k][n], plain.seen[k][n]) for n in plain.seen[k]), k
    plain_weights = fetch_weights(plan_for(agents))
    assert sorted(audited_weights) == sorted(plain_weights)
    for name, tensor in plain_weights.items():
        assert torch.equal(audited_weights[name], tensor), name


def test_the_verifier_is_never_of_the_producers_owner() -> None:
    """No contributor checks its own work: with nodes of one owner only, nothing is recomputed."""
    addresses = [f"127.0.0.1:{port}" for port in (1, 2, 3)]

    def auditor(owners: list[str]) -> tuple[Auditor, list[StageClient]]:
        stages = tuple(
            StageEndpoint(i, a, f"node-{i}", i, i + 1, certificate=identity_for(a).certificate, owner_id=owner)
            for i, (a, owner) in enumerate(zip(addresses, owners, strict=True))
        )
        plan = TrainPlan(job_id="j", generation=1, credential=driver_token("j"), stages=stages,
                         dataset=DATASET, epochs=1, learning_rate=0.1, micro_batches=1, seed=0)
        clients = [StageClient(s, job_id="j", generation=1, credential=plan.credential, timeout=1) for s in stages]
        return Auditor(plan, rng=random.Random(0)), clients

    mixed, clients = auditor(["alice", "alice", "bob"])
    first, second, third = (c.endpoint for c in clients)
    for _ in range(20):
        assert mixed._verifier(first, second, clients).endpoint.node_id == "node-2"
        # the receiver, rather than alice's
        assert mixed._verifier(second, third, clients).endpoint.node_id == "node-2"
        assert mixed._verifier(third, first, clients).endpoint.node_id in ("node-0", "node-1")
    lone, clients = auditor(["alice"] * 3)
    assert lone._verifier(*(c.endpoint for c in clients[:2]), clients) is None
