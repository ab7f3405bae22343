"""The spec of an exported model (a developer's `nn.Module` captured by `arceus.model.exported.capture`): what
every layer takes, hands on, holds and costs, as the capture measured it, and the SHA-256 of each layer's
shipped graph. Torch-free: the control plane places and checks the job from this alone; the graphs themselves
reach only the agents that build the layers (`attached`).

    {"type": "exported", "input": {"dtype": "float32", "shape": [64]},
     "labels": {"dtype": "int64", "shape": [], "bound": 10}, "program_sha256": "<hex>",
     "layers": [{"sha256": "<hex>", "output": {"dtype": "float32", "shape": [32]},
                 "parameters": {"fc.weight": [32, 64], "fc.bias": [32]},
                 "buffers": {"bn.running_mean": {"dtype": "float32", "shape": [32]}, ...},
                 "flops_per_sample": 4096, "stash_bytes_per_sample": 256}, ...]}

`buffers`: the layer's persistent buffers (state its forward updates, a BatchNorm's running statistics), which a
stage's state holds beside its weights; a layer without any may leave the key out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from arceus.errors import SpecError
from arceus.model.layout import TensorLayout
from arceus.model.spec import LayerStash
from arceus.model.spec_fields import known_keys_check
from arceus.model.tied import tied_groups_check

SPEC_TYPE = "exported"
MAX_LAYERS = 1024
MAX_DIMS = 8
MAX_SIDE = 1 << 24
MAX_PARAMETERS_PER_LAYER = 4096  # parameter tensors (and as many buffers)
# The dtypes a buffer may have (torch's names).
BUFFER_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32"})
MAX_COST = 1 << 62
_KEYS = frozenset({"type", "input", "labels", "layers", "program_sha256", "tied"})
_LAYER_KEYS = frozenset({"sha256", "output", "parameters", "flops_per_sample", "stash_bytes_per_sample"})
_OPTIONAL_LAYER_KEYS = frozenset({"buffers"})
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A parameter's name in the developer's module: dotted identifiers (and ModuleList indices).
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class ExportedLayer:
    sha256: str
    output: TensorLayout
    parameters: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape), float32
    flops_per_sample: int
    stash_bytes_per_sample: int
    buffers: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (name, torch dtype name, shape)


@dataclass(frozen=True)
class ExportedSpec:
    type: ClassVar[str] = SPEC_TYPE
    input: TensorLayout
    labels: TensorLayout
    layers: tuple[ExportedLayer, ...]
    program_sha256: str
    # Groups of pipeline names that are one weight of the developer's module, used in several layers
    # (arceus.model.tied); capture writes them where a cut falls between two uses of one parameter.
    tied: tuple[tuple[str, ...], ...] = ()
    # Layer index -> its shipped document (checked), on an agent that fetched its stage's layers; building a
    # layer's forward needs it, describing its parameters does not.
    attached: Mapping[int, str] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_params(self) -> list[int]:
        return [sum(math.prod(shape) for _, shape in layer.parameters) for layer in self.layers]

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each declared parameter's shape in `layer`, under the developer's name."""
        return {name: list(shape) for name, shape in self.layers[layer].parameters}

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """Each declared persistent buffer of `layer`: (dtype, shape), under the developer's name."""
        return {name: (dtype, list(shape)) for name, dtype, shape in self.layers[layer].buffers}

    def layer_flops_per_sample(self) -> list[int]:
        return [layer.flops_per_sample for layer in self.layers]

    def layer_stash(self) -> list[LayerStash]:
        """What autograd saved in the capture's forward, besides each layer's input; the last layer's loss keeps
        the logits' log-softmax too."""
        stash = [LayerStash(layer.stash_bytes_per_sample) for layer in self.layers]
        stash[-1] = LayerStash(stash[-1].beside + self.layers[-1].output.nbytes)
        return stash

    def input_layout(self, layer: int) -> TensorLayout:
        return self.input if layer == 0 else self.layers[layer - 1].output

    def output_layout(self, layer: int) -> TensorLayout:
        return self.layers[layer].output

    def label_layout(self) -> TensorLayout:
        return self.labels

    def split_layers(self) -> frozenset[int]:
        """A captured graph is not split over a tensor-parallel group."""
        return frozenset()

    def tied_parameters(self) -> tuple[tuple[str, ...], ...]:
        return self.tied

    def with_documents(self, documents: Mapping[int, str]) -> ExportedSpec:
        """This spec with layers' shipped documents attached (each checked when its layer is built)."""
        return replace(self, attached={**self.attached, **documents})


def exported_from_config(config: dict[str, Any]) -> ExportedSpec:
    known_keys_check(config, _KEYS, "an exported model")
    layers = config.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        raise SpecError("model_config.layers", f"must list 1 to {MAX_LAYERS} layers (what capture() writes)")
    inp = _layout(config.get("input"), "model_config.input", ids=True)
    labels = _layout(config.get("labels"), "model_config.labels", ids=True)
    if labels.dtype != "int64" or labels.bound is None:
        raise SpecError("model_config.labels", "must be int64 class indices with a bound (the number of classes)")
    parsed = tuple(_layer(layer, f"model_config.layers[{i}]") for i, layer in enumerate(layers))
    logits = parsed[-1].output
    if logits.shape != (*labels.shape, labels.bound):
        raise SpecError(
            "model_config.labels",
            f"{list(labels.shape)} with {labels.bound} classes does not fit logits {list(logits.shape)} per sample",
        )
    tied = config.get("tied", [])
    if not isinstance(tied, list) or len(tied) > MAX_LAYERS * MAX_PARAMETERS_PER_LAYER:
        raise SpecError("model_config.tied", "must list groups of tied parameters' pipeline names")
    tied_groups_check(tied, lambda i: {name: list(shape) for name, shape in parsed[i].parameters}, len(parsed),
                      "model_config.tied")
    return ExportedSpec(
        input=inp,
        labels=labels,
        layers=parsed,
        program_sha256=_sha256(config.get("program_sha256"), "model_config.program_sha256"),
        tied=tuple(tuple(group) for group in tied),
    )


def _layer(value: Any, where: str) -> ExportedLayer:
    if not isinstance(value, dict) or not _LAYER_KEYS <= set(value) <= _LAYER_KEYS | _OPTIONAL_LAYER_KEYS:
        raise SpecError(
            where, f"must be an object with exactly {', '.join(sorted(_LAYER_KEYS))} (and optionally buffers)"
        )
    output = _layout(value["output"], f"{where}.output", ids=False)
    parameters = value["parameters"]
    if not isinstance(parameters, dict) or len(parameters) > MAX_PARAMETERS_PER_LAYER:
        raise SpecError(f"{where}.parameters", f"must map at most {MAX_PARAMETERS_PER_LAYER} names to shapes")
    for name in parameters:
        if not _NAME.fullmatch(name):
            raise SpecError(f"{where}.parameters", f"{name[:80]!r} is not a parameter name")
    return ExportedLayer(
        sha256=_sha256(value["sha256"], f"{where}.sha256"),
        output=output,
        parameters=tuple((name, _shape(shape, f"{where}.parameters.{name}")) for name, shape in parameters.items()),
        flops_per_sample=_count(value["flops_per_sample"], f"{where}.flops_per_sample"),
        stash_bytes_per_sample=_count(value["stash_bytes_per_sample"], f"{where}.stash_bytes_per_sample"),
        buffers=_buffers(value.get("buffers", {}), f"{where}.buffers"),
    )


def _buffers(value: Any, where: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    if not isinstance(value, dict) or len(value) > MAX_PARAMETERS_PER_LAYER:
        raise SpecError(where, f"must map at most {MAX_PARAMETERS_PER_LAYER} names to {{dtype, shape}}")
    parsed = []
    for name, layout in value.items():
        if not _NAME.fullmatch(name):
            raise SpecError(where, f"{name[:80]!r} is not a buffer name")
        if not isinstance(layout, dict) or set(layout) != {"dtype", "shape"}:
            raise SpecError(f"{where}.{name}", "must be {dtype, shape}")
        if layout["dtype"] not in BUFFER_DTYPES:
            raise SpecError(f"{where}.{name}.dtype", f"must be one of {', '.join(sorted(BUFFER_DTYPES))}")
        parsed.append((name, layout["dtype"], _shape(layout["shape"], f"{where}.{name}.shape")))
    return tuple(parsed)


def _layout(value: Any, where: str, *, ids: bool) -> TensorLayout:
    if not isinstance(value, dict) or not {"dtype", "shape"} <= set(value) <= {"dtype", "shape", "bound"}:
        raise SpecError(where, "must be {dtype, shape[, bound]}")
    dtype = value["dtype"]
    if dtype not in ("float32", "int64") or (dtype == "int64" and not ids):
        raise SpecError(f"{where}.dtype", f"must be {'float32 or int64' if ids else 'float32'}, got {dtype!r}")
    bound = value.get("bound")
    if (dtype == "int64") != (bound is not None) or (bound is not None and not _is_int(bound)) or (bound or 1) < 1:
        raise SpecError(f"{where}.bound", "int64 ids need a positive bound (and float32 values none)")
    return TensorLayout(dtype, _shape(value["shape"], f"{where}.shape"), bound)


def _shape(value: Any, where: str) -> tuple[int, ...]:
    sizes_fit = isinstance(value, list) and all(_is_int(s) and 1 <= s <= MAX_SIDE for s in value)
    if not sizes_fit or len(value) > MAX_DIMS:
        raise SpecError(where, f"must be a list of at most {MAX_DIMS} sizes from 1 to {MAX_SIDE}")
    return tuple(value)


def _count(value: Any, where: str) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_COST:
        raise SpecError(where, f"must be an integer from 0 to {MAX_COST}")
    return value


def _sha256(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise SpecError(where, "must be a SHA-256 in lower-case hex")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
