"""Reads of uploaded datasets: a tenant's own (others' are 404s), a job's dataset config resolved against them,
and a ready dataset's file opened for a job's driver."""

from __future__ import annotations

from typing import Any, BinaryIO

from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import QuerySet

from arceus.data.config import TENSOR_FACTS, UPLOADED_DATASET
from arceus.data.text_config import TEXT_DATASET, TEXT_FACTS
from controlplane.common.errors import ApplicationError, one_by_id
from controlplane.datasets.models import Dataset, DatasetStatus, dataset_storage


def dataset_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Dataset]:
    return Dataset.objects.filter(owner=user)


def dataset_get_for_user(*, user: AbstractBaseUser, dataset_id: Any) -> Dataset:
    """The user's dataset; 404 for a malformed id and for another user's alike (ids cannot be probed)."""
    return one_by_id(dataset_list_for_user(user=user), "dataset", dataset_id)


def dataset_config_resolved(*, owner: AbstractBaseUser, dataset_config: Any) -> Any:
    """`dataset_config` with the facts of the uploads it names (`dataset_id`, `tokenizer_id`) filled in from
    the owner's ready datasets, replacing whatever was sent for them; a config naming none is returned as it is."""
    if not isinstance(dataset_config, dict) or "dataset_id" not in dataset_config:
        return dataset_config
    name = str(dataset_config.get("name", "")).lower()
    out = {k: v for k, v in dataset_config.items() if k not in TENSOR_FACTS | TEXT_FACTS}
    dataset = _ready(owner, dataset_config["dataset_id"], "dataset_id")
    kind = dataset.facts["kind"]
    expected = {"tensors": UPLOADED_DATASET, "text": TEXT_DATASET}.get(kind)
    if expected is None:
        raise ApplicationError.invalid(
            "dataset_config.dataset_id", f"dataset {dataset.pk} is a {kind}; name it as a text dataset's tokenizer_id"
        )
    if not name:  # a text model's dataset may leave its name out (arceus.model.registry.dataset_config_defaulted)
        out["name"] = name = expected
    if name != expected:
        raise ApplicationError.invalid("dataset_config.name", f"dataset {dataset.pk} is {kind}: name it {expected!r}")
    out |= {"format": dataset.format, **dataset.facts}
    if kind == "text":
        out["column"] = dataset.column
    if "tokenizer_id" in dataset_config:
        tokenizer = _ready(owner, dataset_config["tokenizer_id"], "tokenizer_id")
        if tokenizer.facts["kind"] != "tokenizer":
            raise ApplicationError.invalid("dataset_config.tokenizer_id", f"dataset {tokenizer.pk} is not a tokenizer")
        out["tokenizer_vocab_size"] = tokenizer.facts["vocab_size"]
    return out


def _ready(owner: AbstractBaseUser, dataset_id: Any, key: str) -> Dataset:
    try:
        dataset = dataset_get_for_user(user=owner, dataset_id=dataset_id)
    except ApplicationError:
        raise ApplicationError.invalid(f"dataset_config.{key}", f"you have no dataset {dataset_id}") from None
    if dataset.status != DatasetStatus.READY:
        raise ApplicationError.invalid(
            f"dataset_config.{key}", f"dataset {dataset_id} is {dataset.status}; complete its upload first"
        )
    return dataset


def dataset_open(*, owner_id: Any, dataset_id: str) -> BinaryIO:
    """A ready dataset's file of this owner, opened for reading (seekable; S3 spools it to disk)."""
    dataset = Dataset.objects.filter(pk=dataset_id, owner_id=owner_id, status=DatasetStatus.READY).first()
    if dataset is None:
        raise ApplicationError.not_found("dataset", dataset_id)
    return dataset_storage().open(dataset.file.name, "rb")
