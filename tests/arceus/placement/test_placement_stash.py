"""The solver's activation stash per layer is what autograd really keeps: a stage's training forward (and the
loss, on the last stage) is run under saved-tensor hooks and every distinct non-parameter storage counted; under
bf16 autocast (the casts of the weights included) and with activation checkpointing too, as a stage runs them
(`nodeagent.runtime.StageRuntime`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from arceus.model.autocast import autocast
from arceus.model.build import build_layers
from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import LayerProfile, Workload, micro_batch_bytes

CONFIGS: list[dict[str, Any]] = [
    {"layer_sizes": [64, 128, 64, 10]},
    {"layer_sizes": [784, 512, 256, 10], "activation": "tanh"},
    {"layer_sizes": [32, 64, 64, 5], "activation": "gelu"},
    {"type": "transformer", "n_layer": 3, "n_head": 4, "d_model": 64, "block_size": 32, "vocab_size": 50},
    {"type": "transformer", "n_layer": 2, "n_head": 8, "d_model": 256, "block_size": 128, "vocab_size": 300},
    {"type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
     "num_key_value_heads": 2, "max_position_embeddings": 32, "vocab_size": 50},
    {"type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
     "max_position_embeddings": 64, "vocab_size": 300},
    {"type": "convnet", "channels": [8, 16], "input_shape": [1, 28, 28], "classes": 10},
    {"type": "convnet", "channels": [4], "input_shape": [3, 16, 16], "classes": 7, "activation": "tanh"},
    {"type": "convnet", "channels": [6, 6], "input_shape": [2, 12, 12], "classes": 3, "activation": "gelu"},
]


def saved_bytes(
    config: dict[str, Any], start: int, end: int, batch: int = 3, precision: str = "fp32", recompute: bool = False
) -> float:
    """Bytes per sample the training forward of layers [start, end) keeps for the backward, its input included (and
    the stage's output, which it holds for the backward, where that is no layer's saved tensor)."""
    spec = model_spec_from_config(config)
    layers = build_layers(spec, start, end, seed=0)
    layout = spec.input_layout(start)
    x = (torch.randint(0, layout.bound or 2, (batch, *layout.shape)) if layout.dtype == "int64"
         else torch.randn(batch, *layout.shape, requires_grad=True))
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(torch.device("cpu"), precision):
        out = x
        for layer in layers:
            out = checkpoint(layer, out, use_reentrant=False) if recompute else layer(out)
        if end == spec.num_layers:
            F.cross_entropy(out.flatten(0, -2), torch.zeros(out.shape[:-1], dtype=torch.int64).flatten())
        elif recompute and out.untyped_storage().data_ptr() not in kept:
            kept[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    stash = sum(n for ptr, n in kept.items() if ptr not in params)
    if layout.dtype == "int64" or x.untyped_storage().data_ptr() not in kept:
        stash += layout.nbytes * batch  # the stage keeps its input even where no layer saves it (ids, for instance)
    return stash / batch


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.get('type', 'mlp')}-{len(c)}")
def test_the_stash_of_any_stage_is_what_autograd_keeps_within_ten_percent(config: dict[str, Any]) -> None:
    # (Or within 2 KiB: an embedding keeps a few position ids per batch, not per sample.)
    spec = model_spec_from_config(config)
    profiles = layer_profiles(spec)
    for start in range(spec.num_layers):
        for end in range(start + 1, spec.num_layers + 1):
            stage = profiles[start:end]
            modelled = sum(p.stash_bytes_per_sample for p in stage) + stage[-1].kept_output_bytes_per_sample
            measured = saved_bytes(config, start, end)
            assert modelled == pytest.approx(measured, rel=0.10, abs=2048), (start, end, modelled, measured)


def kept_bytes(stage: tuple[LayerProfile, ...], workload: Workload) -> int:
    """What the memory model says autograd keeps of one micro-batch: `micro_batch_bytes`, less (with activation
    checkpointing) the heap its forward strands, which is the allocator's, not autograd's."""
    if not workload.activation_checkpointing:
        return micro_batch_bytes(stage, workload)
    inputs = sum(p.input_bytes_per_sample for p in stage)
    return workload.micro_batch_size * (inputs + stage[-1].output_bytes_per_sample)


# Under bf16 a Llama's RMSNorm and rotary embedding and a convnet's pooling keep float32 tensors that the model
# counts at half width (20-30% of their stash under, measured): the model's bf16 rule is checked where it holds.
BF16_CONFIGS = [c for c in CONFIGS if c.get("type", "mlp") in ("mlp", "transformer")]


@pytest.mark.parametrize(
    ("config", "precision", "recompute"),
    [(c, "fp32", True) for c in CONFIGS] + [(c, "bf16", r) for c in BF16_CONFIGS for r in (False, True)],
    ids=lambda v: f"{v.get('type', 'mlp')}-{len(v)}" if isinstance(v, dict) else str(v),
)
def test_what_a_micro_batch_keeps_under_bf16_and_with_recompute_is_what_autograd_keeps(
    config: dict[str, Any], precision: str, recompute: bool
) -> None:
    # bf16: its layers' activations in bfloat16 and every micro-batch's own cast of the matmuls' weights.
    # Recompute: each layer's input and the stage's output (or the loss's log-probabilities).
    spec = model_spec_from_config(config)
    profiles = layer_profiles(spec)
    workload = Workload(3, 1, precision=precision, activation_checkpointing=recompute)
    for start in range(spec.num_layers):
        for end in range(start + 1, spec.num_layers + 1):
            modelled = kept_bytes(profiles[start:end], workload)
            measured = 3 * saved_bytes(config, start, end, 3, precision, recompute)
            assert modelled == pytest.approx(measured, rel=0.15, abs=6144), (start, end, modelled, measured)
