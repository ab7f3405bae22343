"""A trained model as a Hugging Face `transformers` folder (`config.json` + `model.safetensors`), for any
architecture that has that format (`Architecture.hugging_face`): streamed as an uncompressed tar built
from the stage checkpoint files range by range, so its length is known up front and the memory it takes
does not grow with the model. `tar -xf` (or `tarfile`) gives the folder `from_pretrained` loads.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from arceus.checkpoint import merged_checkpoint
from arceus.errors import SpecError
from arceus.model.architecture import HuggingFaceFormat
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


def _header(name: str, size: int) -> bytes:
    """A member's tar header; GNU's format writes a size above ustar's 8 GiB in base 256, in the same block."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK
