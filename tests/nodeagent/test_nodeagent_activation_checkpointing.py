"""Activation checkpointing: a stage that keeps only each layer's input between forward and backward trains
exactly as one that keeps everything, and keeps far fewer bytes for the backward."""

from __future__ import annotations

import pytest
import torch

from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers
from arceus.model.registry import model_spec_from_config
from nodeagent.runtime import StageRuntime

SPEC = model_spec_from_config(
    {"type": "transformer", "n_layer": 3, "n_head": 4, "d_model": 64, "block_size": 32, "vocab_size": 50}
)
ADAM = OptimizerConfig(name="adam", lr=1e-3)


def runtime(*, recompute: bool, precision: str = "fp32") -> StageRuntime:
    return StageRuntime(
        build_layers(SPEC, 0, SPEC.num_layers, seed=5), optimizer=ADAM, is_first=True, is_last=True,
        input_layout=SPEC.input_layout(0), max_micro_batch_size=8, device=torch.device("cpu"),
        precision=precision, activation_checkpointing=recompute,
    )


def saved_bytes(stage: StageRuntime, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes the forward keeps for the backward (autograd's saved tensors)."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.forward_loss((0, 0), x, y, len(x))
    stage.abort_step()
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputing_trains_exactly_like_keeping_everything(precision: str) -> None:
    kept, recomputed = runtime(recompute=False, precision=precision), runtime(recompute=True, precision=precision)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randint(0, 50, (8, 32), generator=generator)
        y = torch.randint(0, 50, (8, 32), generator=generator)
        losses = []
        for stage in (kept, recomputed):
            for m, (xm, ym) in enumerate(zip(x.split(4), y.split(4), strict=True)):
                losses.append(stage.forward_loss((step, m), xm, ym, len(x))[0])
                stage.backward((step, m))
            stage.optimizer_step()
        assert losses[:2] == losses[2:]
    for (name, a), (_, b) in zip(kept.state_items(), recomputed.state_items(), strict=True):
        assert torch.equal(a, b), name


def test_recomputing_keeps_a_fraction_of_the_bytes_for_the_backward() -> None:
    x, y = torch.randint(0, 50, (8, 32)), torch.randint(0, 50, (8, 32))
    kept, recomputed = saved_bytes(runtime(recompute=False), x, y), saved_bytes(runtime(recompute=True), x, y)
    # Only each layer's input remains: [8, 32, 64] floats per block and the ids, against every
    # intermediate of attention and the MLP.
    assert recomputed < kept / 5, (recomputed, kept)
