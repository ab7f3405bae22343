"""Stage 0 and the last stage read an uploaded tensor dataset's rows themselves, by byte range through the control
plane (controlplane/jobs/dataset_reads.py) or straight from the S3 bucket by presigned ranged GETs: training still
equals one process, the driver reads the file's header and no sample, and nobody reads what is not theirs."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from django.utils import timezone
from rest_framework.test import APIClient
from safetensors.torch import save

from arceus.contracts.assignment import Assignment
from arceus.data.loader import load_dataset
from arceus.data.upload_rows import MAX_RANGE_BYTES, MAX_RANGES, UploadLayout, upload_layout
from arceus.training.driver import DriverError, Pipeline, train
from arceus.training.recording import RecordingSink
from arceus.wire.tls import new_identity
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.driver.driving import train_plan
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.models import Node
from nodeagent.stage import DatasetReadError
from tests.arceus.training.reference_jobs import reference_of
from tests.controlplane.datasets.test_datasets_api import upload
from tests.controlplane.jobs.upload_readers import CountingOpener, Host, reader, ready_node, stage_host

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 10]}
BATCH, VAL_BATCH, STEPS, SEED, LR = 32, 64, 6, 3, 0.05


def digits_upload() -> bytes:
    """The bundled digits' training rows, then 160 of its validation rows: the upload's first 90% (1437 of 1597
    rows) are exactly the digits' training split, so its training steps are the bundled digits' one-process run."""
    train_x, train_y, val_x, val_y = load_dataset({"name": "digits"})
    x, y = torch.cat([train_x, val_x[:160]]), torch.cat([train_y, val_y[:160]])
    assert int(len(x) * 0.9) == len(train_x)
    return save({"x": x.contiguous(), "y": y.contiguous()})


def placed_job(  # noqa: ANN201
    user, data: bytes, api: APIClient, *, place: bool = True, audit_rate: float = 0.0  # noqa: ANN001
) -> tuple[Job, dict[str, Any]]:
    dataset = upload(api, data, piece=1 << 20)
    job = job_submit(
        owner=user, model_config=MODEL, stages=2, epochs=1, learning_rate=LR, optimizer="sgd", momentum=0.9,
        micro_batches=2, seed=SEED, requirements={"owner_diversity": False}, audit_rate=audit_rate,
        dataset_config={"name": "uploaded", "dataset_id": dataset["id"], "batch_size": BATCH,
                        "val_batch_size": VAL_BATCH},
    )
    if place:
        job = job_start(job=job)
        # Live agents heartbeat every few seconds; these test nodes heartbeat once, and the upload above can outlast
        # their lease (ARCEUS_NODE_GRACE_SECONDS) on a loaded machine, leaving no Ready node to place the job on.
        for node in Node.objects.filter(owner=user):
            node_heartbeat(node=node, observed=[], now=timezone.now())
        reconcile_once()
        job.refresh_from_db()
    return job, dataset


def layout_of(dataset: dict[str, Any], data: bytes) -> UploadLayout:
    return upload_layout(dataset["id"], io.BytesIO(data), len(data), "safetensors")


def fresh_train_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the driver's train calls chained after no earlier step (whose first step no stage could read ahead): a
    step sent on its own, or a window sent while no window was outstanding."""
    fresh = [0]
    send, window = Pipeline._send, Pipeline.window

    def counted_send(self, batch, *, train, train_step, after):  # noqa: ANN001, ANN202
        fresh[0] += train and after is None
        return send(self, batch, train=train, train_step=train_step, after=after)

    def counted_window(self, batches, *, first_train_step):  # noqa: ANN001, ANN202
        fresh[0] += not self._windows
        return window(self, batches, first_train_step=first_train_step)

    monkeypatch.setattr(Pipeline, "_send", counted_send)
    monkeypatch.setattr(Pipeline, "window", counted_window)
    return fresh


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("store", "audit_rate"), [("filesystem", 0.0), ("s3", 0.0), ("filesystem", 1.0)])
def test_the_stages_read_the_upload_and_training_equals_one_process(
    live_server, user, api: APIClient, hosts: list[Host], store: str, audit_rate: float,  # noqa: ANN001
    request: pytest.FixtureRequest,
) -> None:
    """Unaudited, the steps are chained and each stage reads the next step's rows while it computes one; audited
    (every step spot-checks a micro-batch of stage 0), the driver reads that micro-batch's inputs and no more."""
    request.getfixturevalue("dataset_dir" if store == "filesystem" else "s3_datasets")
    data = digits_upload()
    job, _ = placed_job(user, data, api, audit_rate=audit_rate)
    for host in hosts:
        host.agent.apply_assignments([Assignment.from_json(a) for a in assignments_for_node(node=host.node)])
    opener = CountingOpener(user.pk)
    plan = dataclasses.replace(train_plan(job), max_steps=STEPS, open_dataset=opener)
    sink = RecordingSink()
    fresh = fresh_train_calls(request.getfixturevalue("monkeypatch"))
    result = train(plan, sink)
    assert result.steps == STEPS
    expected = reference_of(MODEL, {"name": "digits", "batch_size": BATCH}, {"name": "sgd", "lr": LR, "momentum": 0.9},
                            epochs=1, seed=SEED, max_steps=STEPS)
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != one process's {want!r}"
    assert len(sink.epochs) == 1 and math.isfinite(sink.epochs[0].val_loss)  # the stages read validation rows too
    # Chained (unaudited), every step had its rows read ahead while the step before computed, each window's first
    # too (sent chained after the window before: arceus.training.driver), but the run's first step.
    ahead = sum(name.startswith("samples-ahead") for name in stage_host(job, hosts, 0).threads)
    assert ahead == (0 if audit_rate else STEPS - fresh[0]) and (audit_rate or fresh[0] == 1)
    assert any(p.spot_checks for p in sink.steps) == bool(audit_rate)
    # The driver read the file's header to lay it out (and, audited, at most the inputs of the micro-batch a step's
    # check recomputes): x alone is 1597 x 64 float32; pushing, it read every step's rows and the validation split's.
    header, micro_batch = 1024, BATCH // 2 * 64 * 4
    assert 0 < opener.bytes_read < header + (STEPS * micro_batch if audit_rate else 0)


