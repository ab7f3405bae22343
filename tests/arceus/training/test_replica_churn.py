"""Losing a replica costs no rewind: real agent processes, one SIGKILLed while the job trains.

Seven `python -m nodeagent` processes host an MLP in 3 stages x 2 replicas and a spare. During step 4 (the kill
lands a few milliseconds after step 3 ends, in whatever phase the step is then) the agent of stage 1's replica 1
is SIGKILLed. The driver finds it gone, the survivors repair the step (only the lost replica's micro-batches are
recomputed, by its sibling; tests/arceus/training/test_replica_repair.py checks that part closely), and training goes
on: the step counter never goes back, no checkpoint is loaded, losses
and final weights equal one process on the same batches, and the surviving replicas of each stage hold the same
bits after every step. After step 5 a spare agent joins stage 1 as replica 2: it copies the state from a live
replica (peer to peer, not from checkpoint storage, with the driver's grant for it) and takes micro-batches from
step 6 on; a sibling without that grant is refused the state. A second job that
loses both replicas of its last stage fails as an unreplicated pipeline does (the control plane then rewinds it
to its checkpoint). A third job's joiner stays alive but its gradient exchange fails (its agent's fault hook), twice
in one step and once in another: nothing rewinds either.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.contracts.credentials import REPLICA_METADATA_KEY, join_grant, replica_token, token_digest
from arceus.data.config import validate_dataset_config
from arceus.training.driver import DriverError, train
from arceus.training.plan import ReplicaFence, ReplicaJoin, StageEndpoint, StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from arceus.training.stage_client import StageClient
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2
from arceus.wire.channels import open_channel
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, replica_credentials, replica_endpoints, replicated_pipeline_assignments
from devtools.reference import ReferenceRun, fetch_weights, reference_run

pytestmark = pytest.mark.slow

MLP = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
MICRO_BATCHES, SEED, STEPS, KILLED_AFTER, JOINS_AFTER = 4, 7, 8, 3, 5
AGENTS = 8
# job -> which agents host each stage's replicas 0, 1, ...; the churn job's stage 1 replica 2 (agent 6) is a spare
# that joins after step JOINS_AFTER, as is the live-fault job's (agent 7).
JOBS = {"churn": [[0, 1], [2, 3, 6], [4, 5]], "dead-stage": [[0, 1], [2], [4, 5]],
        "live-fault": [[0, 1], [2, 3, 7], [4, 5]]}
SPARE = (1, 2)
# The live-fault job's joiner fails its exchange (alive, answering) in its first step twice, so the driver's retry of
# it fails too, and once two steps later (nodeagent.faults).
FAULTY, FAILS = 7, (JOINS_AFTER + 1, JOINS_AFTER + 1, JOINS_AFTER + 3)
# (Its test runs first: the others kill agents every job uses.)


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AgentProcess], dict[str, Any]]]:
    ports = [f"127.0.0.1:{port}" for port in free_ports(AGENTS)]
    per_agent: list[list[dict[str, Any]]] = [[] for _ in range(AGENTS)]
    addresses = {}
    for job_id, placement in JOBS.items():
        addresses[job_id] = [[ports[a] for a in stage] for stage in placement]
        stages = replicated_pipeline_assignments(
            job_id=job_id, model_config=MLP, boundaries=[0, 1, 2, 3], addresses=addresses[job_id], optimizer=SGD,
            seed=SEED, micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DIGITS, MICRO_BATCHES),
        )
        for stage, hosts in zip(stages, placement, strict=True):
            for assignment, agent in zip(stage, hosts, strict=True):
                per_agent[agent].append(assignment)
    started = spawn_static_agents(per_agent, ports, tmp_path_factory.mktemp("churn-agents"), ready_timeout=240.0,
                                  faults={FAULTY: ",".join(f"fail:exchange:{step}:{SPARE[0]}:{SPARE[1]}"
                                                           for step in FAILS)})
    try:
        yield started, addresses
    finally:
        stop_agents(started)


def plan_of(job_id: str, addresses: dict[str, Any], sink_steps: list[StepProgress] | None = None) -> TrainPlan:
    """The job's plan without the spare, which `replica_joins` offers once `sink_steps` holds JOINS_AFTER steps."""
    stages, replicas = replica_endpoints(addresses[job_id], [0, 1, 2, 3])
    spare = [e for e in replicas if (e.index, e.replica) == SPARE]

    def joins() -> list[StageEndpoint]:
        return spare if sink_steps is not None and len(sink_steps) >= JOINS_AFTER else []

    return TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1), stages=stages,
        replicas=tuple(e for e in replicas if (e.index, e.replica) != SPARE), dataset=DIGITS, epochs=1,
        learning_rate=SGD["lr"], micro_batches=MICRO_BATCHES, seed=SEED, rpc_timeout_seconds=30.0, max_steps=STEPS,
        replica_joins=joins,
    )


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    """One process on the jobs' global batches."""
    return reference_run(
        {"model_config": MLP, "dataset_config": DIGITS, "epochs": 1, "learning_rate": SGD["lr"], "optimizer": "sgd",
         "momentum": SGD["momentum"], "weight_decay": SGD["weight_decay"], "seed": SEED},
        max_steps=STEPS,
    )


