"""Check a job's model against its dataset and complete what one takes from the other.

A character-level transformer takes its `vocab_size` from the text's distinct characters, a BPE one its
size from the model config (1024 if left out); the text dataset takes its `block_size`, `vocab` and
`vocab_size` from the model, so both stored configs are complete and agree.
"""

from __future__ import annotations

from typing import Any, cast

from arceus.data.config import DATASETS
from arceus.data.text import text_vocabulary
from arceus.data.text_config import TEXT_DATASET
from arceus.data.tokenizer import BPE_DEFAULT_VOCAB, check_vocab
from arceus.errors import SpecError
from arceus.model.spec import GPTSpec, MLPSpec, ModelSpec, model_spec_from_config


def fit_model_to_dataset(
    model_config: Any, dataset: dict[str, Any]
) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    """(spec, completed model_config, completed dataset config) for a validated dataset config; raises
    SpecError naming the field that does not fit."""
    is_transformer = isinstance(model_config, dict) and str(model_config.get("type", "")).lower() == "transformer"
    if not is_transformer:
        spec = model_spec_from_config(model_config)
        if isinstance(spec, MLPSpec):
            _check_mlp(spec, dataset["name"])
        return spec, model_config, dataset
    if dataset["name"] != TEXT_DATASET:
        raise SpecError(
            "dataset_config.name", f"a transformer trains on the {TEXT_DATASET} dataset, got {dataset['name']}"
        )
    vocab = model_config.get("vocab", "char")
    if vocab == "bpe":
        vocab_size = model_config.get("vocab_size", BPE_DEFAULT_VOCAB)
        check_vocab(vocab, vocab_size, prefix="model_config")
    else:
        check_vocab(vocab, None, prefix="model_config")
        vocab_size = len(text_vocabulary(dataset))
    model_config = {**model_config, "vocab_size": model_config.get("vocab_size", vocab_size)}
    spec = cast(GPTSpec, model_spec_from_config(model_config))
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
            f"is {block} but the model's block_size is {spec.block_size}; leave it out to take the model's",
        )
    return spec, model_config, {**dataset, "block_size": block}


def _check_mlp(spec: MLPSpec, dataset_name: str) -> None:
    if dataset_name == TEXT_DATASET:
        raise SpecError("model_config.type", f"the {TEXT_DATASET} dataset needs a transformer, got an mlp")
    info = DATASETS[dataset_name]
    last = len(spec.layer_sizes) - 1
    if spec.input_features != info.features:
        raise SpecError(
            "model_config.layer_sizes[0]",
            f"is {spec.input_features} but {dataset_name} samples have {info.features} features; "
            f"make the first size {info.features}",
        )
    if spec.output_features != info.classes:
        raise SpecError(
            f"model_config.layer_sizes[{last}]",
            f"is {spec.output_features} but {dataset_name} has {info.classes} classes; "
            f"make the last size {info.classes}",
        )