@pytest.mark.django_db(transaction=True)
def test_a_stage_reads_only_its_own_rows_and_a_stranger_nothing(
    live_server, user, other_user, api: APIClient, other_api: APIClient, hosts: list[Host], dataset_dir: Path  # noqa: ANN001
) -> None:
    data = digits_upload()
    job, dataset = placed_job(user, data, api)
    layout = layout_of(dataset, data)
    first, last = stage_host(job, hosts, 0), stage_host(job, hosts, 1)
    x_row = (layout.train.x.offset, layout.train.x.offset + layout.train.x.row_bytes)
    y_rows = (layout.train.y.offset, layout.train.y.offset + 3 * layout.train.y.row_bytes)
    assert reader(live_server, first).read_dataset_ranges(str(job.id), [x_row]) == [data[x_row[0]: x_row[1]]]
    assert reader(live_server, last).read_dataset_ranges(str(job.id), [y_rows]) == [data[y_rows[0]: y_rows[1]]]

    def refused(host: Host, ranges: list[tuple[int, int]], job_id: str = str(job.id)) -> str:
        with pytest.raises(DatasetReadError) as caught:
            reader(live_server, host).read_dataset_ranges(job_id, ranges)
        return str(caught.value)

    # Stage 0 reads no labels, the last stage no inputs; nobody the header, or past the file.
    assert "HTTP 400" in refused(first, [y_rows]) and "outside the rows" in refused(first, [y_rows])
    assert "outside the rows" in refused(last, [x_row])
    assert "outside the rows" in refused(first, [(0, 8)])
    assert "outside the rows" in refused(first, [(layout.size - 4, layout.size + 4)])
    # A body that names no ranges: a 400 naming the field.
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {first.token}")
    for body in ({}, {"ranges": "0-8"}, {"ranges": [[0, True]]}, {"ranges": [[0, 1, 2]]}):
        answer = agent.post(f"/api/agent/jobs/{job.id}/dataset-reads", body, format="json")
        assert answer.status_code == 400 and "ranges" in answer.json()["errors"], (body, answer.content)
    # Bounded: a range too large, too many ranges, an empty one.
    big = (layout.train.x.offset, layout.train.x.offset + MAX_RANGE_BYTES + 1)
    assert "HTTP 400" in refused(first, [big])
    assert f"at most {MAX_RANGES}" in refused(first, [x_row] * (MAX_RANGES + 1))
    assert "not 1 to" in refused(first, [(layout.train.x.offset, layout.train.x.offset)])
    # A node hosting nothing of the job (another owner's), another job (the other owner's, on its own upload of the
    # same bytes) by this job's agent, a job id that is none: 404, before the ranges are looked at.
    stranger = Host(*ready_node(other_user, "stranger", "127.0.0.1:1", new_identity().certificate))
    assert "HTTP 404" in refused(stranger, [x_row])
    other_job, _ = placed_job(other_user, data, other_api, place=False)
    assert "HTTP 404" in refused(first, [x_row], job_id=str(other_job.id))
    assert "HTTP 404" in refused(first, [x_row], job_id="not-a-job")
    # A stage moved away (a rewind: a new generation) reads no more.
    Job.objects.filter(pk=job.pk).update(generation=job.generation + 1)
    assert "HTTP 404" in refused(first, [x_row])


@pytest.mark.django_db(transaction=True)
def test_from_an_s3_bucket_the_agent_reads_by_presigned_ranged_gets(
    live_server, user, api: APIClient, hosts: list[Host], s3_datasets: Any  # noqa: ANN001
) -> None:
    data = digits_upload()
    job, dataset = placed_job(user, data, api)
    layout = layout_of(dataset, data)
    first = stage_host(job, hosts, 0)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {first.token}")
    ranges = [[layout.train.x.offset, layout.train.x.offset + 10 * layout.train.x.row_bytes]]
    answer = agent.post(f"/api/agent/jobs/{job.id}/dataset-reads", {"ranges": ranges}, format="json")
    assert answer.status_code == 200 and len(answer.json()["urls"]) == 1
    [url] = answer.json()["urls"]
    assert "X-Amz-SignedHeaders=host%3Brange" in url  # SigV4 with the range signed: it reads that range only
    assert reader(live_server, first).read_dataset_ranges(str(job.id), [tuple(r) for r in ranges]) == [
        data[ranges[0][0]: ranges[0][1]]
    ]


@pytest.mark.django_db(transaction=True)
def test_a_label_the_model_cannot_take_stops_the_step_before_torch_sees_it(
    live_server, user, api: APIClient, hosts: list[Host], dataset_dir: Path  # noqa: ANN001
) -> None:
    """The upload was checked when it completed; a stored file changed since (a label past the model's classes)
    is refused by the last stage as it reads it, naming why."""
    data = digits_upload()
    job, dataset = placed_job(user, data, api)
    layout = layout_of(dataset, data)
    [stored] = Path(dataset_dir).rglob("data.safetensors")
    changed = bytearray(stored.read_bytes())
    labels = layout.train.y
    for row in range(labels.shape[0]):  # every training label: whichever rows the first step names
        offset = labels.offset + row * labels.row_bytes
        changed[offset: offset + labels.row_bytes] = (99).to_bytes(labels.row_bytes, "little")
    stored.write_bytes(bytes(changed))
    for host in hosts:
        host.agent.apply_assignments([Assignment.from_json(a) for a in assignments_for_node(node=host.node)])
    plan = dataclasses.replace(train_plan(job), max_steps=1)
    with pytest.raises(DriverError) as caught:
        train(plan, RecordingSink())
    assert caught.value.stage_index == 1 and caught.value.code == "INVALID_ARGUMENT"
    assert "label outside [0, 10)" in str(caught.value)
