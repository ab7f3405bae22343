"""Megatron-style tensor parallelism, the architecture-independent part: a rank's place in its group (`Shard`,
torch-free in `arceus.model.architecture`), the two autograd operators that join split compute (f and g), and
cutting or gathering a stage's checkpoint tensors given an architecture's `shard_rows`.

The collective is injected (`AllReduce`), so compute knows nothing of how the ranks talk. It must sum in
the same (rank) order everywhere, so that replicated values stay bitwise equal across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from arceus.checkpoint import stored_layout
from arceus.model.architecture import Shard
from arceus.safetensors_file import OPTIMIZER_PREFIX

AllReduce = Callable[[torch.Tensor], torch.Tensor]


# (spec, shard, parameter name) -> (dim, indices) of the rank's part of the unsplit parameter, or None
# where the parameter is replicated on every rank.
ShardRows = Callable[[Any, Shard, str], "tuple[int, torch.Tensor] | None"]


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the gradient of the replicated input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.all_reduce(grad.contiguous()), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward all-reduces the partial sums; backward passes the gradient through."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        return all_reduce(partial.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(x: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    """The input of a column-parallel layer: every rank's partial depends on all of it, so its gradient
    is the sum of every rank's."""
    return _CopyToGroup.apply(x, all_reduce)


def reduce_from_group(partial: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    """The output of a row-parallel layer: the sum of every rank's partial."""
    return _ReduceFromGroup.apply(partial, all_reduce)


def parameter_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to: itself, or, for an optimizer entry
    ("optimizer.<parameter>.<key>"), the parameter it is kept for."""
    if name.startswith(OPTIMIZER_PREFIX):
        return name.removeprefix(OPTIMIZER_PREFIX).rpartition(".")[0]
    return name


def slice_state(
    shard_rows: ShardRows, spec: Any, shard: Shard, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rank `shard.rank`'s part of an unsplit stage's checkpoint tensors (weights and optimizer state)."""
    sliced = {}
    for name, tensor in full.items():
        cut = shard_rows(spec, shard, parameter_of(name)) if tensor.dim() else None  # 0-dim: Adam's step
        sliced[name] = tensor.clone() if cut is None else tensor.index_select(cut[0], cut[1])
    return sliced


class GatheredState(Mapping[str, torch.Tensor]):
    """The unsplit stage's checkpoint tensors from every rank's (`shards[r]` is rank r's), each put together
    only when asked: split tensors from every rank's slice, replicated ones (equal on every rank) from rank
    0's. With lazily loading shards (`StateFile`s) a whole stage is never held, only one tensor of it."""

    def __init__(self, shard_rows: ShardRows, spec: Any, shards: Sequence[Mapping[str, torch.Tensor]]) -> None:
        if any(set(s) != set(shards[0]) for s in shards):
            raise ValueError("the ranks of a tensor-parallel stage hold different tensor names")
        self._shard_rows, self._spec, self._shards = shard_rows, spec, shards

    def _cuts(self, name: str) -> list[tuple[int, torch.Tensor] | None]:
        """Each rank's (dimension, indices) of `name` in the unsplit tensor; empty if it is not split."""
        if not stored_layout(self._shards[0], name)[1]:  # 0-dim: Adam's step
            return []
        size = len(self._shards)
        cuts = [self._shard_rows(self._spec, Shard(r, size), parameter_of(name)) for r in range(size)]
        return [] if cuts[0] is None else cuts

    def shape_of(self, name: str) -> list[int]:
        shape = stored_layout(self._shards[0], name)[1]
        cuts = self._cuts(name)
        if cuts and cuts[0] is not None:
            shape[cuts[0][0]] *= len(self._shards)
        return shape

    def dtype_of(self, name: str) -> torch.dtype:
        return stored_layout(self._shards[0], name)[0]

    def __getitem__(self, name: str) -> torch.Tensor:
        first = self._shards[0][name]
        cuts = self._cuts(name)
        if not cuts:
            return first
        whole = first.new_empty(self.shape_of(name))
        for rank, (cut, part) in enumerate(zip(cuts, self._shards, strict=True)):
            if cut is not None:
                whole.index_copy_(cut[0], cut[1], first if rank == 0 else part[name])
        return whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards[0])

    def __len__(self) -> int:
        return len(self._shards[0])
