"""A model in the placement solver's terms: what each of its layers costs."""

from __future__ import annotations

from arceus.model.spec import ModelSpec
from arceus.placement.solver import LayerProfile


def layer_profiles(spec: ModelSpec) -> tuple[LayerProfile, ...]:
    """Each layer's cost; its output (fp32 activations on the wire and in the stash) as the spec lays it out;
    its split layers are what a tensor-parallel group divides."""
    split = spec.split_layers()
    return tuple(
        LayerProfile(
            flops_per_sample=float(flops),
            params=params,
            output_bytes_per_sample=spec.output_layout(i).nbytes,
            tensor_parallel=i in split,
        )
        for i, (flops, params) in enumerate(zip(spec.layer_flops_per_sample(), spec.layer_params(), strict=True))
    )

