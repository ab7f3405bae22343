"""Spot checks, the torch side (never grpc): what a stage keeps of a step for an audit, and the recomputation of
another node's forward from the declarative spec and the weights it used. (A replica's recomputation of a sibling's
partial gradient with its own weights, the same bits, is its runtime's: `StageRuntime.recompute_partial`.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from arceus.model.autocast import autocast
from arceus.model.build import build_layers, named_global_parameters
from arceus.model.registry import model_spec_from_config


@dataclass
class AuditRecord:
    """One train step of a stage: the activations it received and sent (by micro-batch, as delivered).
    The weights its forwards used are the stage's own until its next call (the optimizer step waits)."""

    step: int
    train_step: int  # the training step it ran (seeds its draws), which its call id `step` need not be
    received: dict[int, torch.Tensor] = field(default_factory=dict)
    sent: dict[int, torch.Tensor] = field(default_factory=dict)
    # Replicated stages: the gradient each micro-batch's output received, and the replica's partial gradient before
    # the exchange (flattened as arceus.swarm.exchange lays it out).
    gradients: dict[int, torch.Tensor] = field(default_factory=dict)
    partial: torch.Tensor | None = None


def recompute_forward(
    model_config: dict[str, Any],
    layer_start: int,
    layer_end: int,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    device: torch.device,
    precision: str = "fp32",
) -> torch.Tensor:
    """Layers [layer_start, layer_end) of the model, built from its spec and loaded with exactly `weights`,
    applied to `x` in the job's `precision` (float32 out, as a stage sends it); SpecError for a bad spec or
    range, ValueError for weights that do not fit."""
    spec = model_spec_from_config(model_config)
    if not 0 <= layer_start < layer_end <= spec.num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not within the model's {spec.num_layers} layers")
    layers = build_layers(spec, layer_start, layer_end, seed=0).to(device)
    params = dict(named_global_parameters(layers))
    if set(weights) != set(params):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(
            f"weights do not match layers [{layer_start}, {layer_end}): missing {missing}, unexpected {extra}"
        )
    with torch.no_grad():
        for name, param in params.items():
            if weights[name].shape != param.shape or weights[name].dtype != param.dtype:
                raise ValueError(
                    f"weight {name} is {weights[name].dtype} {list(weights[name].shape)}; "
                    f"the layer has {param.dtype} {list(param.shape)}"
                )
            param.copy_(weights[name].to(device))
        try:
            with autocast(device, precision):
                return layers(x.to(device)).float().cpu()
        except RuntimeError as exc:  # torch's shape and dtype errors: the input does not fit the layers
            raise ValueError(
                f"layers [{layer_start}, {layer_end}) cannot take input {x.dtype} {list(x.shape)}: {exc}"
            ) from None
