"""An uploaded text tokenized once per tokenizer into a token file (arceus.data.token_file) stored beside it, and the
file a job's uploaded samples are read from (`dataset_samples_open`: the driver reads only its header, the stages
its rows by byte range, controlplane/jobs/dataset_reads.py).

The first job to train on a text with a tokenizer tokenizes it, in its driver's worker, before its first step; the
dataset's row stays locked while it does, so a second job's driver waits and then finds the file. The text streams
from storage a chunk at a time (an S3 object by ranged GETs) and the ids go to a temporary file first: memory stays
a piece's, however large the upload.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from typing import Any, BinaryIO

from django.core.files.base import File
from django.db import transaction

from arceus.data.config import UPLOADED_DATASET
from arceus.data.formats import DatasetFormatError
from arceus.data.token_file import token_file_key, tokens_write
from controlplane.common.errors import ApplicationError
from controlplane.common.uploads import storage_delete, storage_open_ranged
from controlplane.datasets.models import Dataset, DatasetStatus, TokenFile, dataset_storage, token_file_name

log = logging.getLogger(__name__)


def dataset_samples_open(*, owner_id: Any, dataset_config: dict[str, Any]) -> BinaryIO:
    """The file a validated config naming one of the owner's uploads reads its samples from, open by range: the
    tensor file, or the text's token file (tokenized first if no job did yet). 404 for a dataset that is gone."""
    if dataset_config["name"] == UPLOADED_DATASET:
        name = _ready(owner_id, dataset_config["dataset_id"]).file.name
    else:
        name = text_tokens_prepare(owner_id=owner_id, dataset_config=dataset_config).file.name
    handle, _ = storage_open_ranged(dataset_storage(), name)
    return handle


def text_tokens_prepare(*, owner_id: Any, dataset_config: dict[str, Any]) -> TokenFile:
    """The token file of the owner's ready text and tokenizer that a validated text config names, written now if
    there is none yet (once: a second caller waits on the dataset's row and finds it). 404 for a dataset or
    tokenizer that is gone; 400 for a text its tokenizer cannot encode."""
    key = token_file_key(dataset_config)
    with transaction.atomic():
        dataset = _ready(owner_id, dataset_config["dataset_id"], lock=True)
        existing = TokenFile.objects.filter(dataset=dataset, key=key).first()
        if existing is not None:
            return existing
        tokenizer = _ready(owner_id, dataset_config["tokenizer_id"]) if dataset_config.get("tokenizer_id") else None
        storage = dataset_storage()
        text, _ = storage_open_ranged(storage, dataset.file.name)
        with tempfile.TemporaryFile(prefix="arceus-tokens-") as out, contextlib.closing(text):
            try:  # the text is read a chunk (arceus.data.formats.CHUNK_BYTES) a read
                counts = tokens_write(dataset_config, text, out, open_tokenizer=lambda: _open(tokenizer))
            except (DatasetFormatError, ValueError) as exc:
                raise ApplicationError.invalid("dataset_config.dataset_id", f"dataset {dataset.pk}: {exc}") from exc
            out.seek(0)
            name = storage.save(token_file_name(dataset, key), File(out))
        transaction.on_commit(lambda: log.info("dataset %s tokenized by %s: %d + %d tokens", dataset.pk, key,
                                               counts.train, counts.validation))
        try:
            return TokenFile.objects.create(dataset=dataset, tokenizer=tokenizer, key=key, file=name,
                                            size_bytes=counts.size)
        except BaseException:
            storage_delete(storage, [name])
            raise


def _ready(owner_id: Any, dataset_id: Any, *, lock: bool = False) -> Dataset:
    rows = Dataset.objects.select_for_update() if lock else Dataset.objects
    dataset = rows.filter(pk=dataset_id, owner_id=owner_id, status=DatasetStatus.READY).first()
    if dataset is None:
        raise ApplicationError.not_found("dataset", dataset_id)
    return dataset


def _open(dataset: Dataset | None) -> BinaryIO:
    assert dataset is not None, "tokens_write opens a tokenizer only where the config names one"
    return dataset_storage().open(dataset.file.name, "rb")
