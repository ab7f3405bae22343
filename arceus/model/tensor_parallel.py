"""Megatron-style tensor parallelism of a GPT block across the `size` ranks of a tensor-parallel group.

Attention is split by heads and the MLP by hidden units. `c_attn` (packed q|k|v) and `c_fc` are
column-parallel: rank r keeps the output rows of its heads / its slice of the 4·d hidden units. Both
`c_proj` are row-parallel: rank r keeps the matching input columns, so its product is a partial sum; the
operator g all-reduces the partials into the unsplit product, and the (replicated) bias is added once,
after the reduce. Each column-parallel input goes through f (identity forward, all-reduce of the input
gradient backward): every rank's partial depends on the whole input, so the input's gradient is the sum
of every rank's. LayerNorms are replicated; f hands every rank the same full gradient, so their
gradients, like everything replicated, come out identical on every rank.

The collective is injected (`AllReduce`), so compute knows nothing of how the ranks talk. It must sum
in the same (rank) order everywhere, so that replicated values stay bitwise equal across ranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arceus.checkpoint import OPTIMIZER_PREFIX
from arceus.model.build import layer_generator
from arceus.model.gpt import gpt_layer
from arceus.model.gpt_spec import GPTSpec

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """This rank's place in its tensor-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a tensor-parallel group has at least 1 rank, got size {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")


def check_split(spec: GPTSpec, size: int) -> None:
    """Raise ValueError unless a block of `spec` splits over `size` ranks (whole heads per rank)."""
    if size < 1 or spec.n_head % size:
        raise ValueError(
            f"n_head ({spec.n_head}) must be divisible by the tensor-parallel size ({size}): "
            "each rank takes whole attention heads"
        )


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


class ParallelAttention(nn.Module):
    """This rank's heads of `CausalSelfAttention`; its forward returns the whole (reduced) output."""

    def __init__(self, spec: GPTSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__()
        check_split(spec, shard.size)
        self.n_head = spec.n_head // shard.size
        self.d_local = spec.d_model // shard.size
        self.all_reduce = all_reduce
        self.c_attn = nn.Linear(spec.d_model, 3 * self.d_local)  # this rank's q, k and v rows
        self.c_proj = nn.Linear(self.d_local, spec.d_model)  # its columns; the bias is added after g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = _CopyToGroup.apply(x, self.all_reduce)
        q, k, v = self.c_attn(x).split(self.d_local, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.d_local // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = F.linear(y.transpose(1, 2).contiguous().view(b, t, self.d_local), self.c_proj.weight)
        return _ReduceFromGroup.apply(partial, self.all_reduce) + self.c_proj.bias


class ParallelMLP(nn.Module):
    """This rank's hidden units of `MLP`; its forward returns the whole (reduced) output."""

    def __init__(self, spec: GPTSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__()
        check_split(spec, shard.size)
        hidden = 4 * spec.d_model // shard.size
        self.all_reduce = all_reduce
        self.c_fc = nn.Linear(spec.d_model, hidden)
        self.c_proj = nn.Linear(hidden, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToGroup.apply(x, self.all_reduce)
        partial = F.linear(F.gelu(self.c_fc(x)), self.c_proj.weight)
        return _ReduceFromGroup.apply(partial, self.all_reduce) + self.c_proj.bias


class ParallelBlock(nn.Module):
    """`GPTBlock` with its attention and MLP split; parameter names are the unsplit block's."""

    def __init__(self, spec: GPTSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.attn = ParallelAttention(spec, shard, all_reduce)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.mlp = ParallelMLP(spec, shard, all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def shard_rows(spec: GPTSpec, shard: Shard, name: str) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) that cut rank `shard.rank`'s part of the unsplit block's parameter `name` (a
    `GPTBlock` state-dict name, optionally prefixed), or None where the parameter is replicated."""
    check_split(spec, shard.size)
    d, r, w = spec.d_model, shard.rank, shard.size
    local = d // w
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        # Packed q|k|v: the rank's heads are the same rows of each third.
        rows = torch.arange(r * local, (r + 1) * local)
        return 0, torch.cat([rows, rows + d, rows + 2 * d])
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return 0, torch.arange(r * 4 * local, (r + 1) * 4 * local)
    if name.endswith("attn.c_proj.weight"):
        return 1, torch.arange(r * local, (r + 1) * local)
    if name.endswith("mlp.c_proj.weight"):
        return 1, torch.arange(r * 4 * local, (r + 1) * 4 * local)
    return None


def shard_tensor(spec: GPTSpec, shard: Shard, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank `shard.rank`'s part of the unsplit parameter (or gradient) `name`."""
    cut = shard_rows(spec, shard, name)
    return full.clone() if cut is None else full.index_select(cut[0], cut[1])


def shard_state(spec: GPTSpec, shard: Shard, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: shard_tensor(spec, shard, name, tensor) for name, tensor in full.items()}


def _parameter_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to: itself, or, for an optimizer entry
    ("optimizer.<parameter>.<key>"), the parameter it is kept for."""
    if name.startswith(OPTIMIZER_PREFIX):
        return name.removeprefix(OPTIMIZER_PREFIX).rpartition(".")[0]
    return name


def slice_state_tensors(spec: GPTSpec, shard: Shard, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank `shard.rank`'s part of an unsplit stage's checkpoint tensors (weights and optimizer state)."""
    sliced = {}
    for name, tensor in full.items():
        cut = shard_rows(spec, shard, _parameter_of(name)) if tensor.dim() else None  # 0-dim: Adam's step
        sliced[name] = tensor.clone() if cut is None else tensor.index_select(cut[0], cut[1])
    return sliced


def gather_state_tensors(spec: GPTSpec, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unsplit stage's checkpoint tensors from every rank's (`shards[r]` is rank r's): split tensors
    are put back together, replicated ones (equal on every rank) are taken from rank 0."""
    size = len(shards)
    if any(set(s) != set(shards[0]) for s in shards):
        raise ValueError("the ranks of a tensor-parallel stage hold different tensor names")
    full = {}
    for name, first in shards[0].items():
        cuts = [shard_rows(spec, Shard(r, size), _parameter_of(name)) for r in range(size)] if first.dim() else []
        if not cuts or cuts[0] is None:
            full[name] = first
            continue
        dim = cuts[0][0]
        shape = list(first.shape)
        shape[dim] *= size
        whole = first.new_empty(shape)
        for cut, part in zip(cuts, shards, strict=True):
            if cut is not None:
                whole.index_copy_(dim, cut[1], part[name])
        full[name] = whole
    return full


def build_parallel_block(
    spec: GPTSpec, layer_index: int, seed: int, shard: Shard, all_reduce: AllReduce
) -> ParallelBlock:
    """Rank `shard.rank`'s part of block `layer_index`, holding exactly the slice of the weights the
    unsplit block gets from the same seed (built whole, then cut), so any split trains the same model."""
    if not 1 <= layer_index <= spec.n_layer:
        raise ValueError(f"layer {layer_index} is not a transformer block (blocks are 1..{spec.n_layer})")
    full = gpt_layer(spec, layer_index, layer_generator(seed, layer_index))
    block = ParallelBlock(spec, shard, all_reduce)
    block.load_state_dict(shard_state(spec, shard, full.state_dict()))
    return block


def build_parallel_layers(
    spec: GPTSpec, start: int, end: int, seed: int, shard: Shard, all_reduce: AllReduce
) -> nn.Sequential:
    """`build_layers` for rank `shard.rank` of a tensor-parallel stage: blocks are split; the embedding
    and the head (cheap next to the blocks) are replicated, computed whole on every rank."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not inside the model's {spec.num_layers} layers")
    return nn.Sequential(
        OrderedDict(
            (
                str(i),
                build_parallel_block(spec, i, seed, shard, all_reduce)
                if 1 <= i <= spec.n_layer
                else gpt_layer(spec, i, layer_generator(seed, i)),
            )
            for i in range(start, end)
        )
    )
