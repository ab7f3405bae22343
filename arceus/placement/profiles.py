"""A model in the placement solver's terms: what each of its layers costs."""

from __future__ import annotations

import math

from arceus.model.registry import architecture_of
from arceus.model.spec import ModelSpec
from arceus.placement.solver import LayerProfile


def layer_profiles(spec: ModelSpec) -> tuple[LayerProfile, ...]:
    """Each layer's cost; its output (fp32 activations on the wire) as the spec lays it out; its stash, what its
    training forward keeps for the backward (its input, and what the spec says it keeps beside); its split
    layers are what a tensor-parallel group divides; under bf16 autocast a layer's parameters are cast for its
    matmuls, except a layer that takes token ids (an embedding looks its rows up); the last layer's stash holds the
    loss's log-probabilities, as wide as its output. A text writer's blocks (its split layers: the attention
    layers) cache keys and values when they decode, each no wider than the hidden state that enters them."""
    split = spec.split_layers()
    decodes = architecture_of(spec).writes_text
    return tuple(
        LayerProfile(
            flops_per_sample=float(flops),
            params=params,
            output_bytes_per_sample=spec.output_layout(i).nbytes,
            stash_bytes_per_sample=spec.input_layout(i).nbytes + stash.beside,
            kept_output_bytes_per_sample=spec.output_layout(i).nbytes if stash.keeps_output else 0,
            tensor_parallel=i in split,
            kv_cache_bytes_per_sequence=2 * spec.input_layout(i).nbytes if decodes and i in split else 0,
            input_bytes_per_sample=spec.input_layout(i).nbytes,
            cast_params=0 if spec.input_layout(i).dtype.startswith(("int", "uint")) else params,
            loss_bytes_per_sample=spec.output_layout(i).nbytes if i == spec.num_layers - 1 else 0,
            largest_tensor_params=max((math.prod(shape) for shape in spec.layer_parameters(i).values()), default=0),
        )
        for i, (flops, params, stash) in enumerate(
            zip(spec.layer_flops_per_sample(), spec.layer_params(), spec.layer_stash(), strict=True)
        )
    )

