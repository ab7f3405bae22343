"""A model that writes text (a GPT, a Llama) against its text: a character-level model takes its `vocab_size`
from the text's distinct characters, a BPE one its size from the model config (1024 if left out); the text
dataset takes its `block_size`, `vocab` and `vocab_size` from the model, so both stored configs are complete
and agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from arceus.data.config import validate_dataset_config
from arceus.data.text_config import TEXT_DATASET, text_vocabulary
from arceus.data.tokenizer import BPE_DEFAULT_VOCAB, check_vocab
from arceus.errors import SpecError
from arceus.model.spec import TextModelSpec


def fit_text_model(
    model_config: dict[str, Any],
    dataset_config: Any,
    *,
    from_config: Callable[[dict[str, Any]], TextModelSpec],
    block_key: str,
) -> tuple[TextModelSpec, dict[str, Any], dict[str, Any]]:
    """The spec `from_config` parses, fitted to its text dataset (a sample is `block_key` tokens, the
    model's key for its context); the dataset is validated first: the model's vocabulary comes from it."""
    dataset = validate_dataset_config(dataset_config)
    if dataset["name"] != TEXT_DATASET:
        raise SpecError(
            "dataset_config.name",
            f"a {model_config.get('type')} trains on the {TEXT_DATASET} dataset, got {dataset['name']}",
        )
    vocab = model_config.get("vocab", "char")
    uploaded_size = dataset.get("tokenizer_vocab_size")  # an uploaded tokenizer.json's (arceus.data.formats)
    if uploaded_size is not None and vocab != "bpe":
        raise SpecError("model_config.vocab", "an uploaded tokenizer (dataset_config.tokenizer_id) needs vocab bpe")
    if vocab == "bpe":
        vocab_size = model_config.get("vocab_size", uploaded_size or BPE_DEFAULT_VOCAB)
        check_vocab(vocab, vocab_size, prefix="model_config")
        if uploaded_size is not None and vocab_size < uploaded_size:
            raise SpecError(
                "model_config.vocab_size", f"is {vocab_size} but the uploaded tokenizer has {uploaded_size} tokens"
            )
    else:
        check_vocab(vocab, None, prefix="model_config")
        vocab_size = len(text_vocabulary(dataset))
    model_config = {**model_config, "vocab_size": model_config.get("vocab_size", vocab_size)}
    spec = from_config(model_config)
    if spec.vocab_size != vocab_size:
        raise SpecError(
            "model_config.vocab_size",
            f"is {spec.vocab_size} but the text has {vocab_size} distinct characters; "
            "leave it out to take the text's",
        )
    # The dataset loads tokens as the model reads them: its vocab fields are the model's (absent: char).
    wanted = {"vocab": vocab, "vocab_size": vocab_size} if vocab == "bpe" else {}
    for key in ("vocab", "vocab_size"):
        if key in dataset and dataset[key] != wanted.get(key):
            raise SpecError(
                f"dataset_config.{key}",
                f"is {dataset[key]!r} but the model's is {wanted.get(key, 'char')!r}; leave it out",
            )
    dataset = {**dataset, **wanted}
    block = dataset.get("block_size", spec.block_size)
    if block != spec.block_size:
        raise SpecError(
            "dataset_config.block_size",
            f"is {block} but the model's {block_key} is {spec.block_size}; leave it out to take the model's",
        )
    return spec, model_config, {**dataset, "block_size": block}

