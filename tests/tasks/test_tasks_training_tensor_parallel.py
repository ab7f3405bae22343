"""The training-driver task on a job whose stage 1 is a tensor-parallel pair, with real in-process
agents: the plan lists the pair's ranks, and when one rank's agent dies mid-training the reconciler moves
that rank alone to a spare node, the re-formed group rebuilds from the last checkpoint, and training
resumes from it to success."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from arceus.data.text_config import BUNDLED_TEXT
from controlplane.controller.actions import MarkNodeUnknown, RewindJob, StartDriver
from controlplane.controller.executor import reconcile_once
from controlplane.driver.driving import train_plan
from controlplane.jobs.models import (
    Checkpoint,
    Job,
    LossPoint,
    Stage,
    StageCheckpoint,
    StageContribution,
    checkpoint_storage,
)
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.liveness import lease_renew
from tasks.training import run_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def checkpoint_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Checkpoint files under tmp_path (as in tests/controlplane/jobs/test_jobs_checkpoints.py)."""
    settings.STORAGES = {
        **settings.STORAGES,
        "checkpoints": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path)},
        },
    }
    monkeypatch.setattr(StageCheckpoint._meta.get_field("file"), "storage", checkpoint_storage())
    return tmp_path


def test_a_lost_rank_is_replaced_and_the_split_stage_resumes_from_its_checkpoint(
    user, live_nodes, checkpoint_dir, settings
) -> None:
    settings.ARCEUS_RPC_TIMEOUT_SECONDS = 3
    settings.ARCEUS_DATA_ROOT = checkpoint_dir
    source = checkpoint_dir / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    for live in live_nodes:
        live.sync()
    job = job_start(job=job_submit(
        owner=user,
        model_config={"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16},
        dataset_config={"name": "text", "source": source.name, "batch_size": 16, "val_batch_size": 64},
        epochs=3,  # 22 steps each
        learning_rate=0.003,
        optimizer="adam",
        micro_batches=2,
        stages=2,
        checkpoint_interval_steps=4,
        tensor_parallel={"size": 2, "stages": [1]},
        requirements={"owner_diversity": False},  # the live nodes are all the user's
    ))
    ready(job, live_nodes)
    plan = train_plan(job)
    rows = {(r.index, r.rank): r for r in Stage.objects.filter(job=job)}
    assert [(s.node_id, [r.node_id for r in s.tensor_parallel_ranks]) for s in plan.stages] == [
        (str(rows[0, 0].node_id), []), (str(rows[1, 0].node_id), [str(rows[1, 1].node_id)])
    ]

    # Train in a thread; once a checkpoint is saved, rank 1's agent dies.
    outcome: list[str] = []
    driver = threading.Thread(target=drive, args=(str(job.id), outcome))
    driver.start()
    deadline = time.monotonic() + 60
    while not Checkpoint.objects.filter(job=job).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    lost = next(live for live in live_nodes if live.node.pk == rows[1, 1].node_id)
    lost.agent.stop(grace=0)
    driver.join(timeout=60)
    assert outcome == ["interrupted"]
    job.refresh_from_db()
    interrupted_at = job.step
    assert 4 <= interrupted_at < job.total_steps

    # Its node falls silent: the reconciler moves rank 1 alone to a spare; every rank rebuilds.
    lease_renew(node_id=lost.node.pk, now=timezone.now() - timedelta(seconds=60))
    spare = type(lost)(user, "spare")
    live_nodes.append(spare)  # stopped with the others
    spare.sync()
    applied = [type(a) for a in reconcile_once().applied]
    assert applied == [MarkNodeUnknown, RewindJob]
    job.refresh_from_db()
    assert job.status == "placing" and job.resume_checkpoint is not None
    moved = {(r.index, r.rank): r.node_id for r in Stage.objects.filter(job=job)}
    assert moved == {**{k: r.node_id for k, r in rows.items()}, (1, 1): spare.node.pk}
    ready(job, [live for live in live_nodes if live is not lost])

    assert run_job(str(job.id)) == "succeeded"
    reconcile_once()  # the pass the driver's last word nudged
    job.refresh_from_db()
    assert job.status == "succeeded", job.error
    assert job.step == job.total_steps == 66
    resumed = job.resume_checkpoint.step
    assert 4 <= resumed <= interrupted_at and resumed % 4 == 0
    losses = list(LossPoint.objects.filter(job=job).order_by("step").values_list("loss", flat=True))
    assert len(losses) == 66 and losses[-1] < losses[0] - 0.5
    # The dead rank's work up to the rewind and the spare's after it are both on record.
    workers = set(StageContribution.objects.filter(job=job, stage_index=1).values_list("node_id", flat=True))
    assert workers == {rows[1, 0].node_id, lost.node.pk, spare.node.pk}


def ready(job: Job, live_nodes: list) -> None:
    """Agents build their stages and report them ready; the reconciler starts the driver."""
    for _ in range(2):
        for live in live_nodes:
            live.sync()
    if Job.objects.get(pk=job.pk).status == "queued":  # first placement
        reconcile_once()
        for _ in range(2):
            for live in live_nodes:
                live.sync()
    assert StartDriver in {type(a) for a in reconcile_once().applied}
    job.refresh_from_db()
    assert job.status == "running", job.conditions


def drive(job_id: str, outcome: list[str]) -> None:
    try:
        outcome.append(run_job(job_id))
    finally:
        connection.close()
