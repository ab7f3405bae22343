"""An exported model against its dataset: its input must be the dataset's samples and its logits its classes; on
a text, a window of token ids in and a prediction of the next token at every position out (a language model)."""

from __future__ import annotations

from typing import Any

from arceus.data.config import dataset_info, validate_dataset_config
from arceus.data.text_config import TEXT_DATASET, text_vocabulary
from arceus.errors import SpecError
from arceus.model.exported.spec import ExportedSpec, exported_from_config


def fit_exported_to_dataset(
    model_config: dict[str, Any], dataset_config: Any
) -> tuple[ExportedSpec, dict[str, Any], dict[str, Any]]:
    spec = exported_from_config(model_config)
    dataset = validate_dataset_config(dataset_config)
    name = dataset["name"]
    if name == TEXT_DATASET:
        return spec, model_config, _fit_text(spec, dataset)
    info = dataset_info(dataset)
    name = info.name
    if spec.input.dtype != "float32" or spec.input.shape != (info.features,):
        raise SpecError(
            "model_config.input",
            f"is {spec.input.dtype} {list(spec.input.shape)} per sample but {name} samples are float32 "
            f"[{info.features}]; capture the model on a batch of {name}'s rows",
        )
    if spec.labels.shape != () or spec.labels.bound != info.classes:
        raise SpecError(
            "model_config.labels",
            f"the model's logits have {spec.labels.bound} classes (shape {list(spec.labels.shape)}) but {name} has "
            f"{info.classes} classes, one label per sample",
        )
    return spec, model_config, dataset


def _fit_text(spec: ExportedSpec, dataset: dict[str, Any]) -> dict[str, Any]:
    """The text dataset read as the captured language model reads it: windows of its input's length, token ids
    below its input's bound (a char vocabulary's size, or a BPE vocabulary's `vocab_size` in the dataset config)."""
    if spec.input.dtype != "int64" or len(spec.input.shape) != 1 or spec.labels.shape != spec.input.shape:
        raise SpecError(
            "model_config.input",
            f"is {spec.input.dtype} {list(spec.input.shape)} per sample with labels {list(spec.labels.shape)}; on a "
            "text, capture a language model on int64 token ids [batch, positions] (input_bound: the vocabulary's "
            "size) returning logits [batch, positions, vocabulary]",
        )
    bound = spec.input.bound
    if dataset.get("vocab", "char") == "bpe":
        if dataset.get("vocab_size") != bound:
            raise SpecError("dataset_config.vocab_size", f"must be the model's input bound, {bound}, for a bpe vocab")
        if dataset.get("tokenizer_vocab_size", 0) > bound:
            raise SpecError("dataset_config.tokenizer_id",
                            f"the tokenizer has {dataset['tokenizer_vocab_size']} tokens, the model reads {bound}")
    elif (size := len(text_vocabulary(dataset))) != bound:
        raise SpecError("model_config.input", f"reads ids below {bound} but the text has {size} distinct "
                                              f"characters: capture the model with input_bound={size}")
    if spec.labels.bound != bound:
        raise SpecError("model_config.labels", f"the logits have {spec.labels.bound} classes; a language model's are "
                                               f"its vocabulary's {bound}")
    (positions,) = spec.input.shape
    if dataset.get("block_size", positions) != positions:
        raise SpecError("dataset_config.block_size", f"is {dataset['block_size']} but the model reads windows of "
                                                     f"{positions} tokens; leave it out")
    return {**dataset, "block_size": positions}
