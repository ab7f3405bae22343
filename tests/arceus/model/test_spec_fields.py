"""The model config checks every architecture shares (arceus/model/spec_fields.py): a GPT and a Llama refuse a
size, a vocabulary and an unknown key in the same words, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config

GPT = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 8, "block_size": 8, "vocab_size": 5}
LLAMA = {"type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "max_position_embeddings": 8, "vocab_size": 5}


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"vocab_size": True}, "vocab_size", "must be a positive integer, got True"),
    ({"vocab_size": 0}, "vocab_size", "must be between 1 and 1,000,000, got 0"),
    ({"vocab_size": 10**7}, "vocab_size", "must be between 1 and 1,000,000, got 10,000,000"),
    ({"vocab_size": 5.0}, "vocab_size", "must be a positive integer, got 5.0"),
    ({"vocab": "words"}, "vocab", "must be one of"),
    ({"vocab_size": None}, "vocab_size", "is required; job submission fills it in"),
    ({"dropout": 0.1}, "dropout", "unknown key for a"),
])
@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_gpt_and_llama_refuse_alike(config: dict[str, Any], change: dict[str, Any], field: str, message: str) -> None:
    changed = {k: v for k, v in {**config, **change}.items() if v is not None}
    with pytest.raises(SpecError) as refused:
        model_spec_from_config(changed)
    assert refused.value.field == f"model_config.{field}" and message in refused.value.message


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_a_size_takes_its_architectures_own_limit(config: dict[str, Any]) -> None:
    layers = "n_layer" if config is GPT else "num_hidden_layers"
    with pytest.raises(SpecError) as refused:
        model_spec_from_config({**config, layers: 257})
    assert refused.value.message == "must be between 1 and 256, got 257"
    assert model_spec_from_config(config).vocab_size == 5
