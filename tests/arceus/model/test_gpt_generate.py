"""Sampling text from a trained GPT (or Llama): a model that learned a repeating text continues it."""

from __future__ import annotations

import pytest

from arceus.data.tokenizer import CharTokenizer
from arceus.model.generate import sample_text
from tests.arceus.model.pattern_training import trained_on

VOCAB = CharTokenizer("abcd")
CONFIG = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 4}
LLAMA = {
    "type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 8, "vocab_size": 4,
}


@pytest.mark.parametrize("config", [CONFIG, LLAMA], ids=["gpt", "llama"])
def test_a_model_that_learned_a_pattern_continues_it(config: dict) -> None:
    weights = trained_on(config, (0, 1, 2, 3))
    text = sample_text(config, weights, VOCAB, prompt="bc", length=20, temperature=0)
    assert text == "bc" + "dabc" * 5
    sampled = sample_text(config, weights, VOCAB, prompt="a", length=30, temperature=1.0, seed=3)
    assert len(sampled) == 31 and set(sampled) <= set("abcd")
    assert sampled == sample_text(config, weights, VOCAB, prompt="a", length=30, temperature=1.0, seed=3)


def test_mismatches_are_value_errors() -> None:
    weights = trained_on(CONFIG, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="the tokenizer 5"):
        sample_text(CONFIG, weights, CharTokenizer("abcde"), prompt="a")
    with pytest.raises(ValueError, match="'z' is not in the vocabulary"):
        sample_text(CONFIG, weights, VOCAB, prompt="z")
    with pytest.raises(ValueError, match="only a llama or transformer model generates text"):
        sample_text({"layer_sizes": [4, 4]}, weights, VOCAB)
