"""POST /api/datasets and its pieces: open, send in order (resume from the server's offset), complete with the hash
and format checked, quotas, tenants' isolation, delete; and jobs naming an upload by id."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from safetensors.torch import save

from arceus.cli import main as cli_main
from arceus.sdk import ArceusClient
from arceus.trainer import dataset_config_for
from controlplane.accounts.services import user_token_get_or_create
from controlplane.datasets.models import Dataset, dataset_storage

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def dataset_dir(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Dataset files go under tmp_path (Dataset.file resolved its storage at import: pointed at the new one)."""
    settings.STORAGES = {
        **settings.STORAGES,
        "datasets": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    monkeypatch.setattr(Dataset._meta.get_field("file"), "storage", dataset_storage())
    return tmp_path


def files_in(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def tensor_file(n: int = 40, features: int = 64, classes: int = 10) -> bytes:
    g = torch.Generator().manual_seed(1)
    return save({"x": torch.rand(n, features, generator=g), "y": torch.arange(n) % classes})


def open_upload(api: APIClient, data: bytes, fmt: str = "safetensors", **extra: Any) -> dict[str, Any]:
    body = {"name": "mine", "format": fmt, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **extra}
    response = api.post("/api/datasets", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def put_piece(api: APIClient, dataset_id: str, offset: int, piece: bytes) -> Any:
    return api.put(f"/api/datasets/{dataset_id}/data?offset={offset}", data=piece,
                   content_type="application/octet-stream")


def upload(api: APIClient, data: bytes, fmt: str = "safetensors", piece: int = 1000, **extra: Any) -> dict[str, Any]:
    dataset = open_upload(api, data, fmt, **extra)
    for offset in range(0, len(data), piece):
        response = put_piece(api, dataset["id"], offset, data[offset : offset + piece])
        assert response.status_code == 200, response.content
    response = api.post(f"/api/datasets/{dataset['id']}/complete")
    assert response.status_code == 200, response.content
    return response.json()


def test_an_upload_in_pieces_completes_with_its_facts_and_one_file(
    api: APIClient, dataset_dir: Path, django_capture_on_commit_callbacks
) -> None:
    data = tensor_file()
    with django_capture_on_commit_callbacks(execute=True):
        dataset = upload(api, data)
    assert dataset["status"] == "ready" and dataset["uploaded_bytes"] == len(data)
    assert dataset["facts"] == {"kind": "tensors", "samples": 40, "features": 64, "image_shape": None, "classes": 10}
    stored = files_in(dataset_dir)
    assert len(stored) == 1 and stored[0].endswith(f"{dataset['id']}/data.safetensors")  # the pieces are gone
    assert (dataset_dir / stored[0]).read_bytes() == data
    assert api.get("/api/datasets").json() == [dataset]
    assert api.post(f"/api/datasets/{dataset['id']}/complete").json()["status"] == "ready"  # again: the same


def test_an_interrupted_upload_resumes_from_the_servers_offset(api: APIClient) -> None:
    data = tensor_file()
    dataset = open_upload(api, data)
    assert put_piece(api, dataset["id"], 0, data[:1500]).status_code == 200
    # The client lost track: a piece from elsewhere is a 409 naming where the upload is.
    response = put_piece(api, dataset["id"], 3000, data[3000:4000])
    assert response.status_code == 409
    assert response.json()["errors"] == {"offset": ["must be 1500, got 3000"]}
    early = api.post(f"/api/datasets/{dataset['id']}/complete")
    assert early.status_code == 409 and "1,500 of the" in early.json()["detail"]
    offset = api.get(f"/api/datasets/{dataset['id']}").json()["uploaded_bytes"]
    assert put_piece(api, dataset["id"], offset, data[offset:]).status_code == 200
    assert api.post(f"/api/datasets/{dataset['id']}/complete").json()["status"] == "ready"


def test_a_piece_past_the_declared_size_or_empty_is_refused(api: APIClient) -> None:
    data = tensor_file()
    dataset = open_upload(api, data)
    response = put_piece(api, dataset["id"], 0, data + b"more")
    assert response.status_code == 400 and "past the declared size" in response.json()["detail"]
    assert put_piece(api, dataset["id"], 0, b"").status_code == 400
    assert api.put(f"/api/datasets/{dataset['id']}/data", data=b"x",
                   content_type="application/octet-stream").json()["errors"]["offset"]


def test_a_file_whose_hash_differs_fails_and_frees_its_space(api: APIClient, dataset_dir: Path) -> None:
    data = tensor_file()
    dataset = open_upload(api, data)
    damaged = bytearray(data)
    damaged[-1] ^= 1
    assert put_piece(api, dataset["id"], 0, bytes(damaged)).status_code == 200
    response = api.post(f"/api/datasets/{dataset['id']}/complete")
    assert response.status_code == 400 and "not the declared" in response.json()["detail"]
    detail = api.get(f"/api/datasets/{dataset['id']}").json()
    assert detail["status"] == "failed" and "upload the dataset again" in detail["error"]
    assert files_in(dataset_dir) == []
    assert put_piece(api, dataset["id"], len(data), b"x").status_code == 409  # closed


@pytest.mark.parametrize(
    ("fmt", "data", "message"),
    [
        ("text", b"\xff\xfe not utf-8", "not UTF-8 at byte 0"),
        ("jsonl", b'{"body": "x"}\n', "no string field 'text'"),
        ("safetensors", save({"x": torch.zeros(3, 2)}), "exactly x and y"),
        ("npz", b"not a zip at all", "not an .npz file"),
    ],
)
def test_a_file_not_of_its_format_fails_naming_why(api: APIClient, fmt: str, data: bytes, message: str) -> None:
    dataset = open_upload(api, data, fmt)
    put_piece(api, dataset["id"], 0, data)
    response = api.post(f"/api/datasets/{dataset['id']}/complete")
    assert response.status_code == 400
    assert message in response.json()["detail"] and message in response.json()["errors"]["body"][0]


def test_quotas_of_bytes_and_count_are_a_403_naming_the_setting(api: APIClient, settings) -> None:  # noqa: ANN001
    settings.ARCEUS_DATASET_QUOTA_BYTES, settings.ARCEUS_DATASET_QUOTA_COUNT = 10_000, 2
    body = {"name": "big", "format": "text", "size_bytes": 10_001, "sha256": "0" * 64}
    response = api.post("/api/datasets", body, format="json")
    assert response.status_code == 403 and "ARCEUS_DATASET_QUOTA_BYTES" in response.json()["detail"]
    open_upload(api, b"a" * 4000, "text")
    open_upload(api, b"b" * 4000, "text")
    response = api.post("/api/datasets", {**body, "size_bytes": 10}, format="json")
    assert response.status_code == 403 and "ARCEUS_DATASET_QUOTA_COUNT" in response.json()["detail"]


def test_another_tenants_dataset_is_a_404_everywhere(api: APIClient, other_api: APIClient) -> None:
    dataset = upload(api, tensor_file())
    path = f"/api/datasets/{dataset['id']}"
    assert other_api.get(path).status_code == 404
    assert other_api.delete(path).status_code == 404
    assert put_piece(other_api, dataset["id"], 0, b"x").status_code == 404
    assert other_api.post(f"{path}/complete").status_code == 404
    assert other_api.get("/api/datasets").json() == []
    assert api.get("/api/datasets/not-a-uuid").status_code == 404
    assert APIClient().get("/api/datasets").status_code == 401


def test_an_invalid_opening_names_the_field(api: APIClient) -> None:
    response = api.post("/api/datasets", {"name": "x", "format": "pickle", "size_bytes": 1, "sha256": "A" * 64},
                        format="json")
    assert response.status_code == 400 and set(response.json()["errors"]) == {"format", "sha256"}


def test_a_job_trains_on_the_owners_upload_by_id_and_no_one_elses(
    api: APIClient, other_api: APIClient, digits_job: dict[str, Any], dataset_dir: Path
) -> None:
    dataset = upload(api, tensor_file())
    job = {**digits_job, "dataset_config": {"name": "uploaded", "dataset_id": dataset["id"], "batch_size": 8,
                                            "classes": 99}}
    response = api.post("/api/jobs", job, format="json")
    assert response.status_code == 201, response.content
    stored = response.json()["dataset_config"]
    assert stored["classes"] == 10 and stored["features"] == 64 and stored["format"] == "safetensors"
    wrong = {**job, "model_config": {"type": "mlp", "layer_sizes": [32, 10]}}
    response = api.post("/api/jobs", wrong, format="json")
    assert response.status_code == 400 and "64 features" in response.json()["detail"]
    response = other_api.post("/api/jobs", job, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == {"dataset_config.dataset_id": [f"you have no dataset {dataset['id']}"]}
    # A job that may still train on it keeps it.
    response = api.delete(f"/api/datasets/{dataset['id']}")
    assert response.status_code == 409 and "may still train" in response.json()["detail"]


def test_a_text_upload_feeds_a_char_transformer(api: APIClient) -> None:
    text = ("In the beginning was the word. " * 200).encode()
    dataset = upload(api, text, "text", piece=2048)
    assert dataset["facts"]["characters"] == len(text)
    job = {
        "model_config": {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8},
        "dataset_config": {"dataset_id": dataset["id"]},
        "epochs": 1, "learning_rate": 0.01, "micro_batches": 1, "optimizer": "adam", "stages": 2,
    }
    response = api.post("/api/jobs", job, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["model_config"]["vocab_size"] == len(set(text.decode()))
    assert body["dataset_config"]["name"] == "text" and body["dataset_config"]["block_size"] == 8
    tensors = {**job, "dataset_config": {"name": "uploaded", "dataset_id": dataset["id"]}}
    response = api.post("/api/jobs", tensors, format="json")
    assert response.status_code == 400 and "name it 'text'" in response.json()["detail"]


def test_an_uploaded_tokenizer_json_tokenizes_a_text(api: APIClient, tmp_path: Path) -> None:
    from arceus.data.tokenizer import train_bpe

    text = ("some words to learn merges from, " * 300).encode()
    tokenizer = train_bpe(text.decode(), 300).to_json().encode()
    corpus = upload(api, text, "text", piece=4096)
    uploaded = upload(api, tokenizer, "tokenizer", piece=1 << 20)
    assert uploaded["facts"]["kind"] == "tokenizer"
    job = {
        "model_config": {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8,
                         "vocab": "bpe"},
        "dataset_config": {"dataset_id": corpus["id"], "tokenizer_id": uploaded["id"]},
        "epochs": 1, "learning_rate": 0.01, "micro_batches": 1, "optimizer": "adam", "stages": 2,
    }
    response = api.post("/api/jobs", job, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["model_config"]["vocab_size"] == uploaded["facts"]["vocab_size"]


def test_delete_removes_the_files(
    api: APIClient, dataset_dir: Path, user: User, django_capture_on_commit_callbacks
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        dataset = upload(api, tensor_file())
        partial = open_upload(api, b"abc" * 10, "text")
        put_piece(api, partial["id"], 0, b"abc" * 3)
        for d in (dataset, partial):
            assert api.delete(f"/api/datasets/{d['id']}").status_code == 204
    assert files_in(dataset_dir) == [] and not Dataset.objects.filter(owner=user).exists()


def test_the_cli_uploads_and_lists_and_the_sdk_resumes_an_interrupted_upload(
    live_server, user: User, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = user_token_get_or_create(user=user)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a small corpus of words\n" * 2000)
    argv = ["--url", live_server.url, "--token", token]
    assert cli_main([*argv, "datasets", "upload", str(corpus)]) == 0
    uploaded = json.loads(capsys.readouterr().out)
    assert uploaded["status"] == "ready" and uploaded["format"] == "text" and uploaded["name"] == "corpus.txt"
    assert cli_main([*argv, "datasets", "list"]) == 0
    assert [d["id"] for d in json.loads(capsys.readouterr().out)] == [uploaded["id"]]

    path = tmp_path / "pair.safetensors"
    path.write_bytes(tensor_file(n=400))
    client = ArceusClient(live_server.url, token)

    def cut(sent: int, total: int) -> None:
        raise ConnectionAbortedError  # the developer's process dies after the first piece

    with pytest.raises(ConnectionAbortedError):
        client.upload_dataset(path, "safetensors", chunk_bytes=20_000, on_progress=cut)
    sent: list[int] = []
    dataset = client.upload_dataset(path, "safetensors", chunk_bytes=20_000, on_progress=lambda s, _: sent.append(s))
    assert dataset["status"] == "ready" and sent[0] == 40_000  # the first piece was not sent again
    assert len(client.datasets()) == 2


def test_what_a_developer_trains_on_is_uploaded_and_named_by_the_trainer(
    live_server, user: User, tmp_path: Path
) -> None:
    """DistributedTrainer.train(dataset=...): tensors, a torch Dataset and a text file are uploaded and the job's
    dataset config names the upload; an uploaded dataset's id is named as it is."""
    client = ArceusClient(live_server.url, user_token_get_or_create(user=user))
    x, y = torch.rand(50, 8), torch.arange(50) % 3
    pair = dataset_config_for((x, y), client)
    assert pair == {"name": "uploaded", "dataset_id": pair["dataset_id"]}
    detail = client.dataset(pair["dataset_id"])
    assert (detail["status"], detail["format"], detail["facts"]["samples"]) == ("ready", "safetensors", 50)
    samples = dataset_config_for(torch.utils.data.TensorDataset(x, y), client)
    assert client.dataset(samples["dataset_id"])["format"] == "npz"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("words of a corpus\n" * 100)
    text = dataset_config_for(corpus, client)
    assert text["name"] == "text" and client.dataset(text["dataset_id"])["format"] == "text"
    assert dataset_config_for(pair["dataset_id"], client) == pair
    with pytest.raises(TypeError, match="cannot upload a int"):
        dataset_config_for(7, client)


def test_the_admin_shows_datasets_read_only(api: APIClient, client) -> None:  # noqa: ANN001
    dataset = upload(api, tensor_file())
    client.force_login(User.objects.create_superuser("root", password="root-password"))
    listing = client.get("/admin/datasets/dataset/")
    assert listing.status_code == 200 and "mine" in listing.content.decode()
    page = client.get(f"/admin/datasets/dataset/{dataset['id']}/change/")
    assert page.status_code == 200 and dataset["sha256"] in page.content.decode()
    assert client.post(f"/admin/datasets/dataset/{dataset['id']}/change/", {"name": "renamed"}).status_code == 403
