"""The training worker drives many jobs in one process, each driver a thread of it (controlplane/common/worker_pool.py):
jobs driven side by side train exactly as one process would, and cancelling one of them meanwhile stops it alone."""

from __future__ import annotations

import math
from typing import Any

import pytest

from devtools.cluster import LocalCluster
from devtools.reference import reference_run
from tests.e2e.conftest import connect

pytestmark = pytest.mark.slow

JOB: dict[str, Any] = {
    "model_config": {"layer_sizes": [64, 32, 10]},
    "dataset_config": {"name": "digits", "batch_size": 64, "val_batch_size": 360},
    "epochs": 3,  # 23 steps an epoch
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 2,
    "stages": 2,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
SEEDS = (1, 2)  # the jobs trained to the end; the cancelled one is seeded 3 and would run far longer


def test_jobs_driven_by_threads_of_one_worker_train_as_one_process_and_a_cancel_stops_only_its_job(
    cluster: LocalCluster,
) -> None:
    cluster.start_agents([f"node-{i}" for i in range(2 * (len(SEEDS) + 1))])
    # The job to cancel starts first: the others are at their first steps when all three run.
    cancelled = _started(cluster, {**JOB, "name": "cancelled", "seed": 3, "epochs": 100})
    jobs = [_started(cluster, {**JOB, "name": f"side-by-side-{seed}", "seed": seed}) for seed in SEEDS]
    for job_id in [*jobs, cancelled]:
        cluster.wait_for_job(job_id, lambda d: d["status"] == "running" and d["step"] >= 3, 180)

    # Every driver is a thread of the training worker's one process: the lease owner names its pid.
    (worker,) = cluster.process_ids("worker-training")
    with connect(str(cluster.database_url).rsplit("/", 1)[1]) as db:
        owners = dict(db.execute("SELECT id::text, driver_lease_owner FROM jobs_job WHERE id::text = ANY(%s)",
                                 [[*jobs, cancelled]]).fetchall())
    assert {owner.split(":")[1] for owner in owners.values()} == {str(worker)}, owners
    assert len(set(owners.values())) == 3  # three drivers, each with its own lease

    cluster.client.cancel_job(cancelled)
    assert all(cluster.client.job(job_id)["status"] == "running" for job_id in jobs)  # cancelled while they train
    stopped = cluster.wait_for_job(cancelled, lambda d: d["status"] == "cancelled", 60,
                                   give_up_on=("failed", "succeeded"))
    assert stopped["step"] < stopped["total_steps"]
    for seed, job_id in zip(SEEDS, jobs, strict=True):
        final = cluster.client.wait(job_id, timeout=240)
        assert final["status"] == "succeeded", final["error"]
        expected = reference_run({**JOB, "seed": seed})
        curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
        assert sorted(curve) == list(range(1, len(expected.losses) + 1))
        for step, want in enumerate(expected.losses, 1):
            assert math.isclose(curve[step], want, rel_tol=1e-5), f"job {seed}, step {step}: {curve[step]} != {want}"
        assert math.isclose(final["val_loss"], expected.val_loss, rel_tol=1e-5)
    assert cluster.process_ids("worker-training") == [worker]  # no process came or went for a job


def _started(cluster: LocalCluster, spec: dict[str, Any]) -> str:
    job = cluster.client.submit_job(spec)
    cluster.client.start_job(job["id"])
    return str(job["id"])
