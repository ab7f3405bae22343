"""What a stage's state file must hold, and the check of one against it: the names, dtypes and shapes of
the stage's parameters (layers [layer_start, layer_end) of the job's model, or a tensor-parallel rank's
part of them) and of the state its optimizer keeps per parameter ("optimizer.<parameter>.<key>").

An agent is a stranger's process: what it uploads or streams becomes the state every later host of the
stage resumes from, the model its owner downloads and what sampling runs. So a state file is checked
from its safetensors header alone (the tensors are never loaded) against layouts computed by building
the stage's layers on torch's `meta` device (no weights are allocated), before it becomes part of a
checkpoint. The control plane checks agents' uploads and the files the driver streams; the driver
checks what each rank of a stage streams to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import torch

from arceus.checkpoint import OPTIMIZER_PREFIX, CheckpointError, StageStateError, tensor_layouts
from arceus.model.build import build_layers, named_global_parameters
from arceus.model.sharding import Shard
from arceus.model.spec import ModelSpec
from arceus.model.tensor_parallel import sliced_shape

Layout = tuple[torch.dtype, list[int]]

# What each optimizer keeps per parameter once it has stepped (plain SGD keeps nothing); a parameter that
# has not stepped yet keeps nothing either.
OPTIMIZER_STATE_KEYS = {
    "sgd": frozenset(),
    "sgd-momentum": frozenset({"momentum_buffer"}),
    "adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
}
# Adam's step counter: a float32 scalar (torch keeps it as a tensor); every other entry is shaped like
# its parameter.
_STEP = "step"
_STEP_LAYOUT: Layout = (torch.float32, [])


def optimizer_kind(name: str, momentum: float) -> str:
    """The OPTIMIZER_STATE_KEYS entry of an optimizer config: SGD keeps a buffer only with momentum."""
    kind = "sgd-momentum" if name == "sgd" and momentum else name
    if kind not in OPTIMIZER_STATE_KEYS:
        raise ValueError(f"unknown optimizer {name!r}; known: sgd, adam")
    return kind


@dataclass(frozen=True)
class ExpectedState:
    """What stage `stage_index` (or rank `shard.rank` of it) holds: `weights` by model-wide name, and the
    `optimizer` kind whose per-parameter state may accompany them."""

    stage_index: int
    layer_start: int
    layer_end: int
    optimizer: str
    weights: dict[str, Layout]
    shard: Shard | None = None

    def holds(self) -> str:
        if self.shard is None:
            return f"the stage holds layers [{self.layer_start}, {self.layer_end})"
        return (
            f"rank {self.shard.rank} of {self.shard.size} holds its part of layers "
            f"[{self.layer_start}, {self.layer_end})"
        )


def expected_stage_state(
    spec: ModelSpec, *, stage_index: int, layer_start: int, layer_end: int, optimizer: str, shard: Shard | None = None
) -> ExpectedState:
    """The state of layers [layer_start, layer_end) of `spec` (with a shard: that rank's part of a tensor-
    parallel stage, whose checkpoint names are the unsplit stage's), from layers built on the meta device."""
    if optimizer not in OPTIMIZER_STATE_KEYS:
        raise ValueError(f"unknown optimizer kind {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_KEYS)}")
    with torch.device("meta"):
        layers = build_layers(spec, layer_start, layer_end, seed=0)
    weights = {
        name: (param.dtype, list(param.shape) if shard is None else sliced_shape(spec, shard, name, param.shape))
        for name, param in named_global_parameters(layers)
    }
    return ExpectedState(stage_index, layer_start, layer_end, optimizer, weights, shard)


def stage_state_check(layouts: Mapping[str, Layout], expected: ExpectedState) -> None:
    """StageStateError naming the first tensor (in `layouts`' order) that the stage does not hold as
    `layouts` describes it, or the first it holds that is missing. Optimizer state is optional per
    parameter (none before its first step), but a parameter that has some has all its optimizer keeps."""
    keeps = OPTIMIZER_STATE_KEYS[expected.optimizer]

    def refuse(message: str) -> StageStateError:
        return StageStateError(message, stage_index=expected.stage_index)

    entries: dict[str, set[str]] = {}
    for name, got in layouts.items():
        if not name.startswith(OPTIMIZER_PREFIX):
            want = expected.weights.get(name)
            if want is None:
                raise refuse(f"unexpected tensor {name}: {expected.holds()}")
        else:
            parameter, _, key = name.removeprefix(OPTIMIZER_PREFIX).rpartition(".")
            if parameter not in expected.weights:
                raise refuse(f"unexpected tensor {name}: optimizer state of no parameter it holds ({expected.holds()})")
            if key not in keeps:
                raise refuse(f"unexpected tensor {name}: a {expected.optimizer} optimizer keeps {_listed(keeps)}")
            want = _STEP_LAYOUT if key == _STEP else expected.weights[parameter]
            entries.setdefault(parameter, set()).add(key)
        if (got[0], list(got[1])) != want:
            raise refuse(f"{name}: expected {_described(want)}, got {_described(got)}")
    for name, want in expected.weights.items():
        if name not in layouts:
            raise refuse(f"missing tensor {name}: expected {_described(want)} ({expected.holds()})")
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


def _described(layout: Layout) -> str:
    dtype, shape = layout
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def _listed(keys: frozenset[str]) -> str:
    return ", ".join(sorted(keys)) if keys else "no state"
