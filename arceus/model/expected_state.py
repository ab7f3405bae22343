"""What a stage's state file must hold, and the check of one against it: the names, dtypes and shapes of
the stage's parameters (layers [layer_start, layer_end) of the job's model, or a tensor-parallel rank's
part of them: `arceus.model.tensor_parallel.rank_expected_state`), of the state its optimizer keeps per
parameter ("optimizer.<parameter>.<key>") and of its layers' persistent buffers ("buffer.<model-wide name>": state
training updates, a BatchNorm's running statistics; `layer_buffers`).

An agent is a stranger's process: what it uploads or streams becomes the state every later host of the
stage resumes from, the model its owner downloads and what sampling runs. So a state file is checked
from its safetensors header alone (the tensors are never loaded) against the layouts its spec declares
(`layer_parameters`; a test holds them equal to the built layers'), before it becomes part of a checkpoint.
No torch: the control plane checks agents' uploads and the files the driver streams; the driver checks
what each rank of a stage streams to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

from arceus.model.architecture import Shard
from arceus.model.spec import ModelSpec
from arceus.safetensors_file import BUFFER_PREFIX, OPTIMIZER_PREFIX, CheckpointError, StageStateError, tensor_layouts

# (safetensors dtype name, shape)
Layout = tuple[str, list[int]]
# Every parameter is float32 (mixed precision casts in the forward only).
PARAMETER_DTYPE = "F32"

# What each optimizer keeps per parameter once it has stepped (plain SGD keeps nothing); a parameter that
# has not stepped yet keeps nothing either.
OPTIMIZER_STATE_KEYS = {
    "sgd": frozenset(),
    "sgd-momentum": frozenset({"momentum_buffer"}),
    "adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    # bitsandbytes' blockwise 8-bit Adam (`arceus.model.optimizers`): each moment one byte an element
    # ("state1", "state2") and a float32 scale per block ("absmax1", "absmax2").
    "adam8bit": frozenset({"step", "state1", "state2", "absmax1", "absmax2"}),
}
ADAM8BIT_BLOCK = 256  # elements per float32 scale of an 8-bit moment
# Adam's step counter: a float32 scalar (torch keeps it as a tensor); every other entry is shaped like
# its parameter, float32 (8-bit Adam's: `optimizer_entry_layout`).
_STEP = "step"
_STEP_LAYOUT: Layout = ("F32", [])


def optimizer_entry_layout(kind: str, key: str, parameter_shape: list[int]) -> Layout:
    """The layout of optimizer entry `key` (one of `OPTIMIZER_STATE_KEYS[kind]`) kept for a parameter of that shape."""
    if key == _STEP:
        return _STEP_LAYOUT
    if kind == "adam8bit":
        if key.startswith("absmax"):
            elements = 1
            for size in parameter_shape:
                elements *= size
            return ("F32", [-(-elements // ADAM8BIT_BLOCK)])
        return ("U8", list(parameter_shape))
    return ("F32", list(parameter_shape))


def optimizer_kind(name: str, momentum: float) -> str:
    """The OPTIMIZER_STATE_KEYS entry of an optimizer config: SGD keeps a buffer only with momentum."""
    kind = "sgd-momentum" if name == "sgd" and momentum else name
    if kind not in OPTIMIZER_STATE_KEYS:
        raise ValueError(f"unknown optimizer {name!r}; known: sgd, adam, adam8bit")
    return kind


@dataclass(frozen=True)
class ExpectedState:
    """What stage `stage_index` (or rank `shard.rank` of it) holds: `weights` by model-wide name, the
    `optimizer` kind whose per-parameter state may accompany them, and its layers' `buffers` ("buffer.<name>")."""

    stage_index: int
    layer_start: int
    layer_end: int
    optimizer: str
    weights: dict[str, Layout]
    shard: Shard | None = None
    buffers: dict[str, Layout] = field(default_factory=dict)

    def holds(self) -> str:
        if self.shard is None:
            return f"the stage holds layers [{self.layer_start}, {self.layer_end})"
        return (
            f"rank {self.shard.rank} of {self.shard.size} holds its part of layers "
            f"[{self.layer_start}, {self.layer_end})"
        )


