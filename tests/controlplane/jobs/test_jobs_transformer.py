"""POST /api/jobs with a transformer: completed configs are stored, bad ones are a 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from arceus.data.text_config import text_vocabulary
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db

GPT_JOB: dict[str, Any] = {
    "model_config": {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 32},
    "dataset_config": {"name": "text", "batch_size": 8},
    "optimizer": "adam",
    "learning_rate": 0.001,
    "micro_batches": 2,
}


def submit(api: APIClient, body: dict[str, Any]) -> Any:
    return api.post("/api/jobs", body, format="json")


def test_a_transformer_job_is_stored_with_vocab_size_and_block_size_filled_in(api: APIClient) -> None:
    response = submit(api, GPT_JOB)
    assert response.status_code == 201, response.json()
    body = response.json()
    vocab = len(text_vocabulary({"name": "text"}))
    assert vocab == 62  # the bundled King James Pentateuch
    assert body["model_config"] == {**GPT_JOB["model_config"], "vocab_size": vocab}
    assert body["dataset_config"] == {"name": "text", "batch_size": 8, "val_batch_size": 256, "block_size": 32}
    assert body["name"] == "text-transformer-4-layers"
    job = Job.objects.get(pk=body["id"])
    # What the placement solver sees: the head's output is the logits of every position.
    profiles = layer_profiles(model_spec_from_config(job.model_config))
    assert [p.output_bytes_per_sample for p in profiles] == [32 * 64 * 4] * 3 + [32 * vocab * 4]


def test_the_default_transformer_has_about_five_million_parameters(api: APIClient) -> None:
    response = submit(api, {"model_config": {"type": "transformer"}, "dataset_config": {"name": "text"}})
    assert response.status_code == 201, response.json()
    config = response.json()["model_config"]
    spec = model_spec_from_config(config)
    assert (spec.d_model, spec.n_layer, spec.n_head, spec.block_size) == (256, 6, 8, 128)
    assert 4_500_000 < sum(spec.layer_params()) < 5_500_000


def test_a_text_file_of_ones_own_is_read_for_its_vocabulary(api: APIClient, data_root: Path) -> None:
    (data_root / "books").mkdir()
    (data_root / "books" / "abc.txt").write_text("abcabc ba\n" * 100, encoding="utf-8")
    body = {**GPT_JOB, "dataset_config": {"name": "text", "source": "books/abc.txt"}}
    response = submit(api, body)
    assert response.status_code == 201, response.json()
    assert response.json()["model_config"]["vocab_size"] == 5  # a b c space newline


def test_a_bpe_transformer_job_stores_its_vocabulary_in_both_configs(api: APIClient) -> None:
    body = {**GPT_JOB, "model_config": {**GPT_JOB["model_config"], "vocab": "bpe", "vocab_size": 512}}
    response = submit(api, body)
    assert response.status_code == 201, response.json()
    stored = response.json()
    assert stored["model_config"]["vocab_size"] == 512 and stored["model_config"]["vocab"] == "bpe"
    assert stored["dataset_config"] == {
        "name": "text", "batch_size": 8, "val_batch_size": 256, "block_size": 32, "vocab": "bpe", "vocab_size": 512,
    }


INVALID: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("d_model not divisible", {"d_model": 30}, {}, "model_config.d_model", "divisible by n_head (4)"),
    ("zero layers", {"n_layer": 0}, {}, "model_config.n_layer", "between 1 and"),
    ("bool heads", {"n_head": True}, {}, "model_config.n_head", "positive integer"),
    ("unknown key", {"dropout": 0.1}, {}, "model_config.dropout", "unknown key for a transformer"),
    ("unknown vocab", {"vocab": "wordpiece"}, {}, "model_config.vocab", "must be one of char, bpe"),
    ("tiny bpe", {"vocab": "bpe", "vocab_size": 64}, {}, "model_config.vocab_size", "between 257 and"),
    ("dataset vocab clash", {"vocab": "bpe", "vocab_size": 300}, {"vocab": "bpe", "vocab_size": 400},
     "dataset_config.vocab_size", "is 400 but the model's is 300"),
    ("wrong vocab size", {"vocab_size": 100}, {}, "model_config.vocab_size", "62 distinct characters"),
    ("missing source", {}, {"source": "nonexistent/book.txt"}, "dataset_config.source",
     "no readable file 'nonexistent/"),
    ("empty source", {}, {"source": ""}, "dataset_config.source", "non-empty path"),
    ("block mismatch", {}, {"block_size": 64}, "dataset_config.block_size", "model's block_size is 32"),
    ("mnist key on text", {}, {"path": "/data"}, "dataset_config.path", "does not apply to the text dataset"),
    ("not a text dataset", {}, {"name": "digits"}, "dataset_config.name", "trains on the text dataset"),
]


@pytest.mark.parametrize(("case", "model", "dataset", "field", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_bad_transformer_jobs_are_a_400_naming_the_field(
    api: APIClient, case: str, model: dict, dataset: dict, field: str, message: str
) -> None:
    body = {
        **GPT_JOB,
        "model_config": {**GPT_JOB["model_config"], **model},
        "dataset_config": {**GPT_JOB["dataset_config"], **dataset},
    }
    response = submit(api, body)
    assert response.status_code == 400, response.json()
    errors = response.json()["errors"]
    assert field in errors, errors
    assert message in " ".join(errors[field])
    assert Job.objects.count() == 0


def test_an_mlp_on_the_text_dataset_is_a_400(api: APIClient) -> None:
    response = submit(api, {"model_config": {"layer_sizes": [64, 10]}, "dataset_config": {"name": "text"}})
    assert response.status_code == 400
    assert "needs a transformer" in " ".join(response.json()["errors"]["model_config.type"])
