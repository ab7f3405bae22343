"""Spot checks, the torch side (never grpc): what a stage keeps of a step for an audit, the recomputation of
another node's forward from the declarative spec and the weights it used, and a replica's recomputation of a
sibling's partial gradient with its own weights (they are the same bits)."""

from __future__ import annotations

from collections.abc import Sequence
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


def recompute_partial(
    layers: torch.nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    is_last: bool,
    batch_size: int,
    device: torch.device,
    precision: str = "fp32",
) -> torch.Tensor:
    """The partial gradient a replica of this stage computes from `micro_batches`, each (input, the gradient its
    output received) or, on the last stage, (input, labels) scaled as the stage scales its loss (the sum over
    labels / (batch_size x labels per sample)): the sum over the micro-batches of d(output)/d(weights), flattened
    in parameter order (zeros for a parameter no forward uses), as float32 on the CPU. `layers` keep their weights,
    gradients and buffers: the recomputation runs on copies of the buffers and never writes `.grad`. ValueError for
    inputs, gradients or labels that do not fit the layers."""
    params = dict(layers.named_parameters())
    buffers = {name: b.detach().clone() for name, b in layers.named_buffers()}
    total = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float32)
    for x, target in micro_batches:
        try:
            with autocast(device, precision):
                out = torch.func.functional_call(layers, {**params, **buffers}, (x.to(device),))
                if is_last:
                    flat_logits, flat_target = out.flatten(0, -2), target.to(device).flatten()
                    loss = torch.nn.functional.cross_entropy(flat_logits, flat_target, reduction="sum")
                    root, seed = loss / (batch_size * target[0].numel()), None
                else:
                    if target.shape != out.shape:
                        raise ValueError(f"a gradient of shape {list(target.shape)} for an output of {list(out.shape)}")
                    root, seed = out, target.to(device, out.dtype)
            grads = torch.autograd.grad(root, list(params.values()), grad_outputs=seed, allow_unused=True)
        except RuntimeError as exc:  # torch's shape and dtype errors: the micro-batch does not fit the layers
            raise ValueError(f"cannot recompute the partial gradient: {exc}") from None
        total += torch.cat([
            (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
            for g, p in zip(grads, params.values(), strict=True)
        ])
    return total
