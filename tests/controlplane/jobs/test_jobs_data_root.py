"""A tenant's dataset file is named relative to the operator's data root and never leaves it: NUL characters,
server paths and `..` are a 400 naming the field and the rule; every other path the tenant may not read (missing,
a symlink out of the root or in a loop, a directory, a FIFO, unreadable) gets one and the same 400, so refusals
do not tell which files exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db

GPT = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 8, "block_size": 8}


def post(api: APIClient, dataset: dict, path: str = "/api/jobs") -> dict:
    return api.post(path, {"model_config": GPT, "dataset_config": dataset}, format="json")


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        ("/etc/passwd", "must be a relative path"),
        ("/proc/self/environ", "must be a relative path"),
        ("~/.bashrc", "must be a relative path"),
        ("../outside.txt", "may not contain '..'"),
        ("books/../../outside.txt", "may not contain '..'"),
    ],
)
@pytest.mark.parametrize("path", ["/api/jobs", "/api/jobs/estimate"])
def test_a_path_out_of_the_data_root_is_refused_naming_the_field_and_rule(
    api: APIClient, data_root: Path, source: str, rule: str, path: str
) -> None:
    response = post(api, {"name": "text", "source": source}, path)
    assert response.status_code == 400, response.json()
    [message] = response.json()["errors"]["dataset_config.source"]
    assert rule in message and "data root" in message
    assert not Job.objects.exists()


@pytest.mark.parametrize(("name", "field"), [("text", "source"), ("MNIST", "path")])
def test_a_nul_character_in_a_path_is_a_400_naming_the_field(api: APIClient, data_root: Path, name: str,
                                                             field: str) -> None:
    (data_root / "books").mkdir()
    response = post(api, {"name": name, field: "books\x00/abcd.txt"})
    assert response.status_code == 400, response.content
    assert "NUL character" in response.json()["errors"][f"dataset_config.{field}"][0]


def unreadable_paths(data_root: Path) -> list[str]:
    """Names in the data root that a tenant may not read, for every reason there is (the file outside it exists)."""
    outside = data_root.parent / "outside.txt"
    outside.write_text("secret " * 100, encoding="utf-8")
    (data_root / "books").mkdir()
    (data_root / "escape.txt").symlink_to(outside)
    (data_root / "linked-dir").symlink_to(data_root.parent, target_is_directory=True)
    (data_root / "loop-a").symlink_to(data_root / "loop-b")
    (data_root / "loop-b").symlink_to(data_root / "loop-a")
    os.mkfifo(data_root / "fifo")
    (data_root / "locked.txt").write_text("abcd" * 200, encoding="utf-8")
    (data_root / "locked.txt").chmod(0)
    names = ["missing.txt", "escape.txt", "linked-dir/outside.txt", "loop-a", "books", "fifo"]
    return names if os.geteuid() == 0 else [*names, "locked.txt"]  # root reads a file of mode 000


@pytest.mark.parametrize("path", ["/api/jobs", "/api/jobs/estimate"])
def test_every_path_a_tenant_may_not_read_gets_the_same_refusal(api: APIClient, data_root: Path, path: str) -> None:
    for source in unreadable_paths(data_root):
        response = post(api, {"name": "text", "source": source}, path)
        assert response.status_code == 400, (source, response.json())
        [message] = response.json()["errors"]["dataset_config.source"]
        assert message == f"no readable file {source!r} in the data root: name a file under it"
    assert not Job.objects.exists()


def test_an_mnist_directory_out_of_the_data_root_is_refused(api: APIClient, data_root: Path) -> None:
    model = {"type": "mlp", "layer_sizes": [784, 10]}
    (data_root / "digits").mkdir()
    (data_root / "digits" / "train-images-idx3-ubyte").symlink_to(data_root.parent / "secret-images")
    (data_root.parent / "secret-images").write_bytes(b"\0" * 64)
    for path, rule in (
        ("/etc", "must be a relative path"), ("..", "may not contain '..'"),
        ("missing", "no readable directory 'missing' in the data root"),
        ("digits", "no readable file 'digits/train-images-idx3-ubyte' in the data root"),
    ):
        response = api.post(
            "/api/jobs", {"model_config": model, "dataset_config": {"name": "MNIST", "path": path}}, format="json"
        )
        assert response.status_code == 400
        assert rule in response.json()["errors"]["dataset_config.path"][0]


def test_a_file_in_the_data_root_and_the_bundled_text_are_taken(
    api: APIClient, data_root: Path, estimate_of
) -> None:  # noqa: ANN001
    (data_root / "books").mkdir()
    (data_root / "books" / "abcd.txt").write_text("abcd" * 200, encoding="utf-8")
    (data_root / "alias.txt").symlink_to(data_root / "books" / "abcd.txt")  # a link that stays inside is fine
    for source in ("books/abcd.txt", "alias.txt"):
        response = post(api, {"name": "text", "source": source})
        assert response.status_code == 201, response.json()
        assert response.json()["model_config"]["vocab_size"] == 4  # the file was read
    assert post(api, {"name": "text"}).status_code == 201  # the bundled text needs no root
    body = estimate_of({"model_config": GPT, "dataset_config": {"name": "text", "source": "books/abcd.txt"}})
    assert body["status"] == "done", body  # the worker reads it too (no node to place on: not feasible)
