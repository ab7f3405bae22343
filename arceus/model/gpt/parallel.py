"""Megatron-style tensor parallelism of a GPT block across the `size` ranks of a tensor-parallel group.

Attention is split by heads and the MLP by hidden units. `c_attn` (packed q|k|v) and `c_fc` are
column-parallel: rank r keeps the output rows of its heads / its slice of the 4·d hidden units. Both
`c_proj` are row-parallel: rank r keeps the matching input columns, so its product is a partial sum; the
operator g all-reduces the partials into the unsplit product, and the (replicated) bias is added once,
after the reduce. Each column-parallel input goes through f (identity forward, all-reduce of the input
gradient backward): every rank's partial depends on the whole input, so the input's gradient is the sum
of every rank's. LayerNorms are replicated; f hands every rank the same full gradient, so their
gradients, like everything replicated, come out identical on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.gpt.layers import GPTBlock, gpt_layer
from arceus.model.gpt.spec import GPTSpec
from arceus.model.seeding import layer_generator
from arceus.model.sharding import AllReduce, Shard, copy_to_group, reduce_from_group, slice_state


def check_split(spec: GPTSpec, size: int) -> None:
    """Raise ValueError unless a block of `spec` splits over `size` ranks (whole heads per rank)."""
    if size < 1 or spec.n_head % size:
        raise ValueError(
            f"n_head ({spec.n_head}) must be divisible by the tensor-parallel size ({size}): "
            "each rank takes whole attention heads"
        )


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
        x = copy_to_group(x, self.all_reduce)
        q, k, v = self.c_attn(x).split(self.d_local, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.d_local // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = F.linear(y.transpose(1, 2).contiguous().view(b, t, self.d_local), self.c_proj.weight)
        return reduce_from_group(partial, self.all_reduce) + self.c_proj.bias


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
        x = copy_to_group(x, self.all_reduce)
        partial = F.linear(F.gelu(self.c_fc(x)), self.c_proj.weight)
        return reduce_from_group(partial, self.all_reduce) + self.c_proj.bias


class ParallelBlock(GPTBlock):
    """`GPTBlock` with its attention and MLP split; parameter names and forward are the unsplit block's."""

    def __init__(self, spec: GPTSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__(spec, ParallelAttention(spec, shard, all_reduce), ParallelMLP(spec, shard, all_reduce))


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
    return slice_state(shard_rows, spec, shard, {name: full})[name]


def parallel_layer(
    spec: GPTSpec, layer_index: int, generator: torch.Generator, shard: Shard, all_reduce: AllReduce
) -> ParallelBlock:
    """Rank `shard.rank`'s part of block `layer_index`, holding exactly the slice of the weights the
    unsplit block gets from `generator` (built whole, then cut), so any split trains the same model."""
    if not 1 <= layer_index <= spec.n_layer:
        raise ValueError(f"layer {layer_index} is not a transformer block (blocks are 1..{spec.n_layer})")
    full = gpt_layer(spec, layer_index, generator)
    block = ParallelBlock(spec, shard, all_reduce)
    block.load_state_dict(slice_state(shard_rows, spec, shard, full.state_dict()))
    return block


def build_parallel_block(
    spec: GPTSpec, layer_index: int, seed: int, shard: Shard, all_reduce: AllReduce
) -> ParallelBlock:
    """`parallel_layer` from the model's seed."""
    return parallel_layer(spec, layer_index, layer_generator(seed, layer_index), shard, all_reduce)