class KillingSink(RecordingSink):
    """After step `after` ends, SIGKILLs `victims` a few milliseconds later (mid next step); after every step,
    records the state digest of every replica still alive (and taking part: not the spare before it joins, nor a
    (replica, step) in `away`)."""

    def __init__(self, victims: dict[tuple[int, int], AgentProcess], after: int,
                 away: set[tuple[tuple[int, int], int]] | None = None) -> None:
        super().__init__()
        self.victims, self.after, self.away = victims, after, away or set()
        self.clients: dict[tuple[int, int], StageClient] = {}

    def watch(self, plan: TrainPlan, endpoints: list[StageEndpoint]) -> None:
        """Record the digests of these replicas of `plan`'s job after every step."""
        self.clients = {
            (e.index, e.replica): StageClient(e, job_id=plan.job_id, generation=1, credential=plan.credential,
                                              timeout=30.0)
            for e in endpoints
        }
        self.digests: list[dict[tuple[int, int], str]] = []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        with tempfile.TemporaryDirectory() as directory:
            self.digests.append({
                key: client.save_state(Path(directory) / "state")[0]
                for key, client in self.clients.items()
                if (key not in self.victims or p.step <= self.after) and (key != SPARE or p.step > JOINS_AFTER)
                and (key, p.step) not in self.away
            })
        if p.step == self.after:
            pids = [agent.process.pid for agent in self.victims.values()]
            threading.Timer(0.005, lambda: [os.kill(pid, signal.SIGKILL) for pid in pids]).start()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def assert_one_process(plan: TrainPlan, sink: KillingSink, expected: ReferenceRun) -> None:
    """The run never went back, loaded no checkpoint, and ended with one process's losses and weights; the replicas
    of each stage held the same bits after every step."""
    assert [p.step for p in sink.steps] == list(range(1, STEPS + 1))  # never went back
    assert list(sink.checkpoints) == [STEPS]  # only the one saved at the end: none was loaded
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: loss {got!r} != reference {want!r}"
    weights = fetch_weights(plan)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for step, digests in enumerate(sink.digests, 1):
        for stage in (0, 1, 2):
            alive = {digest for (index, _), digest in digests.items() if index == stage}
            assert len(alive) == 1, f"step {step} stage {stage}: {alive}"


def test_an_exchange_failing_between_live_replicas_costs_no_work_and_the_fenced_joiner_joins_again(
    agents: tuple[list[AgentProcess], dict[str, Any]], reference: ReferenceRun,
) -> None:
    """The joiner's exchange fails in its first step (FAILS), its agent alive: the driver resumes the step under a new
    membership epoch, that fails too, so it fences the newest member (the joiner) and its siblings repair the step
    without it (recomputing its micro-batches only); the joiner copies the state anew and joins again for the next
    step, and its one failure two steps later costs only a retry. Nothing rewinds."""
    started, addresses = agents
    fenced_in = FAILS[0]
    sink = KillingSink({}, 0, away={(SPARE, fenced_in)})
    joins: list[ReplicaJoin] = []
    fences: list[ReplicaFence] = []
    plan = replace(plan_of("live-fault", addresses, sink.steps), replica_joined=joins.append,
                   replica_fenced=fences.append)
    sink.watch(plan, replica_endpoints(addresses["live-fault"], [0, 1, 2, 3])[1])
    try:
        result = train(plan, sink)
    finally:
        sink.close()
    assert result.steps == STEPS
    assert_one_process(plan, sink, reference)
    assert started[FAULTY].process.poll() is None  # alive all along
    fired = re.findall(r"TEST HOOK FIRES: failing step (\d+)", started[FAULTY].log_path.read_text())
    assert tuple(map(int, fired)) == FAILS
    # It joined for step 6, was fenced in it (taking no micro-batch of it in the end), and joined again for step 7,
    # each time with the state its peer had.
    took_part = ["agent-1-2" in {c.node_id for c in p.stages} for p in sink.steps]
    assert took_part == [False] * fenced_in + [True] * (STEPS - fenced_in)
    assert [(j.index, j.replica, j.source_replica) for j in joins] == [(*SPARE, 0)] * 2
    assert fences == [ReplicaFence(*SPARE, fenced_in + 1, fenced_in)]  # the control plane is told: when, until when
    assert all(j.sha256 == j.state_sha256 for j in joins)
    # The stages without the joiner did an undisturbed run's work: each micro-batch of every step once.
    for stage in (0, 2):
        assert sum(c.micro_batches for c in sink.steps[-1].stages if c.index == stage) == STEPS * MICRO_BATCHES


