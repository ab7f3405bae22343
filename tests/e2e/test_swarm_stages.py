"""Replicated stages over REST (arceus/swarm, issue 29): a job of 3 stages x 2 replicas on real agents loses one
replica of its middle stage to SIGKILL mid-run and goes on without a rewind; a spare node joins as the new replica by
copying its state from the live one, and the job ends with the losses of one process on the same global batch."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from devtools.cluster import LocalCluster
from devtools.reference import reference_run

pytestmark = pytest.mark.slow

JOB: dict[str, Any] = {
    "name": "swarm-digits",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "seed": 3,
    "stages": 3,
    "replicas": 2,
    "checkpoint_interval_steps": 10,
    "node_grace_seconds": 2.0,  # the lost replica leaves the placement soon, so the spare joins well before the end
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
KILL_AT_STEP = 12


def replicas(detail: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """(stage index, replica id) -> its placement row."""
    return {(p["stage_index"], p["replica"]): p for p in detail["placements"]}


# Long enough after the kill for the spare to join, whatever the machine's load: the lost node's detection
# (node_grace_seconds), a reconcile pass, the spare's build and ready report take seconds; two epochs ended within
# them once the driver stopped waiting on the killed agent's refused connection. Not much longer: replicas sum their
# partial gradients in another order than one process does, and the rounding compounds (a run of five epochs left
# the 1e-5 tolerance at step 216 of 225, where the loss is smallest).
LONG_JOB = {**JOB, "epochs": 4}


def test_a_killed_replica_costs_no_rewind_and_a_spare_joins_from_its_peer(cluster: LocalCluster) -> None:
    reference = reference_run(LONG_JOB)
    agents = cluster.start_agents([f"swarm-{i}" for i in range(7)])
    job = cluster.client.submit_job(LONG_JOB)
    cluster.client.start_job(job["id"])
    before = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= KILL_AT_STEP, 120)
    placed = replicas(before)
    assert sorted(placed) == [(i, r) for i in range(3) for r in range(2)]
    assert len({p["node_id"] for p in placed.values()}) == 6
    spare = next(a for a in agents if a.node_id not in {p["node_id"] for p in placed.values()})
    victim = next(a for a in agents if a.node_id == placed[(1, 0)]["node_id"])  # the stage's lowest: it served it
    cluster.crash(victim.child.name)

    steps, generations = [before["step"]], {before["generation"]}
    joined: dict[str, Any] | None = None
    deadline = time.monotonic() + 120
    while (detail := cluster.client.job(job["id"]))["status"] == "running" and time.monotonic() < deadline:
        steps.append(detail["step"])
        generations.add(detail["generation"])
        if joined is None and any(p["node_id"] == spare.node_id and p["micro_batches"] > 0
                                  for p in detail["placements"]):
            joined = detail
        time.sleep(0.1)
    final = cluster.client.wait(job["id"], timeout=120)
    assert final["status"] == "succeeded", (final["error"], final["conditions"])

    # no rewind: the step never went back, one generation throughout, nothing loaded from a checkpoint
    assert steps == sorted(steps), steps
    assert generations == {before["generation"]}, generations  # (its end then bumps it, as any job's does)
    assert final["resumed_from_step"] is None and final["restarts"] == 0
    # the spare took the lost replica's place in the middle stage (a fresh replica id) and processed micro-batches
    assert joined is not None, "the spare never took micro-batches"
    now = replicas(final)
    assert (1, 0) not in now and now[(1, 1)]["node_id"] == placed[(1, 1)]["node_id"]
    [(key, row)] = [(k, p) for k, p in now.items() if p["node_id"] == spare.node_id]
    assert key[0] == 1 and key[1] >= 2 and row["micro_batches"] > 0
    assert {k: p["node_id"] for k, p in now.items() if k[0] != 1} == {
        k: p["node_id"] for k, p in placed.items() if k[0] != 1
    }
    # what one process computes on the same global batches
    assert final["step"] == len(reference.losses)
    curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
    for step, want in enumerate(reference.losses, start=1):
        assert math.isclose(curve[step], want, rel_tol=1e-5, abs_tol=1e-5), (step, curve[step], want)
    assert math.isclose(final["val_loss"], reference.val_loss, rel_tol=1e-5, abs_tol=1e-5)


def test_a_stage_that_loses_every_replica_rewinds_to_its_checkpoint(cluster: LocalCluster) -> None:
    reference = reference_run(JOB)
    agents = cluster.start_agents([f"swarm-{i}" for i in range(7)])
    job = cluster.client.submit_job(JOB)
    cluster.client.start_job(job["id"])
    before = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= KILL_AT_STEP, 120)
    placed = replicas(before)
    spare = next(a for a in agents if a.node_id not in {p["node_id"] for p in placed.values()})
    for replica in (0, 1):
        cluster.crash(next(a for a in agents if a.node_id == placed[(1, replica)]["node_id"]).child.name)
    final = cluster.client.wait(job["id"], timeout=180)
    assert final["status"] == "succeeded", (final["error"], final["conditions"])
    # the last checkpoint before the kills (every 10 steps; the kills land a few steps after `before`)
    assert final["resumed_from_step"] in (10, 20) and final["generation"] > before["generation"] + 1
    # the stage kept one row, moved to the spare; the other stages kept their replicas
    now = replicas(final)
    assert [p["node_id"] for k, p in now.items() if k[0] == 1] == [spare.node_id]
    assert {k: p["node_id"] for k, p in now.items() if k[0] != 1} == {
        k: p["node_id"] for k, p in placed.items() if k[0] != 1
    }
    curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
    for step, want in enumerate(reference.losses, start=1):
        assert math.isclose(curve[step], want, rel_tol=1e-5, abs_tol=1e-5), (step, curve[step], want)
