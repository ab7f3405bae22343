"""Spot checks of replicated stages (arceus/training/audit.py over arceus/swarm) through real agents on loopback.

Six agents of six owners host an MLP in 3 stages: stage 0 and stage 1 with two replicas each, stage 2 with one
and a spare that joins it after the first step. Every train step is audited: every replica signs a receipt for
each micro-batch its route gave it, naming the replicas the activation went from and to, and one sampled
micro-batch's forward is recomputed, by a sibling of the producing replica where it has one. A replica that
perturbs its activations is caught and named (stage, replica id, node); a replica whose receipts name other
replicas than the routes is failed; and a join grant of an earlier membership epoch is refused. An exported model
with BatchNorm and dropout (buffers training updates, draws seeded per step and micro-batch) passes every check too.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load as safetensors_load

from arceus.contracts.assignment import Assignment, InitialWeightsRef, max_micro_batch_size
from arceus.contracts.credentials import REPLICA_METADATA_KEY, join_grant, replica_token, token_digest
from arceus.contracts.spot_check import VERIFICATION, SpotCheckResult
from arceus.data.config import validate_dataset_config
from arceus.model.exported.capture import capture
from arceus.model.exported.program import program_layers
from arceus.swarm.routing import Routes
from arceus.training import audit
from arceus.training.audit import sampled_partial
from arceus.training.driver import train
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.recording import RecordingSink
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2
from arceus.wire.channels import open_channel
from devtools.pipeline import (
    driver_token,
    replica_credentials,
    replica_endpoints,
)
from nodeagent import replicas, servicer, step_audit
from nodeagent.agent import Agent
from tests.arceus.training.replicated_agents import agents_hosting
from tests.nodeagent.dishonest_forward import make_dishonest, noise
from tests.nodeagent.test_nodeagent_replica_buffers import NormedNet

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}
BOUNDARIES = [0, 1, 2, 3]
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4
JOB = "audited-replicas"
# Which agent hosts each stage's replicas 0, 1, ...; stage 2's replica 1 (agent 5) is a spare that joins after step 1.
PLACEMENT = [[0, 1], [2, 3], [4, 5]]
SPARE = (2, 1)
# A cheat's runs: one replica of a stage is caught once a sampled micro-batch reaches it (at least 1 in 6 steps).
MAX_STEPS = 40


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    with agents_hosting(
        PLACEMENT, job_id=JOB, model_config=MODEL, boundaries=BOUNDARIES,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}, seed=3,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    ) as started:
        yield started


def endpoints(agents: list[Agent]) -> list[StageEndpoint]:
    """Every replica (the spare too), each on a node of its own owner with the agent's receipt key."""
    _, every = replica_endpoints([[agents[a].advertise_address for a in stage] for stage in PLACEMENT], BOUNDARIES)
    hosts = [a for stage in PLACEMENT for a in stage]
    return [replace(e, public_key=agents[a].signer.public_key_hex, owner_id=f"owner-{a}") for e, a in zip(every, hosts,
                                                                                                        strict=True)]


def plan_for(agents: list[Agent], sink: RecordingSink, **overrides: object) -> TrainPlan:
    every = endpoints(agents)
    replicas = tuple(e for e in every if (e.index, e.replica) != SPARE)
    spare = [e for e in every if (e.index, e.replica) == SPARE]
    plan = TrainPlan(
        job_id=JOB, generation=1, credential=driver_token(JOB, 1), stages=tuple(e for e in replicas if not e.replica),
        replicas=replicas, dataset=DATASET, epochs=1, learning_rate=0.05, micro_batches=MICRO_BATCHES, seed=3,
        rpc_timeout_seconds=20.0, max_steps=6, audit_rate=1.0, model=MODEL,
        replica_joins=lambda: spare if sink.steps else [],
    )
    return replace(plan, **overrides)


def node_of(agents: list[Agent], stage: int, replica: int) -> str:
    return f"agent-{stage}-{replica}"


class UntilCaught(RecordingSink):
    """Stops training at the first failed check: which replica a sampled micro-batch reaches depends on the
    replicas' measured speeds, so a cheat is caught within some steps, not at a given one."""

    def should_stop(self) -> bool:
        return any(not c.passed for p in self.steps for c in p.spot_checks)


def until_caught(agents: list[Agent]) -> tuple[list[SpotCheckResult], list[SpotCheckResult]]:
    """Train until a check fails (MAX_STEPS steps at most): the checks of forwards, and of partial gradients."""
    sink = UntilCaught()
    train(plan_for(agents, sink, max_steps=MAX_STEPS), sink)
    every = [c for p in sink.steps for c in p.spot_checks]
    return [c for c in every if c.producer_index is not None], [c for c in every if c.producer_index is None]


def caught(checks: list[SpotCheckResult], agents: list[Agent], stage: int, replica: int) -> list[SpotCheckResult]:
    """The failed checks, at least one, each naming the cheat (`stage`, `replica` and its node); all others passed."""
    failed = [c for c in checks if not c.passed]
    assert failed, [c.detail for c in checks]
    for c in failed:
        assert (c.stage_index, c.replica, c.node_id) == (stage, replica, node_of(agents, stage, replica)), c
    assert all(c.passed for c in checks if (c.stage_index, c.replica) != (stage, replica))
    return failed


@pytest.fixture
def seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auditor's samples from a seeded generator: the same steps and micro-batches every run."""
    monkeypatch.setattr(audit.random, "SystemRandom", lambda: random.Random(11))


def test_honest_replicas_pass_every_check_whose_receipts_name_the_replicas_of_each_route(
    agents: list[Agent], seeded: None
) -> None:
    sink = RecordingSink()
    train(plan_for(agents, sink), sink)
    every = [c for p in sink.steps for c in p.spot_checks]
    assert all(c.passed for c in every), [c.detail for c in every if not c.passed]
    checks = [c for c in every if c.producer_index is not None]  # forwards
    partials = [c for c in every if c.producer_index is None]
    assert len(checks) == 6 and len(partials) == 6  # each step: a forward and a partial gradient
    for c in partials:
        # A sibling replica recomputed the partial gradient with its own weights: fp32 rounding apart, the same.
        assert "partial gradient of micro-batches" in c.detail, c
        assert c.node_id == node_of(agents, c.stage_index, c.replica) and c.max_abs_diff <= 1e-6
        assert c.verifier_node_id == node_of(agents, c.stage_index, 1 - c.replica)
    # The last stage's replicas too, once the spare joined it (their partials start from the labels).
    assert {c.stage_index for c in partials} == {0, 1, 2}
    for c in checks:
        assert c.producer_index == c.stage_index in (0, 1) and c.replica == c.producer_replica
        assert c.node_id == node_of(agents, c.stage_index, c.replica)
        assert c.sent_sha256 == c.receipt_sha256 and c.max_abs_diff <= 1e-5
        # A sibling of the producing replica recomputes it: the replica on the other node of its stage.
        assert c.verifier_node_id == node_of(agents, c.stage_index, 1 - c.replica), c
    assert {c.replica for c in checks} == {0, 1}  # both replicas of a stage produced a checked micro-batch
    # The spare joined stage 2 after step 1 and took micro-batches from step 2 on, its receipts checked as its
    # sibling's are (a receipt that did not verify or cover its route would have failed a check).
    assert all(any(c.node_id == "agent-2-1" and c.micro_batches for c in p.stages) for p in sink.steps[1:])


def test_a_replica_that_perturbs_its_activations_is_caught_and_named(
    agents: list[Agent], seeded: None
) -> None:
    runtime = agents[PLACEMENT[1][1]].registry.stages()[0].runtime  # stage 1, replica 1
    make_dishonest(runtime, noise)
    forwards, _ = until_caught(agents)
    for c in caught(forwards, agents, 1, 1):
        assert "differs from the recomputation" in c.detail and "(stage 1 replica 1)" in c.detail
        assert c.verifier_node_id == node_of(agents, 1, 0)  # its sibling


def test_a_replica_that_computes_a_dishonest_partial_gradient_is_caught_by_a_sibling(
    agents: list[Agent], seeded: None
) -> None:
    """Stage 0's replica 1 adds noise to its partial gradient before the exchange (and signs it): every replica
    applies the poisoned sum alike, so only a recomputation catches it; its sibling's names it."""
    runtime = agents[PLACEMENT[0][1]].registry.stages()[0].runtime
    honest = runtime.gradient_vector
    runtime.gradient_vector = lambda: honest() + 1e-3  # (as make_dishonest does: no monkeypatch holding the runtime)
    forwards, partials = until_caught(agents)
    for c in caught(partials, agents, 0, 1):
        assert "partial gradient of micro-batches" in c.detail and "differs from the recomputation" in c.detail
        assert c.verifier_node_id == node_of(agents, 0, 0) and c.max_abs_diff >= 1e-3 * 0.99
    # The forwards it computed were honest: every forward check passed.
    assert all(c.passed for c in forwards)


def test_a_replica_that_pushes_other_shards_than_the_partial_it_signed_is_caught(
    agents: list[Agent], seeded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1's replica 0 signs its honest partial gradient but pushes its siblings a perturbed one: the shards
    they kept, under its signature, contradict what it signed for."""
    exchange = agents[PLACEMENT[1][0]].registry.stages()[0].exchange
    honest = exchange.exchange
    monkeypatch.setattr(exchange, "exchange", lambda flat, **kw: honest(flat + 1e-3, **kw))
    _, partials = until_caught(agents)
    for c in caught(partials, agents, 1, 0):
        # Replica 0 owns the first half of the stage's gradient and pushes the second, from element 264, to replica 1.
        assert "pushed replica 1 a gradient shard at element 264 other than the partial gradient it signed" in c.detail


def test_a_replica_that_sums_its_own_chunk_of_the_exchange_wrongly_is_caught(
    agents: list[Agent], seeded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1's replica 0 owns the first chunk of the stage's exchange and adds to the sum it sends back: every
    replica applies the same poisoned chunk, whose signed digest its siblings' signed partials do not add up to."""
    cheat = agents[PLACEMENT[1][0]].registry.stages()[0].exchange
    honest_sum = replicas.reduce_in_order

    def dishonest_sum(*args: Any, **kwargs: Any) -> torch.Tensor:
        total = honest_sum(*args, **kwargs)
        if inspect.currentframe().f_back.f_locals.get("self") is cheat:
            total += 1e-3  # in place: the exchange reads the sum from the `out` it passed
        return total

    monkeypatch.setattr(replicas, "reduce_in_order", dishonest_sum)
    _, partials = until_caught(agents)
    for c in caught(partials, agents, 1, 0):
        assert "summed chunk 0 (elements [0, 264)) of the exchange other than its members' signed partial" in c.detail


def test_a_verifier_that_lies_is_overruled_by_another_owners_node_and_named_not_the_producer(
    agents: list[Agent], seeded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1's replica 0 recomputes the forwards it verifies dishonestly (adds 1e-2), so its sibling's honest output
    would fail on its word alone. A verdict that fails anyone needs a second verifier of another owner: that one's
    recomputation agrees with the output, so the liar fails (a check of kind "verification") and the producer
    passes."""
    liar = agents[PLACEMENT[1][0]].registry
    honest = servicer.recompute_forward

    def lying(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = honest(*args, **kwargs)
        return out + 1e-2 if inspect.currentframe().f_back.f_locals["self"]._registry is liar else out

    monkeypatch.setattr(servicer, "recompute_forward", lying)
    sink = UntilCaught()
    train(plan_for(agents, sink, max_steps=MAX_STEPS), sink)
    every = [c for p in sink.steps for c in p.spot_checks]
    failed = [c for c in every if not c.passed]
    assert failed, [c.detail for c in every]
    for c in failed:
        assert (c.kind, c.stage_index, c.replica, c.node_id) == (VERIFICATION, 1, 0, node_of(agents, 1, 0)), c
        assert "as the verifier of step" in c.detail and "(stage 1 replica 1)'s forward" in c.detail, c.detail
        assert c.max_abs_diff >= 1e-2 * 0.99
        # The forward it lied about passed, on the word of the other owner's node that recomputed it too.
        [forward] = [f for f in every if (f.step, f.micro_batch, f.producer_index) == (c.step, c.micro_batch, 1)]
        assert forward.passed and (forward.replica, forward.node_id) == (1, node_of(agents, 1, 1)), forward
        assert forward.verifier_node_id == c.verifier_node_id not in (node_of(agents, 1, 0), node_of(agents, 1, 1))
    assert all(c.passed for c in every if c.kind != VERIFICATION)


def test_a_sibling_that_lies_as_a_verifier_is_overruled_by_another_and_named_not_the_checked_replica(
    seeded: None
) -> None:
    """One stage of 3 replicas on three owners' agents, every step audited. Replica 1 recomputes its siblings' partial
    gradients dishonestly (adds 1e-3): a verdict that fails a replica needs a second sibling of another owner, whose
    recomputation agrees with the checked partial, so the liar fails (kind "verification"), the checked replica
    passes."""
    placement = [[0, 1, 2]]
    with agents_hosting(
        placement, job_id=JOB, model_config=MODEL, boundaries=[0, 3],
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}, seed=3,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    ) as started:
        _, every = replica_endpoints([[started[a].advertise_address for a in placement[0]]], [0, 3])
        every = tuple(replace(e, public_key=started[e.replica].signer.public_key_hex, owner_id=f"owner-{e.replica}")
                      for e in every)
        runtime = started[1].registry.stages()[0].runtime
        honest = runtime.recompute_partial
        runtime.recompute_partial = lambda *args, **kwargs: honest(*args, **kwargs) + 1e-3  # on the instance
        sink = UntilCaught()
        train(TrainPlan(
            job_id=JOB, generation=1, credential=driver_token(JOB, 1), stages=every[:1], replicas=every,
            dataset=DATASET, epochs=1, learning_rate=0.05, micro_batches=MICRO_BATCHES, seed=3,
            rpc_timeout_seconds=20.0, max_steps=MAX_STEPS, audit_rate=1.0, model=MODEL,
        ), sink)
    checks = [c for p in sink.steps for c in p.spot_checks]
    failed = [c for c in checks if not c.passed]
    assert failed, [c.detail for c in checks]
    for c in failed:
        assert (c.kind, c.stage_index, c.replica, c.node_id) == (VERIFICATION, 0, 1, "agent-0-1"), c
        assert "as the verifier of step" in c.detail and "'s partial gradient" in c.detail, c.detail
        assert c.max_abs_diff >= 1e-3 * 0.99
        # The partial it lied about passed, on the word of the third replica, which recomputed it too.
        [partial] = [p for p in checks if p.step == c.step and p.kind != VERIFICATION]
        assert partial.passed and partial.replica not in (1, c.replica) and partial.max_abs_diff <= 1e-6, partial
        assert partial.verifier_node_id == c.verifier_node_id == f"agent-0-{3 - partial.replica - 1}"
        assert "confirmed by" not in partial.detail  # one recomputation for it, one against: the output's side
    assert all(c.passed for c in checks if c.kind != VERIFICATION)


def test_every_replica_of_a_replicated_stage_is_as_likely_to_have_its_partial_checked() -> None:
    """A replica puts its whole partial into the sum whatever its share: one that takes 1 of 4 micro-batches (slow, or
    posing as slow) is sampled as often as its sibling that takes 3, and in a step with two replicated stages every
    replica of either (a stage of one replica exchanges nothing)."""
    routes = Routes(members=((0, 1), (0,), (0, 1, 2)), of=((0, 0, 0), (0, 0, 1), (1, 0, 2), (0, 0, 0)))
    rng = random.Random(5)
    draws = Counter(sampled_partial(routes, rng) for _ in range(10_000))
    by_replica: Counter[tuple[int, int]] = Counter()
    for (i, k, _), n in draws.items():
        by_replica[(i, k)] += n
    assert set(by_replica) == {(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)}
    for n in by_replica.values():
        assert abs(n / 10_000 - 1 / 5) < 0.02, by_replica
    # The micro-batch named is one the sampled replica took.
    assert all(routes.of[m][i] == k for i, k, m in draws)
    with pytest.raises(ValueError, match="no stage of the step is replicated"):
        sampled_partial(Routes.single(2, 4), rng)


def test_a_replica_whose_receipts_name_another_producer_than_its_route_fails(
    agents: list[Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stage 2's replica 0 signs every received activation as if stage 1's replica 0 had produced it.
    honest_receipt = step_audit.StepAudit._receipt

    def misnamed(self: step_audit.StepAudit, m: int, x: torch.Tensor, receiver: int, role: str, producer: int,
                 receiver_replica: int) -> stage_pb2.Receipt:
        if receiver == 2 and role == "received":
            producer = 0
        return honest_receipt(self, m, x, receiver, role, producer, receiver_replica)

    monkeypatch.setattr(step_audit.StepAudit, "_receipt", misnamed)
    sink = RecordingSink()
    train(plan_for(agents, sink, max_steps=1, audit_rate=0.0001), sink)
    checks = [c for p in sink.steps for c in p.spot_checks]
    assert checks and not any(c.passed for c in checks)
    assert {(c.stage_index, c.replica, c.node_id) for c in checks} == {(2, 0, node_of(agents, 2, 0))}
    assert all("names replicas 0 -> 0; its route went 1 -> 0" in c.detail for c in checks), checks[0].detail


def test_a_join_grant_of_an_earlier_membership_epoch_is_refused(agents: list[Agent]) -> None:
    sink = RecordingSink()
    train(plan_for(agents, sink, max_steps=2, audit_rate=0.0), sink)  # the spare joins: the roster's epoch is 1
    source = agents[PLACEMENT[2][0]]
    target = stage_pb2.StageRef(job_id=JOB, stage_index=2, generation=1, replica=0)
    joiner = replica_credentials(JOB, 2, 7, 3)  # a replica the driver never added
    source_token = replica_token(driver_token(JOB, 1), 2, 0)

    def snapshot(epoch: int) -> int:
        grant = join_grant(source_token, token_digest(joiner.replica_token), epoch)
        with open_channel(source.advertise_address, token=joiner.token, certificate=source.identity.certificate) as ch:
            chunks = replica_pb2_grpc.ReplicaServiceStub(ch).Snapshot(
                replica_pb2.SnapshotRequest(target=target, grant=grant, epoch=epoch), timeout=30,
                metadata=((REPLICA_METADATA_KEY, joiner.replica_token),),
            )
            return sum(len(chunk.data) for chunk in chunks)

    # A grant made while the roster was at epoch 0 (before the spare joined) is spent: refused, learning nothing.
    with pytest.raises(grpc.RpcError) as info:
        snapshot(0)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "the call's credential does not allow Snapshot on the stage it addresses"
    assert snapshot(1) > 0  # the driver's grant at the current epoch is honoured


def test_replicas_of_a_model_with_batchnorm_and_dropout_pass_every_partial_gradient_check(seeded: None) -> None:
    """An exported model (a captured module: BatchNorm, whose running statistics a step moves, and dropout) in one
    stage of 2 replicas on two owners' agents, every step audited: each sampled replica's partial vector (its
    gradients, buffer changes and micro-batch count, as many elements as the driver counts from the spec) is
    recomputed by its sibling from the buffers as the step found them and with the step's masks, and matches. (One
    stage: a forward check of an exported model recomputes on a node that may not hold its program; the partials of
    a stage that is not the last are checked in tests/nodeagent/test_nodeagent_replica_buffers.py.)"""
    torch.manual_seed(0)
    captured = capture(NormedNet(), torch.randn(8, 64))
    documents = program_layers(captured.program, [layer["sha256"] for layer in captured.model_config["layers"]])
    weights = safetensors_load(captured.weights)
    boundaries, placement = [0, len(documents)], [[0, 1]]

    def stage_weights(_ref: InitialWeightsRef, start: int, end: int, _bound: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in weights.items() if start <= int(k.split(".")[1]) < end}

    def from_upload(assignment: Assignment) -> Assignment:
        layers = assignment.layer_end - assignment.layer_start
        return replace(assignment, program="/program",
                       initial_weights=InitialWeightsRef(url="/weights", layer_sha256=("0" * 64,) * layers))

    with agents_hosting(
        placement, agent={"load_program": lambda _p, a, b: documents[a:b], "load_initial_weights": stage_weights},
        adapt=from_upload, job_id=JOB, model_config=captured.model_config, boundaries=boundaries,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}, seed=3,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    ) as started:
        _, every = replica_endpoints([[started[a].advertise_address for a in stage] for stage in placement],
                                     boundaries)
        every = tuple(replace(e, public_key=started[e.replica].signer.public_key_hex, owner_id=f"owner-{e.replica}")
                      for e in every)
        sink = RecordingSink()
        train(TrainPlan(
            job_id=JOB, generation=1, credential=driver_token(JOB, 1), stages=tuple(e for e in every if not e.replica),
            replicas=every, dataset=DATASET, epochs=1, learning_rate=0.05, micro_batches=MICRO_BATCHES, seed=3,
            rpc_timeout_seconds=20.0, max_steps=6, audit_rate=1.0, model=captured.model_config,
        ), sink)
    partials = [c for p in sink.steps for c in p.spot_checks if c.producer_index is None]
    assert len(sink.steps) == 6 and len(partials) == 6
    assert all(c.passed for p in sink.steps for c in p.spot_checks), [
        c.detail for p in sink.steps for c in p.spot_checks if not c.passed
    ]
    assert all("partial gradient of micro-batches" in c.detail and c.max_abs_diff <= 1e-5 for c in partials)
