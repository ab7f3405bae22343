"""A model as a Hugging Face `transformers` folder (`config.json` + `model.safetensors`), for any architecture
that has that format (`Architecture.hugging_face`). Out: a trained model streamed as an uncompressed tar built
from the stage checkpoint files range by range, so its length is known up front and the memory it takes
does not grow with the model; `tar -xf` (or `tarfile`) gives the folder `from_pretrained` loads (with the job's
uploaded `tokenizer.json`, if it has one: `AutoTokenizer`'s too). In: such a
`model.safetensors` as a job's starting weights (fine-tuning), checked from its header, and each stage's
layers cut from it under the pipeline's names (`initial_weights_slice`): an agent receives only its layers.
A matrix `transformers` stores transposed (GPT-2's Conv1D weights) is transposed on the way, out and in.

Uploaded weights may be a Hugging Face checkpoint as it is shipped: bf16 or fp16 (each agent widens its layers to
the model's fp32 as it loads them, exactly: the bytes travel and are stored at half the size), and sharded
(`model.safetensors.index.json` naming `model-0000i-of-0000n.safetensors` files): `folder_weights` streams the
shards as the one file the upload is, a range at a time, so the uploader holds no tensor.

A slice is checked layer by layer: each layer's digest is the SHA-256 of the safetensors file of that layer's
weights alone under the pipeline's names (as `sliced_checkpoint` lays it out, so it is the same bytes cut from
the upload or from a slice). The control plane computes every layer's digest when the weights are uploaded and
the assignment carries the stage's; the agent recomputes them from what it received. What the storage or any
hop between holds cannot change a layer without its digest changing.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from arceus.errors import SpecError
from arceus.model.architecture import HuggingFaceFormat
from arceus.model.expected_state import Layout, expected_stage_state, layout_described
from arceus.model.registry import ARCHITECTURES, architecture_of
from arceus.model.spec import ModelSpec
from arceus.model.tied import tied_groups
from arceus.safetensors_file import (
    CHUNK_BYTES,
    DTYPE_BYTES,
    CheckpointError,
    merged_checkpoint,
    sliced_checkpoint,
    tensor_layouts,
)

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
SHARDS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's: {"weight_map": {tensor: shard file}}
# The dtypes uploaded weights of a float32 parameter may have (safetensors' names): Hugging Face checkpoints ship
# bf16 or fp16; either widens to float32 exactly.
_WIDENING = frozenset({"F32", "BF16", "F16"})
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


def _transposed(spec: ModelSpec) -> Callable[[str], bool]:
    """Which pipeline parameters the uploaded weights hold transposed (`HuggingFaceFormat.transposed`): none of an
    exported model's, which are uploaded under the pipeline's own names and layouts."""
    if architecture_of(spec).ships_program:
        return lambda name: False
    found = hugging_face_format(spec)
    return lambda name: found.transposed(spec, name)


def hugging_face_folder(
    spec: ModelSpec,
    sources: Sequence[BinaryIO],
    *,
    keep: Callable[[str], bool],
    metadata: dict[str, str],
    tokenizer: BinaryIO | None = None,
) -> tuple[int, Iterator[bytes]]:
    """The tar of the folder holding `spec`'s config and the tensors `keep` selects from the (seekable, already
    verified) stage files `sources`, renamed to `transformers`' names, and the job's `tokenizer.json` when it
    has one (`tokenizer`, seekable: `AutoTokenizer.from_pretrained` loads the folder): its length and a stream
    of chunks."""
    found = hugging_face_format(spec)
    config = json.dumps(found.config(spec), indent=2, sort_keys=True).encode()
    copies = {name for group in tied_groups(spec) for name in group.members[1:]}  # stored once, as the first
    size, weights = merged_checkpoint(
        sources, keep=lambda name: keep(name) and name not in copies, metadata={"format": "pt", **metadata},
        rename=lambda name: found.name(spec, name),
        transposed=lambda name: found.transposed(spec, name),
    )
    members = [(_header(CONFIG_FILE, len(config)), len(config), iter([config])),
               (_header(WEIGHTS_FILE, size), size, weights)]
    if tokenizer is not None:
        length = tokenizer.seek(0, 2)
        tokenizer.seek(0)
        members.append((_header(TOKENIZER_FILE, length), length, iter(lambda: tokenizer.read(CHUNK_BYTES), b"")))
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
    under their uploaded names (`initial_weights_names`), each with the model's shape and its dtype (float32)
    or one that widens to it (bfloat16, float16): read from its header alone."""
    named, transposed = initial_weights_names(spec), _transposed(spec)
    actual = tensor_layouts(handle, size)
    expected = {
        named(name): (dtype, shape[::-1] if transposed(name) else shape)
        for name, (dtype, shape) in _weights(spec, 0, spec.num_layers).items()
    }
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        raise CheckpointError(f"the weights lack {missing[0]} ({len(missing)} of the model's parameters missing)")
    if extra:
        raise CheckpointError(f"{extra[0]} is no parameter of this model ({len(extra)} unknown tensors)")
    for name, (dtype, shape) in expected.items():
        given, given_shape = actual[name]
        if given_shape != shape or given != dtype and not (dtype == "F32" and given in _WIDENING):
            raise CheckpointError(
                f"{name} is {layout_described(actual[name])}; the model's is {layout_described((dtype, shape))}"
                + (" (or bfloat16, float16)" if dtype == "F32" else "")
            )