def expected_stage_state(
    spec: ModelSpec, *, stage_index: int, layer_start: int, layer_end: int, optimizer: str
) -> ExpectedState:
    """The state of layers [layer_start, layer_end) of `spec`, under the model-wide names of
    `arceus.model.build.named_global_parameters` ("layers.<index>.<name in the layer>")."""
    if optimizer not in OPTIMIZER_STATE_KEYS:
        raise ValueError(f"unknown optimizer kind {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_KEYS)}")
    if not 0 <= layer_start < layer_end <= spec.num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside the model's {spec.num_layers} layers")
    weights = {
        f"layers.{index}.{name}": (PARAMETER_DTYPE, shape)
        for index in range(layer_start, layer_end)
        for name, shape in spec.layer_parameters(index).items()
    }
    buffers = {
        f"{BUFFER_PREFIX}layers.{index}.{name}": (_SAFETENSORS_DTYPES[dtype], shape)
        for index in range(layer_start, layer_end)
        for name, (dtype, shape) in spec.layer_buffers(index).items()
    }
    return ExpectedState(stage_index, layer_start, layer_end, optimizer, weights, buffers=buffers)


def stage_state_check(layouts: Mapping[str, Layout], expected: ExpectedState) -> None:
    """StageStateError naming the first tensor (in `layouts`' order) that the stage does not hold as
    `layouts` describes it, or the first it holds that is missing. Optimizer state is optional per
    parameter (none before its first step), but a parameter that has some has all its optimizer keeps; every
    buffer is required (a state file saved before stages kept their buffers was checked before it was kept, and
    loads as `nodeagent.runtime.StageRuntime.load_state_tensors` says)."""
    keeps = OPTIMIZER_STATE_KEYS[expected.optimizer]

    def refuse(message: str) -> StageStateError:
        return StageStateError(message, stage_index=expected.stage_index)

    entries: dict[str, set[str]] = {}
    for name, got in layouts.items():
        if name.startswith(BUFFER_PREFIX):
            want = expected.buffers.get(name)
            if want is None:
                raise refuse(f"unexpected tensor {name}: no buffer of the layers it holds ({expected.holds()})")
        elif not name.startswith(OPTIMIZER_PREFIX):
            want = expected.weights.get(name)
            if want is None:
                raise refuse(f"unexpected tensor {name}: {expected.holds()}")
        else:
            parameter, _, key = name.removeprefix(OPTIMIZER_PREFIX).rpartition(".")
            if parameter not in expected.weights:
                raise refuse(f"unexpected tensor {name}: optimizer state of no parameter it holds ({expected.holds()})")
            if key not in keeps:
                raise refuse(f"unexpected tensor {name}: a {expected.optimizer} optimizer keeps {_listed(keeps)}")
            want = optimizer_entry_layout(expected.optimizer, key, expected.weights[parameter][1])
            entries.setdefault(parameter, set()).add(key)
        if (got[0], list(got[1])) != want:
            raise refuse(f"{name}: expected {layout_described(want)}, got {layout_described(got)}")
    for name, want in (expected.weights | expected.buffers).items():
        if name not in layouts:
            raise refuse(f"missing tensor {name}: expected {layout_described(want)} ({expected.holds()})")
    for parameter, keys in entries.items():
        if keys != keeps:
            missing = sorted(keeps - keys)[0]
            raise refuse(
                f"missing tensor {OPTIMIZER_PREFIX}{parameter}.{missing}: a {expected.optimizer} optimizer keeps "
                f"{_listed(keeps)} for each parameter it keeps state of"
            )


def stage_file_check(handle: BinaryIO, file_size: int, expected: ExpectedState) -> None:
    """Check a stage's safetensors state file (open for reading, `file_size` bytes) from its header alone:
    CheckpointError if it is no valid safetensors file whose tensors tile its data, StageStateError if it
    does not hold exactly what `expected` says."""
    try:
        layouts = tensor_layouts(handle, file_size)
    except CheckpointError as exc:
        raise StageStateError(str(exc), stage_index=expected.stage_index) from exc
    stage_state_check(layouts, expected)


# How messages name dtypes (torch's names, which developers know), and how a safetensors header names a torch one.
_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_SAFETENSORS_DTYPES = {torch_name: name for name, torch_name in _DTYPE_NAMES.items()}


def layout_described(layout: Layout) -> str:
    dtype, shape = layout
    return f"{_DTYPE_NAMES.get(dtype, dtype)} {list(shape)}"


def _listed(keys: frozenset[str]) -> str:
    return ", ".join(sorted(keys)) if keys else "no state"
