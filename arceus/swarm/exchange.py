"""The replicas' exact gradient exchange, cut and summed: which replica owns which chunk of a stage's
flattened gradient, how a chunk travels in bounded messages, and the one order partial gradients are summed
in, so every replica ends with the same bits (reduce-scatter to the owners, then all-gather from them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from arceus.model.spec import ModelSpec

MAX_SHARD_BYTES = 4 * 1024 * 1024  # one exchange message at most: bounded like every other data-plane message


@dataclass(frozen=True)
class Chunk:
    """Elements [start, end) of the flattened gradient, reduced by replica `owner`."""

    owner: int
    start: int
    end: int


def exchange_elements(spec: ModelSpec, layer_start: int, layer_end: int) -> int:
    """The length of a replica's partial vector for layers [layer_start, layer_end) of `spec`, from the spec alone
    (`nodeagent.runtime.StageRuntime.gradient_vector` lays it out): every parameter's gradient, then, where the
    layers have persistent buffers (arceus.model.buffers), each buffer's summed change and the micro-batch count."""
    layers = range(layer_start, layer_end)
    buffers = sum(math.prod(shape) for i in layers for _, shape in spec.layer_buffers(i).values())
    parameters = sum(spec.layer_params()[layer_start:layer_end])
    return parameters + (buffers + 1 if any(spec.layer_buffers(i) for i in layers) else 0)


def chunk_bounds(total_elements: int, members: Sequence[int]) -> tuple[Chunk, ...]:
    """Cut `total_elements` into len(members) contiguous chunks in order, sizes within 1 (the first
    `total % R` one larger), chunk c owned by members[c]; a chunk is empty when there are fewer elements
    than members. Every replica computes the same cut from the same members."""
    if total_elements < 0:
        raise ValueError(f"total_elements must be >= 0, got {total_elements}")
    if not members or len(set(members)) != len(members):
        raise ValueError(f"the exchange needs at least 1 member, each once, got {list(members)}")
    size, extra = divmod(total_elements, len(members))
    chunks, start = [], 0
    for c, owner in enumerate(members):
        end = start + size + (1 if c < extra else 0)
        chunks.append(Chunk(owner, start, end))
        start = end
    return tuple(chunks)


def shard_bounds(chunk: Chunk, itemsize: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) element ranges of the messages carrying `chunk`, in order, each at most
    MAX_SHARD_BYTES of `itemsize`-byte elements; none for an empty chunk."""
    if not 1 <= itemsize <= MAX_SHARD_BYTES:
        raise ValueError(f"itemsize must be in [1, {MAX_SHARD_BYTES}], got {itemsize}")
    per_shard = MAX_SHARD_BYTES // itemsize
    return tuple((s, min(s + per_shard, chunk.end)) for s in range(chunk.start, chunk.end, per_shard))


def reduce_in_order(parts: Mapping[int, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the members' parts (replica id -> tensor) left to right in ascending replica id, whatever order
    they arrived in: floating-point addition is not associative, and this is the one place its order is
    fixed, so every owner and every replica it sends the sum to hold the same bits. Written into `out` where
    given (the parts' shape, dtype and device, sharing memory with none of them: the exchange's result, so the
    sum is not copied there after), else into a new tensor; returned."""
    if not parts:
        raise ValueError("nothing to reduce: no member's part")
    ids = sorted(parts)
    first = parts[ids[0]]
    for k in ids[1:]:
        part = parts[k]
        if part.shape != first.shape or part.dtype != first.dtype or part.device != first.device:
            raise ValueError(
                f"replica {k}'s part is {part.dtype} {tuple(part.shape)} on {part.device}; replica {ids[0]}'s is "
                f"{first.dtype} {tuple(first.shape)} on {first.device}: members must send the same chunk"
            )
    if out is None:
        out = torch.empty_like(first)
    elif out.shape != first.shape or out.dtype != first.dtype or out.device != first.device:
        raise ValueError(
            f"the sum goes into a {out.dtype} {tuple(out.shape)} tensor on {out.device}; the parts are "
            f"{first.dtype} {tuple(first.shape)} on {first.device}"
        )
    if len(ids) == 1:
        return out.copy_(first)
    torch.add(first, parts[ids[1]], out=out)
    for k in ids[2:]:
        out.add_(parts[k])
    return out