def hugging_face_config_check(spec: ModelSpec, config: Mapping[str, Any]) -> None:
    """CheckpointError unless a checkpoint's config.json (`config`) describes the function `spec` computes in every
    key that changes it without changing a tensor's shape (`HuggingFaceFormat.computes`): weights of GPT-2's own
    tanh GELU, or of tied embeddings, would load here and compute something else. What the tensors' names and
    shapes say is the weights check's (`hugging_face_weights_check`)."""
    found = hugging_face_format(spec)
    ours = found.config(spec)
    for key, default in found.computes.items():
        theirs = config.get(key, default)
        if theirs != ours[key]:
            why = " (set model_config.tie_word_embeddings to match)" if key == "tie_word_embeddings" else ""
            raise CheckpointError(f"config.json's {key} is {theirs!r}; this job's {spec.type} has {ours[key]!r}{why}")


@contextmanager
def folder_weights(folder: Path) -> Iterator[tuple[int, Iterator[bytes]]]:
    """A Hugging Face folder's weights as the one safetensors file an upload is, within: its length and a stream
    of chunks. Its `model.safetensors` as it is, or its shards (`SHARDS_INDEX`) merged range by range, so no
    tensor is ever held (`merged_checkpoint`). CheckpointError for a folder that has neither, or an index whose
    weight map its shards do not hold exactly."""
    index = folder / SHARDS_INDEX
    with ExitStack() as files:
        if not index.exists():
            single = folder / WEIGHTS_FILE
            if not single.exists():
                raise CheckpointError(f"{folder} holds neither {WEIGHTS_FILE} nor {SHARDS_INDEX}")
            handle = files.enter_context(single.open("rb"))
            size = single.stat().st_size
            yield size, iter(lambda: handle.read(CHUNK_BYTES), b"")
            return
        weight_map = _weight_map(index)
        shards = list(dict.fromkeys(weight_map.values()))  # in the index's order, each once
        handles = [files.enter_context((folder / shard).open("rb")) for shard in shards]
        for shard, handle in zip(shards, handles, strict=True):
            held = set(tensor_layouts(handle, (folder / shard).stat().st_size))
            named = {name for name, owner in weight_map.items() if owner == shard}
            if held != named:
                odd = sorted(held ^ named)[0]
                raise CheckpointError(f"{shard} and {SHARDS_INDEX} disagree on {odd}")
        yield merged_checkpoint(handles, keep=lambda name: True, metadata={"format": "pt"})


def _weight_map(index: Path) -> dict[str, str]:
    """An index's tensor -> shard file map; CheckpointError unless each shard is a plain file name."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{SHARDS_INDEX} has no weight_map: {exc}") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) and Path(shard).name == shard and shard not in ("", ".", "..")
        for shard in weight_map.values()
    ):
        raise CheckpointError(f"{SHARDS_INDEX}'s weight_map must name shard files in its folder")
    return weight_map


def initial_weights_slice(
    spec: ModelSpec, source: BinaryIO, size: int, layer_start: int, layer_end: int
) -> tuple[int, Iterator[bytes]]:
    """Layers [layer_start, layer_end)'s weights under the pipeline's names, cut from the uploaded weights
    (`source`, `size` bytes, checked by `hugging_face_weights_check`) by range: a safetensors file as its length
    and a stream of chunks."""
    named = initial_weights_names(spec)
    names = {name: named(name) for name in _weights(spec, layer_start, layer_end)}
    return sliced_checkpoint(source, size, names, transposed=_transposed(spec))


def initial_weights_slice_bytes(spec: ModelSpec, layer_start: int, layer_end: int) -> int:
    """The most bytes `initial_weights_slice` of layers [layer_start, layer_end) may take: their tensors' data
    and a header of at most 1 KiB per tensor (what an agent allows the download)."""
    weights = _weights(spec, layer_start, layer_end)
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] + 1024 for dtype, shape in weights.values()) + 8


def initial_weights_layer_digests(spec: ModelSpec, source: BinaryIO, size: int) -> list[str]:
    """Each layer's digest (the module docstring) of the uploaded weights `source` (`size` bytes, checked by
    `hugging_face_weights_check`), in layer order: read once, a chunk at a time."""
    named, transposed = initial_weights_names(spec), _transposed(spec)
    by_layer = _by_layer(_weights(spec, 0, spec.num_layers))
    layers = ({name: named(name) for name in by_layer.get(i, ())} for i in range(spec.num_layers))
    return [_digest(sliced_checkpoint(source, size, names, transposed=transposed)[1]) for names in layers]


def initial_weights_slice_check(handle: BinaryIO, size: int, layer_start: int, digests: Sequence[str]) -> None:
    """CheckpointError unless the safetensors file (`size` bytes) holds the weights of layers [layer_start,
    layer_start + len(digests)) and nothing else, each layer's hashing to its digest: what an agent checks of
    the slice it received before it loads a tensor of it."""
    by_layer = _by_layer(tensor_layouts(handle, size))
    layers = range(layer_start, layer_start + len(digests))
    strays = sorted(set(by_layer) - set(layers))
    if strays:
        raise CheckpointError(
            f"the initial weights hold layer {strays[0]}, outside layers [{layers.start}, {layers.stop})"
        )
    for layer, expected in zip(layers, digests, strict=True):
        actual = _digest(sliced_checkpoint(handle, size, {name: name for name in by_layer.get(layer, ())})[1])
        if actual != expected:
            raise CheckpointError(
                f"layer {layer} of the initial weights hashes to {actual}, expected {expected}: corrupt or replaced"
            )


_LAYER = re.compile(r"layers\.(\d+)\.")


def _by_layer(names: Iterable[str]) -> dict[int, list[str]]:
    """Pipeline parameter names ("layers.<i>.<name>") by layer; CheckpointError for a name of no layer."""
    found: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match is None:
            raise CheckpointError(f"{name} is no layer's parameter (a pipeline name is layers.<i>.<name>)")
        found.setdefault(int(match[1]), []).append(name)
    return found


def _digest(chunks: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _weights(spec: ModelSpec, layer_start: int, layer_end: int) -> dict[str, Layout]:
    return expected_stage_state(
        spec, stage_index=0, layer_start=layer_start, layer_end=layer_end, optimizer="sgd"
    ).weights


def _header(name: str, size: int) -> bytes:
    """A member's tar header; GNU's format writes a size above ustar's 8 GiB in base 256, in the same block."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK
