"""Fixtures shared by the GPT training tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from arceus.data.config import validate_dataset_config
from arceus.data.text_config import BUNDLED_TEXT
from arceus.model.registry import fit_model_to_dataset

SmallText = Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory: pytest.TempPathFactory) -> SmallText:
    """fit(model_config) -> (model, dataset) as job submission completes them (vocab_size, block_size), on
    the bundled text's first 6000 characters: an epoch of a few hundred windows, fast enough for tests."""
    source = tmp_path_factory.mktemp("text") / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    dataset = validate_dataset_config({"name": "text", "source": str(source), "batch_size": 16, "val_batch_size": 32})

    def fit(model_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        _, model, fitted = fit_model_to_dataset(model_config, dataset)
        return model, fitted

    return fit
