"""Validation of a job's `dataset_config`, shared by the control plane (at submit) and the driver."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from arceus.data.formats import check_dataset_id
from arceus.data.text_config import TEXT_DATASET, TEXT_KEYS, validate_text_config
from arceus.errors import SpecError

# Opens the file a validated config naming an upload reads its samples from (the control plane's storage), for
# reading and seeking: an uploaded tensor file, or an uploaded text's token file (arceus.data.token_file), which
# the control plane tokenizes first where no job did yet.
DatasetOpener = Callable[[dict[str, Any]], BinaryIO]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    features: int
    classes: int
    # The samples are images of (channels, height, width), flattened row by row into `features`.
    image_shape: tuple[int, int, int]


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo("digits", features=64, classes=10, image_shape=(1, 8, 8)),
    "MNIST": DatasetInfo("MNIST", features=784, classes=10, image_shape=(1, 28, 28)),
}
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
DEFAULT_BATCH_SIZE = 32
DEFAULT_VAL_BATCH_SIZE = 256
MAX_BATCH_SIZE = 65536
_KEYS = frozenset({"name", "batch_size", "val_batch_size", "normalize", "path"})
# An uploaded tensor dataset (arceus.data.formats): named by `dataset_id`; the control plane fills in its facts
# from the upload (whatever a tenant sends for them is replaced), so the model fits it without reading it.
UPLOADED_DATASET = "uploaded"
TENSOR_FACTS = frozenset({"kind", "format", "samples", "features", "classes", "image_shape"})
_UPLOADED_KEYS = frozenset({"name", "batch_size", "val_batch_size", "dataset_id"}) | TENSOR_FACTS


def validate_dataset_config(cfg: Any) -> dict[str, Any]:
    """Return a normalised copy of `cfg` with defaults filled in; raise SpecError naming the bad field."""
    if not isinstance(cfg, dict):
        raise SpecError("dataset_config", f"must be a JSON object, got {type(cfg).__name__}")
    known = _KEYS | TEXT_KEYS | _UPLOADED_KEYS
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise SpecError(f"dataset_config.{unknown[0]}", f"unknown key; allowed keys: {', '.join(sorted(known))}")
    if isinstance(cfg.get("name"), str) and cfg["name"].lower() == TEXT_DATASET:
        batch_size = _batch_size(cfg, "batch_size", DEFAULT_BATCH_SIZE)
        return validate_text_config(cfg, batch_size, _batch_size(cfg, "val_batch_size", DEFAULT_VAL_BATCH_SIZE))
    if isinstance(cfg.get("name"), str) and cfg["name"].lower() == UPLOADED_DATASET:
        return _uploaded_config(cfg)
    unknown = sorted(set(cfg) - _KEYS)
    if unknown:
        raise SpecError(f"dataset_config.{unknown[0]}", f"only applies to the {TEXT_DATASET} dataset")
    info = _dataset_info(cfg.get("name"))
    out: dict[str, Any] = {
        "name": info.name,
        "batch_size": _batch_size(cfg, "batch_size", DEFAULT_BATCH_SIZE),
        "val_batch_size": _batch_size(cfg, "val_batch_size", DEFAULT_VAL_BATCH_SIZE),
    }
    if "normalize" in cfg:
        out["normalize"] = _normalize(cfg["normalize"], info.features)
    if info.name == "MNIST":
        if "path" in cfg:
            if not isinstance(cfg["path"], str) or not cfg["path"]:
                raise SpecError("dataset_config.path", "must be a non-empty directory path")
            out["path"] = cfg["path"]
        missing_mnist_files(mnist_dir(out), raise_error=True)
    elif "path" in cfg:
        raise SpecError("dataset_config.path", f"only applies to MNIST; {info.name} is bundled")
    return out


def dataset_info(cfg: dict[str, Any]) -> DatasetInfo:
    """What a validated non-text dataset config's samples are: a bundled dataset's, or an upload's facts."""
    if cfg["name"] != UPLOADED_DATASET:
        return DATASETS[cfg["name"]]
    if "features" not in cfg:
        raise SpecError("dataset_config.dataset_id", "names an upload the control plane has not resolved")
    shape = cfg.get("image_shape") or [1, 1, cfg["features"]]
    return DatasetInfo(f"dataset {cfg['dataset_id']}", cfg["features"], cfg["classes"], tuple(shape))


