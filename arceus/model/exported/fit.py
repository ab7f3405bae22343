"""An exported model against its dataset: its input must be the dataset's samples and its logits its classes."""

from __future__ import annotations

from typing import Any

from arceus.data import validate_dataset_config
from arceus.data.config import dataset_info
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError
from arceus.model.exported.spec import ExportedSpec, exported_from_config


def fit_exported_to_dataset(
    model_config: dict[str, Any], dataset_config: Any
) -> tuple[ExportedSpec, dict[str, Any], dict[str, Any]]:
    spec = exported_from_config(model_config)
    dataset = validate_dataset_config(dataset_config)
    name = dataset["name"]
    if name == TEXT_DATASET:
        raise SpecError("dataset_config.name", "an exported model trains on a dataset of feature rows and classes")
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
