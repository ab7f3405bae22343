"""An MLP against its dataset: its first and last sizes must be the dataset's features and classes."""

from __future__ import annotations

from typing import Any

from arceus.data.config import dataset_info, validate_dataset_config
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError
from arceus.model.mlp.spec import MLPSpec, mlp_from_config


def fit_mlp_to_dataset(
    model_config: dict[str, Any], dataset_config: Any
) -> tuple[MLPSpec, dict[str, Any], dict[str, Any]]:
    spec = mlp_from_config(model_config)  # the model's own errors come before its dataset's
    dataset = validate_dataset_config(dataset_config)
    name = dataset["name"]
    if name == TEXT_DATASET:
        raise SpecError("model_config.type", f"the {TEXT_DATASET} dataset needs a transformer, got an mlp")
    info = dataset_info(dataset)
    name = info.name
    last = len(spec.layer_sizes) - 1
    if spec.input_features != info.features:
        raise SpecError(
            "model_config.layer_sizes[0]",
            f"is {spec.input_features} but {name} samples have {info.features} features; "
            f"make the first size {info.features}",
        )
    if spec.output_features != info.classes:
        raise SpecError(
            f"model_config.layer_sizes[{last}]",
            f"is {spec.output_features} but {name} has {info.classes} classes; make the last size {info.classes}",
        )
    return spec, model_config, dataset