def test_a_replica_killed_mid_run_costs_no_rewind_and_training_ends_where_one_process_does(
    agents: tuple[list[AgentProcess], dict[str, Any]], reference: ReferenceRun,
) -> None:
    started, addresses = agents
    sink = KillingSink({(1, 1): started[3]}, KILLED_AFTER)
    joins: list[ReplicaJoin] = []
    plan = replace(plan_of("churn", addresses, sink.steps), replica_joined=joins.append)
    sink.watch(plan, replica_endpoints(addresses["churn"], [0, 1, 2, 3])[1])
    try:
        result = train(plan, sink)
    finally:
        sink.close()
    assert started[3].process.wait(10) == -signal.SIGKILL
    assert result.steps == STEPS
    assert_one_process(plan, sink, reference)
    # After the loss the killed replica took no more work; the spare joined after step JOINS_AFTER with the state
    # its peer had (its digest equals its sibling's from the first step it took) and took micro-batches every step.
    assert all("agent-1-1" not in {c.node_id for c in p.stages} for p in sink.steps[KILLED_AFTER:])
    assert all("agent-1-2" not in {c.node_id for c in p.stages} for p in sink.steps[:JOINS_AFTER])
    taken = [next(c.micro_batches for c in p.stages if c.node_id == "agent-1-2") for p in sink.steps[JOINS_AFTER:]]
    assert taken[0] > 0 and all(b > a for a, b in zip(taken, taken[1:], strict=False)), taken
    assert all(SPARE in digests for digests in sink.digests[JOINS_AFTER:])
    # what the driver was told of the join: the whole stage's state (weights and momentum) from its live peer, and
    # the joiner then held exactly what it copied
    [join] = joins
    weights = sum(t.numel() * t.element_size() for name, t in reference.weights.items() if name.startswith("layers.1."))
    assert (join.index, join.replica, join.source_replica) == (*SPARE, 0) and join.size_bytes >= 2 * weights
    assert join.sha256 == join.state_sha256 and len(join.sha256) == 64


def test_a_stage_that_loses_every_replica_fails_the_step_as_an_unreplicated_pipeline_does(
    agents: tuple[list[AgentProcess], dict[str, Any]],
) -> None:
    started, addresses = agents
    plan = plan_of("dead-stage", addresses)
    sink = KillingSink({(2, 0): started[4], (2, 1): started[5]}, 2)
    sink.watch(plan, list(plan.replicas))
    try:
        with pytest.raises(DriverError, match="stage 2 lost every replica") as info:
            train(plan, sink)
    finally:
        sink.close()
    assert info.value.stage_index == 2
    assert [p.step for p in sink.steps] == [1, 2]


def test_only_the_joiner_the_driver_named_may_copy_a_replicas_state(
    agents: tuple[list[AgentProcess], dict[str, Any]],
) -> None:
    started, _ = agents
    source = replica_pb2.SnapshotRequest(target=stage_pb2.StageRef(job_id="dead-stage", stage_index=0, generation=1))
    sibling = replica_credentials("dead-stage", 0, 1, 3)
    source_token = replica_token(driver_token("dead-stage"), 0, 0)
    forged = join_grant(secrets.token_hex(32), token_digest(sibling.replica_token), 0)
    other = join_grant(source_token, token_digest(replica_token(driver_token("dead-stage"), 0, 5)), 0)

    def snapshot(grant: str, replica_token_: str | None) -> list[stage_pb2.StateChunk]:
        metadata = () if replica_token_ is None else ((REPLICA_METADATA_KEY, replica_token_),)
        with open_channel(started[0].grpc_address, token=sibling.token, certificate=started[0].certificate) as channel:
            request = replica_pb2.SnapshotRequest(target=source.target, grant=grant)
            return list(replica_pb2_grpc.ReplicaServiceStub(channel).Snapshot(request, timeout=30, metadata=metadata))

    # A sibling of the stage (its bearer token and its own replica token) not named as a joiner, one presenting
    # a grant made with another key, or one for another joiner: refused, learning nothing of the state.
    for grant, token in (("", sibling.replica_token), (forged, sibling.replica_token), (other, sibling.replica_token),
                         (join_grant(source_token, token_digest(sibling.replica_token), 0), None)):
        with pytest.raises(grpc.RpcError) as info:
            snapshot(grant, token)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == "the call's credential does not allow Snapshot on the stage it addresses"
    # The joiner the driver named (its grant for this sibling's replica token) is answered.
    named = snapshot(join_grant(source_token, token_digest(sibling.replica_token), 0), sibling.replica_token)
    assert sum(len(chunk.data) for chunk in named) > 0
