"""A CNN against its dataset: it takes `input_shape` and `classes` from the image dataset it trains on."""

from __future__ import annotations

from typing import Any

from arceus.data.config import DATASETS, dataset_info, validate_dataset_config
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError
from arceus.model.convnet.spec import ConvNetSpec, convnet_from_config


def fit_convnet_to_dataset(
    model_config: dict[str, Any], dataset_config: Any
) -> tuple[ConvNetSpec, dict[str, Any], dict[str, Any]]:
    """The dataset is validated first: the model's input shape and classes come from it."""
    dataset = validate_dataset_config(dataset_config)
    name = dataset["name"]
    if name == TEXT_DATASET:
        raise SpecError(
            "dataset_config.name", f"a convnet trains on an image dataset ({', '.join(DATASETS)}), got {name}"
        )
    info = dataset_info(dataset)
    name = info.name
    if name not in DATASETS and not dataset.get("image_shape"):
        raise SpecError(
            "dataset_config.dataset_id", f"{name}'s x is [samples, features]; a convnet needs images [N, C, H, W]"
        )
    wanted = {"input_shape": list(info.image_shape), "classes": info.classes}
    model_config = model_config | {key: model_config.get(key, value) for key, value in wanted.items()}
    spec = convnet_from_config(model_config)
    if list(spec.input_shape) != wanted["input_shape"]:
        raise SpecError(
            "model_config.input_shape",
            f"is {list(spec.input_shape)} but {name} images are {wanted['input_shape']}; "
            "leave it out to take the dataset's",
        )
    if spec.classes != info.classes:
        raise SpecError(
            "model_config.classes",
            f"is {spec.classes} but {name} has {info.classes} classes; leave it out to take the dataset's",
        )
    return spec, model_config, dataset