def _uploaded_config(cfg: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(cfg) - _UPLOADED_KEYS)
    if unknown:
        raise SpecError(f"dataset_config.{unknown[0]}", f"does not apply to an {UPLOADED_DATASET} dataset")
    out: dict[str, Any] = {
        "name": UPLOADED_DATASET,
        "dataset_id": check_dataset_id(cfg),
        "batch_size": _batch_size(cfg, "batch_size", DEFAULT_BATCH_SIZE),
        "val_batch_size": _batch_size(cfg, "val_batch_size", DEFAULT_VAL_BATCH_SIZE),
    }
    facts = {key: cfg[key] for key in TENSOR_FACTS if key in cfg}
    if facts and facts.get("kind") != "tensors":
        raise SpecError("dataset_config.dataset_id", "names a text dataset; train a text model on it (name: text)")
    return out | facts


def mnist_dir(cfg: dict[str, Any]) -> Path:
    """Where the MNIST IDX files live: `path`, else $ARCEUS_DATA_DIR/mnist, else ./data/mnist."""
    if cfg.get("path"):
        return Path(cfg["path"]).expanduser()
    return Path(os.environ.get("ARCEUS_DATA_DIR") or "data") / "mnist"


def idx_file(directory: Path, base: str) -> Path | None:
    """The file for `base` in `directory`, uncompressed or .gz; None if neither exists."""
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def missing_mnist_files(directory: Path, *, raise_error: bool = False) -> list[str]:
    missing = [base for base in MNIST_FILES if idx_file(directory, base) is None]
    if missing and raise_error:
        raise SpecError(
            "dataset_config.path",
            f"MNIST files missing in {directory.resolve()}: {', '.join(missing)} (each may also be .gz); "
            "set dataset_config.path or ARCEUS_DATA_DIR (which holds mnist/) to where they are",
        )
    return missing


def _dataset_info(name: Any) -> DatasetInfo:
    choices = ", ".join([*DATASETS, TEXT_DATASET, UPLOADED_DATASET])
    if name is None:
        raise SpecError("dataset_config.name", f"is required; one of: {choices}")
    if isinstance(name, str):
        for key, info in DATASETS.items():
            if name.lower() == key.lower():
                return info
    raise SpecError("dataset_config.name", f"unknown dataset {name!r}; one of: {choices}")


def _batch_size(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"dataset_config.{key}", f"must be a positive integer, got {value!r}")
    if not 1 <= value <= MAX_BATCH_SIZE:
        raise SpecError(f"dataset_config.{key}", f"must be between 1 and {MAX_BATCH_SIZE}, got {value}")
    return value


def _normalize(value: Any, features: int) -> dict[str, list[float]]:
    if not isinstance(value, dict) or set(value) != {"mean", "std"}:
        raise SpecError("dataset_config.normalize", 'must be an object {"mean": [...], "std": [...]}')
    out: dict[str, list[float]] = {}
    for key in ("mean", "std"):
        field = f"dataset_config.normalize.{key}"
        raw = value[key]
        items = raw if isinstance(raw, list) else [raw]
        if len(items) not in (1, features):
            raise SpecError(
                field, f"needs 1 value (for every feature) or {features} (one per feature), got {len(items)}"
            )
        numbers = []
        for index, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
                raise SpecError(f"{field}[{index}]", f"must be a finite number, got {item!r}")
            if key == "std" and item <= 0:
                raise SpecError(f"{field}[{index}]", f"must be greater than 0, got {item}")
            numbers.append(float(item))
        out[key] = numbers
    return out
