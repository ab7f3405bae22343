"""The model registry: `model_config.type` → the architecture that parses, fits and splits it (torch-free).

This is the one place that knows which architectures exist. Everything else (the control plane, the
driver, the agents) asks the registry or the spec, so a new architecture is one folder under
`arceus/model/` plus one line in `ARCHITECTURES` below and one in `arceus.model.build.LAYERS` (its torch layers).
"""

from __future__ import annotations

from typing import Any

from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError
from arceus.model import convnet, exported, gpt, llama, mlp
from arceus.model.architecture import Architecture, TensorParallelSplit
from arceus.model.layout import TensorLayout
from arceus.model.spec import ModelSpec

DEFAULT_TYPE = "mlp"  # what a model_config without "type" is


# In the order they were added; error messages list them so.
ARCHITECTURES: dict[str, Architecture] = {
    a.type: a
    for a in (
        mlp.ARCHITECTURE,
        gpt.ARCHITECTURE,
        convnet.ARCHITECTURE,
        llama.ARCHITECTURE,
        exported.ARCHITECTURE,
    )
}


def architecture_for_config(model_config: Any) -> Architecture:
    """The architecture `model_config.type` names; SpecError for anything else."""
    if not isinstance(model_config, dict):
        raise SpecError("model_config", f"must be a JSON object, got {type(model_config).__name__}")
    model_type = model_config.get("type", DEFAULT_TYPE)
    if not isinstance(model_type, str) or model_type.lower() not in ARCHITECTURES:
        raise SpecError(
            "model_config.type",
            f"unknown model type {model_type!r}; supported: {', '.join(ARCHITECTURES)}",
        )
    return ARCHITECTURES[model_type.lower()]


def dataset_config_defaulted(model_config: Any, dataset_config: Any) -> Any:
    """A model that writes text trains on the text dataset, so its `dataset_config` may leave out `name` (the
    prototype's `{"source": ...}`); anything else is returned as it is. SpecError for an unknown model type."""
    if isinstance(dataset_config, dict) and "name" not in dataset_config and architecture_for_config(
        model_config
    ).writes_text:
        return {**dataset_config, "name": TEXT_DATASET}
    return dataset_config


def architecture_of(spec: ModelSpec) -> Architecture:
    return ARCHITECTURES[spec.type]


def model_spec_from_config(model_config: Any) -> ModelSpec:
    """Validate a job's `model_config` and return its spec; raises SpecError naming the bad field."""
    return architecture_for_config(model_config).from_config(model_config)


def fit_model_to_dataset(
    model_config: Any, dataset_config: Any
) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    """(spec, completed model_config, completed dataset config): the model checked against its dataset,
    each completed from the other; raises SpecError naming the field that does not fit."""
    return architecture_for_config(model_config).fit_dataset(model_config, dataset_config)


def text_writers() -> list[str]:
    """The model types that write text."""
    return sorted(a.type for a in ARCHITECTURES.values() if a.writes_text)


def tensor_parallel_split(spec: ModelSpec) -> TensorParallelSplit:
    """How `spec`'s architecture splits; SpecError("tensor_parallel") naming the ones that do when it cannot."""
    split = architecture_of(spec).tensor_parallel
    if split is None:
        splittable = [a.type for a in ARCHITECTURES.values() if a.tensor_parallel is not None]
        owners = " or ".join(f"a {t}'s" for t in splittable)
        raise SpecError(
            "tensor_parallel",
            f"only {owners} blocks split across nodes; use model_config.type "
            + " or ".join(f'"{t}"' for t in splittable)
            + " or drop tensor_parallel",
        )
    return split


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """SpecError ("tensor_parallel", or "tensor_parallel.size") unless `spec` splits over `size` ranks."""
    tensor_parallel_split(spec).check_size(spec, size)


def reduced_layout(spec: ModelSpec) -> TensorLayout:
    """What the ranks of a split stage all-reduce, per sample."""
    return tensor_parallel_split(spec).reduced_layout(spec)
