"""A model as a Hugging Face `transformers` folder (`config.json` + `model.safetensors`), for any architecture
that has that format (`Architecture.hugging_face`). Out: a trained model streamed as an uncompressed tar built
from the stage checkpoint files range by range, so its length is known up front and the memory it takes
does not grow with the model; `tar -xf` (or `tarfile`) gives the folder `from_pretrained` loads. In: such a
`model.safetensors` as a job's starting weights (fine-tuning), checked from its header, and each stage's
layers read from it under the pipeline's names.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO

import torch

from arceus.checkpoint import CheckpointError, merged_checkpoint, stored_layout, tensor_layouts
from arceus.errors import SpecError
from arceus.model.architecture import HuggingFaceFormat
from arceus.model.expected_state import expected_stage_state
from arceus.model.registry import ARCHITECTURES, architecture_of
from arceus.model.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
_BLOCK = tarfile.BLOCKSIZE  # 512: a tar member's header and data are padded to whole blocks


def hugging_face_format(spec: ModelSpec) -> HuggingFaceFormat:
    """The architecture's Hugging Face format; SpecError("format") if it has none."""
    found = architecture_of(spec).hugging_face
    if found is None:
        having = [a.type for a in ARCHITECTURES.values() if a.hugging_face is not None]
        raise SpecError(
            "format",
            f"a model of type {spec.type!r} has no Hugging Face format (only {', '.join(having)}); "
            "leave format out to download the safetensors file",
        )
    return found


def initial_weights_names(spec: ModelSpec) -> Callable[[str], str]:
    """How a job's uploaded initial weights name each pipeline parameter ("layers.<i>.<name>"): an exported
    model's (`Architecture.ships_program`) by those very names, a model with a Hugging Face format by
    `transformers`' names; SpecError("format") for a model that cannot start from uploaded weights."""
    if architecture_of(spec).ships_program:
        return lambda name: name
    found = hugging_face_format(spec)
    return lambda name: found.name(spec, name)


def hugging_face_folder(
    spec: ModelSpec, sources: Sequence[BinaryIO], *, keep: Callable[[str], bool], metadata: dict[str, str]
) -> tuple[int, Iterator[bytes]]:
    """The tar of the folder holding `spec`'s config and the tensors `keep` selects from the (seekable, already
    verified) stage files `sources`, renamed to `transformers`' names: its length and a stream of chunks."""
    found = hugging_face_format(spec)
    config = json.dumps(found.config(spec), indent=2, sort_keys=True).encode()
    size, weights = merged_checkpoint(
        sources, keep=keep, metadata={"format": "pt", **metadata}, rename=lambda name: found.name(spec, name)
    )
    members = [(_header(CONFIG_FILE, len(config)), len(config), iter([config])),
               (_header(WEIGHTS_FILE, size), size, weights)]
    total = sum(len(header) + _padded(n) for header, n, _ in members) + 2 * _BLOCK  # two zero blocks end it

    def chunks() -> Iterator[bytes]:
        for header, length, data in members:
            yield header
            yield from data
            yield b"\0" * (_padded(length) - length)
        yield b"\0" * (2 * _BLOCK)

    return total, chunks()


def hugging_face_weights_check(spec: ModelSpec, handle: BinaryIO, size: int) -> None:
    """CheckpointError unless the safetensors file (`size` bytes) holds exactly the whole model's parameters
    under their uploaded names (`initial_weights_names`), each with the model's dtype (float32) and shape: read
    from its header alone."""
    named = initial_weights_names(spec)
    actual = tensor_layouts(handle, size)
    expected = {named(name): layout for name, layout in _weights(spec, 0, spec.num_layers).items()}
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        raise CheckpointError(f"the weights lack {missing[0]} ({len(missing)} of the model's parameters missing)")
    if extra:
        raise CheckpointError(f"{extra[0]} is no parameter of this model ({len(extra)} unknown tensors)")
    for name, (dtype, shape) in expected.items():
        if actual[name] != (dtype, shape):
            got_dtype, got_shape = actual[name]
            raise CheckpointError(f"{name} is {got_dtype} {got_shape}; the model's is {dtype} {shape}")


def stage_weights(
    spec: ModelSpec, layer_start: int, layer_end: int, tensors: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """Layers [layer_start, layer_end)'s weights under the pipeline's names, from the whole model's under their
    uploaded names (checked by `hugging_face_weights_check`); a lazy mapping (`StateFile`) stays lazy."""
    named = initial_weights_names(spec)
    return _Renamed(tensors, {name: named(name) for name in _weights(spec, layer_start, layer_end)})


def _weights(spec: ModelSpec, layer_start: int, layer_end: int) -> dict[str, tuple[torch.dtype, list[int]]]:
    return expected_stage_state(
        spec, stage_index=0, layer_start=layer_start, layer_end=layer_end, optimizer="sgd"
    ).weights


class _Renamed(Mapping[str, torch.Tensor]):
    """Some of a mapping's tensors under other names, loaded only when asked for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], sources: dict[str, str]) -> None:
        self._tensors, self._sources = tensors, sources

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._sources[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shape_of(self, name: str) -> list[int]:
        return stored_layout(self._tensors, self._sources[name])[1]

    def dtype_of(self, name: str) -> torch.dtype:
        return stored_layout(self._tensors, self._sources[name])[0]


def _header(name: str, size: int) -> bytes:
    """A member's tar header; GNU's format writes a size above ustar's 8 GiB in base 256, in the same block."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK
