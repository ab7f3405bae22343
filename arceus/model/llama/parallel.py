"""Megatron-style tensor parallelism of a Llama decoder layer across the `size` ranks of a tensor-parallel
group.

Attention is split by key/value head groups: rank r keeps its num_key_value_heads/size key/value heads and
the query heads that read them (query head j reads key/value head j // (heads / kv_heads), so both are
contiguous rows). The MLP is split by intermediate units. q, k, v, gate and up are column-parallel (the
rank's output rows), o and down row-parallel (the matching input columns), so each rank's output is a
partial sum that the operator g all-reduces; there are no biases to add after it. Each split input goes
through f (identity forward, all-reduce of its gradient backward). The RMSNorms are replicated.
"""

from __future__ import annotations

import torch

from arceus.model.decoding import KVCache
from arceus.model.llama.layers import LlamaAttention, LlamaDecoderLayer, LlamaMLP, llama_layer
from arceus.model.llama.spec import LlamaSpec, tensor_parallel_check_size
from arceus.model.sharding import AllReduce, Shard, copy_to_group, reduce_from_group, slice_state


class ParallelAttention(LlamaAttention):
    """This rank's key/value groups of `LlamaAttention`; returns the whole (reduced) output."""

    def __init__(self, spec: LlamaSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__(spec, spec.num_attention_heads // shard.size, spec.num_key_value_heads // shard.size)
        self.all_reduce = all_reduce

    def decode(self, x: torch.Tensor, position: int, cache: KVCache | None) -> torch.Tensor:
        partial = super().decode(copy_to_group(x, self.all_reduce), position, cache)
        return reduce_from_group(partial, self.all_reduce)


class ParallelMLP(LlamaMLP):
    """This rank's intermediate units of `LlamaMLP`; returns the whole (reduced) output."""

    def __init__(self, spec: LlamaSpec, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__(spec, spec.intermediate_size // shard.size)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(super().forward(copy_to_group(x, self.all_reduce)), self.all_reduce)


def shard_rows(spec: LlamaSpec, shard: Shard, name: str) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) that cut rank `shard.rank`'s part of the unsplit layer's parameter `name` (a
    `LlamaDecoderLayer` state-dict name, optionally prefixed), or None where it is replicated."""
    tensor_parallel_check_size(spec, shard.size)
    r, w = shard.rank, shard.size
    q_rows = spec.hidden_size // w
    kv_rows = spec.kv_size // w
    units = spec.intermediate_size // w
    cuts = {
        "self_attn.q_proj.weight": (0, q_rows), "self_attn.k_proj.weight": (0, kv_rows),
        "self_attn.v_proj.weight": (0, kv_rows), "self_attn.o_proj.weight": (1, q_rows),
        "mlp.gate_proj.weight": (0, units), "mlp.up_proj.weight": (0, units), "mlp.down_proj.weight": (1, units),
    }
    for suffix, (dim, rows) in cuts.items():
        if name.endswith(suffix):
            return dim, torch.arange(r * rows, (r + 1) * rows)
    return None


def parallel_layer(
    spec: LlamaSpec, layer_index: int, generator: torch.Generator, shard: Shard, all_reduce: AllReduce
) -> LlamaDecoderLayer:
    """Rank `shard.rank`'s part of decoder layer `layer_index`, holding exactly its slice of the weights the
    unsplit layer gets from `generator` (built whole, then cut), so any split trains the same model."""
    if not 1 <= layer_index <= spec.num_hidden_layers:
        raise ValueError(
            f"layer {layer_index} is not a decoder layer (decoder layers are 1..{spec.num_hidden_layers})"
        )
    full = llama_layer(spec, layer_index, generator)
    layer = LlamaDecoderLayer(spec, ParallelAttention(spec, shard, all_reduce), ParallelMLP(spec, shard, all_reduce))
    layer.load_state_dict(slice_state(shard_rows, spec, shard, full.state_dict()))
    return layer
