"""An uploaded text is tokenized once by the control plane into a token file beside it (controlplane/datasets/
tokens.py), whose windows stage 0 and the last stage read by byte range like a tensor upload's rows: training equals
one process on the same text, the driver reads the token file's header and nothing else, a second job on the text
reads the same file, and nobody reads what is not theirs."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from arceus.contracts.assignment import Assignment
from arceus.data.token_file import HEADER_BYTES
from arceus.data.upload_rows import UploadLayout, token_layout
from arceus.training.driver import train
from arceus.training.recording import RecordingSink
from controlplane.controller.executor import reconcile_once
from controlplane.datasets.models import Dataset, TokenFile, dataset_storage
from controlplane.datasets.tokens import text_tokens_prepare
from controlplane.driver.driving import train_plan
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import assignments_for_node
from controlplane.jobs.services import job_start, job_submit
from nodeagent.stage import DatasetReadError
from tests.arceus.training.reference_jobs import reference_of
from tests.controlplane.datasets.test_datasets_api import upload
from tests.controlplane.jobs.upload_readers import CountingOpener, Host, reader, stage_host

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 8}
BATCH, VAL_BATCH, STEPS, SEED, LR = 8, 16, 5, 4, 0.01
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {'é' * (i % 3)}\n" for i in range(120))


def text_job(user, dataset: dict[str, Any], *, place: bool = True) -> Job:  # noqa: ANN001
    job = job_submit(
        owner=user, model_config=MODEL, stages=2, epochs=1, learning_rate=LR, optimizer="adam", micro_batches=2,
        seed=SEED, requirements={"owner_diversity": False},
        dataset_config={"dataset_id": dataset["id"], "batch_size": BATCH, "val_batch_size": VAL_BATCH},
    )
    if place:
        job = job_start(job=job)
        reconcile_once()
        job.refresh_from_db()
    return job


def applied(job: Job, hosts: list[Host]) -> None:
    for host in hosts:
        host.agent.apply_assignments([Assignment.from_json(a) for a in assignments_for_node(node=host.node)])


def stored_layout(job: Job) -> tuple[UploadLayout, bytes]:
    tokens = TokenFile.objects.get(dataset_id=job.dataset_config["dataset_id"])
    with dataset_storage().open(tokens.file.name, "rb") as handle:
        data = handle.read()
    return token_layout(job.dataset_config["dataset_id"], io.BytesIO(data), len(data), 8), data


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["filesystem", "s3"])
def test_the_stages_read_the_token_file_and_training_equals_one_process(
    live_server, user, api: APIClient, hosts: list[Host], store: str, tmp_path: Path,  # noqa: ANN001
    request: pytest.FixtureRequest,
) -> None:
    request.getfixturevalue("dataset_dir" if store == "filesystem" else "s3_datasets")
    dataset = upload(api, TEXT.encode(), "text", piece=4096)
    job = text_job(user, dataset)
    applied(job, hosts)
    opener = CountingOpener(user.pk)
    sink = RecordingSink()
    result = train(dataclasses.replace(train_plan(job), max_steps=STEPS, open_dataset=opener), sink)
    assert result.steps == STEPS
    source = tmp_path / "same.txt"
    source.write_text(TEXT, encoding="utf-8")
    expected = reference_of(job.model_config, {"name": "text", "source": str(source), "block_size": 8,
                                               "batch_size": BATCH}, {"name": "adam", "lr": LR},
                            epochs=1, seed=SEED, max_steps=STEPS)
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != one process's {want!r}"
    assert len(sink.epochs) == 1 and math.isfinite(sink.epochs[0].val_loss)  # the stages read validation windows
    assert opener.bytes_read == HEADER_BYTES  # the driver read the token file's header, no token
    # Tokenized once: a second job on the text reads the same file, which is not written again.
    [tokens] = TokenFile.objects.filter(dataset_id=dataset["id"])
    assert tokens.key == "char" and tokens.file.name.endswith("/tokens/char.tok")
    again = text_tokens_prepare(owner_id=user.pk, dataset_config=text_job(user, dataset, place=False).dataset_config)
    assert (again.pk, again.file.name) == (tokens.pk, tokens.file.name)


@pytest.mark.django_db(transaction=True)
def test_a_stage_reads_only_its_own_windows_and_another_job_nothing(
    live_server, user, other_user, api: APIClient, other_api: APIClient, hosts: list[Host], dataset_dir: Path,  # noqa: ANN001
) -> None:
    dataset = upload(api, TEXT.encode(), "text", piece=4096)
    job = text_job(user, dataset)
    first, last = stage_host(job, hosts, 0), stage_host(job, hosts, 1)

    def refused(host: Host, ranges: list[tuple[int, int]], job_id: str = str(job.id)) -> str:
        with pytest.raises(DatasetReadError) as caught:
            reader(live_server, host).read_dataset_ranges(job_id, ranges)
        return str(caught.value)

    # Before the driver tokenized the text, there is nothing to read: a 409 saying why.
    assert "HTTP 409" in refused(first, [(HEADER_BYTES, HEADER_BYTES + 16)])
    assert "not tokenized yet" in refused(first, [(HEADER_BYTES, HEADER_BYTES + 16)])
    text_tokens_prepare(owner_id=user.pk, dataset_config=job.dataset_config)
    layout, data = stored_layout(job)
    window = (layout.train.x.offset, layout.train.x.end)
    labels = (layout.validation.y.offset, layout.validation.y.offset + 2 * layout.validation.y.row_bytes)
    assert reader(live_server, first).read_dataset_ranges(str(job.id), [window]) == [data[window[0]: window[1]]]
    assert reader(live_server, last).read_dataset_ranges(str(job.id), [labels]) == [data[labels[0]: labels[1]]]
    # The first token is an input only, the last a label only; the header and past the file are nobody's.
    first_token = (layout.train.x.offset, layout.train.x.offset + 2)
    assert "outside the rows" in refused(last, [first_token])
    assert "outside the rows" in refused(first, [(layout.train.y.end - 2, layout.train.y.end)])
    assert "outside the rows" in refused(first, [(0, HEADER_BYTES)])
    assert "outside the rows" in refused(last, [(layout.size - 2, layout.size + 2)])
    # Another owner's job on its own upload of the same text, tokenized too: this job's agent reads none of it.
    other_job = text_job(other_user, upload(other_api, TEXT.encode(), "text", piece=4096), place=False)
    text_tokens_prepare(owner_id=other_user.pk, dataset_config=other_job.dataset_config)
    assert "HTTP 404" in refused(first, [window], job_id=str(other_job.id))


@pytest.mark.django_db(transaction=True)
def test_a_token_file_is_keyed_by_its_tokenizer_and_deleted_with_its_text(
    user, api: APIClient, dataset_dir: Path, django_capture_on_commit_callbacks  # noqa: ANN001
) -> None:
    dataset = upload(api, TEXT.encode(), "text", piece=4096)
    char = text_tokens_prepare(owner_id=user.pk, dataset_config=text_job(user, dataset, place=False).dataset_config)
    bpe_job = job_submit(
        owner=user, model_config={**MODEL, "vocab": "bpe", "vocab_size": 300}, stages=2, epochs=1, learning_rate=LR,
        optimizer="adam", micro_batches=2, seed=SEED, requirements={"owner_diversity": False},
        dataset_config={"dataset_id": dataset["id"], "batch_size": BATCH},
    )
    bpe = text_tokens_prepare(owner_id=user.pk, dataset_config=bpe_job.dataset_config)
    assert (char.key, bpe.key) == ("char", "bpe-300") and char.file.name != bpe.file.name
    assert sorted(p.name for p in dataset_dir.rglob("*.tok")) == ["bpe-300.tok", "char.tok"]
    Job.objects.filter(owner=user).update(status="cancelled")
    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(f"/api/datasets/{dataset['id']}").status_code == 204
    assert not list(dataset_dir.rglob("*.tok")) and not TokenFile.objects.exists()
    assert not Dataset.objects.filter(pk=dataset["id"]).exists()
