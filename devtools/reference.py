"""The yardsticks tests and benchmarks compare a distributed (and interrupted) run against: single-process
training of a job, batch for batch what the pipeline does, and the weights a running pipeline holds."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arceus.checkpoint import StateFile
from arceus.contracts.assignment import OptimizerConfig
from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.model.buffers import BufferSteps, persistent_buffers
from arceus.model.build import build_full_model
from arceus.model.optimizers import make_optimizer
from arceus.model.registry import model_spec_from_config
from arceus.model.seeding import draw_seed, draws_random, seeded_draws
from arceus.training.driver import Pipeline
from arceus.training.plan import TrainPlan


@dataclass(frozen=True)
class ReferenceRun:
    losses: list[float]  # per training step
    val_loss: float
    val_accuracy: float
    weights: dict[str, torch.Tensor]  # model-wide names, as a pipeline's stages name them


def reference_run(
    job: dict[str, Any],
    *,
    max_steps: int | None = None,
    initial_weights: dict[str, torch.Tensor] | None = None,
    model: nn.Module | None = None,
) -> ReferenceRun:
    """Train the job's model in this process (one thread's torch) with the job's settings and data order.

    `job` is the submitted shape: model_config, dataset_config, epochs, learning_rate, optimizer,
    momentum, weight_decay, seed, staleness (1: each step's gradient is taken at the weights before the previous
    step's update and applied to the current ones, PipeDream-2BW's W(t+1) = W(t) - lr * g(W(t-1)), W(-1) = W(0)).
    `initial_weights` (model-wide names): what it starts from instead of the seeded weights, as a job with uploaded
    weights does. `model`: the module an exported model's job was captured from, trained (a copy of it) instead of
    one built from the job's model config.
    """
    dataset = validate_dataset_config(job["dataset_config"])
    seed = job.get("seed", 0)
    model = build_full_model(model_spec_from_config(job["model_config"]), seed) if model is None else deepcopy(model)
    if initial_weights is not None:
        model.load_state_dict({name.removeprefix("layers."): t for name, t in initial_weights.items()})
    params = list(model.parameters())
    lr, weight_decay = job["learning_rate"], job.get("weight_decay", 0.0)
    optimizer = make_optimizer(
        params, job.get("optimizer", "sgd"), lr, momentum=job.get("momentum", 0.0), weight_decay=weight_decay
    )
    train_x, train_y, val_x, val_y = load_dataset(dataset)
    stale = job.get("staleness", 0) == 1
    previous: list[torch.Tensor] | None = None  # staleness 1: the weights before the last update
    losses: list[float] = []
    for epoch in range(1, job.get("epochs", 1) + 1):
        for indices in epoch_batches(len(train_x), dataset["batch_size"], seed, epoch):
            if max_steps is not None and len(losses) >= max_steps:
                break
            current = [p.detach().clone() for p in params] if stale else []
            if previous is not None:
                _assign(params, previous)
            loss = _cross_entropy(model(train_x[indices]), train_y[indices])
            optimizer.zero_grad()
            loss.backward()
            if stale:  # the gradient of the old weights updates the current ones
                _assign(params, current)
                previous = current
            optimizer.step()
            losses.append(loss.item())
    with torch.no_grad():
        logits = model(val_x)
        val_loss = _cross_entropy(logits, val_y).item()
        val_accuracy = (logits.argmax(dim=-1) == val_y).float().mean().item()
    weights = {f"layers.{name}": t.detach().clone() for name, t in model.state_dict().items()}
    return ReferenceRun(losses=losses, val_loss=val_loss, val_accuracy=val_accuracy, weights=weights)


@dataclass(frozen=True)
class MicroBatchedRun:
    losses: list[float]  # per training step
    weights: dict[str, torch.Tensor]  # model-wide names
    buffers: dict[str, torch.Tensor]  # model-wide names ("layers.<i>.<buffer>")


def micro_batched_run(
    layers: nn.Sequential,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    micro_batches: int,
    optimizer: OptimizerConfig,
    seed: int,
) -> MicroBatchedRun:
    """What one process computes for a model whose layers draw random numbers or keep buffers that training
    updates (dropout, BatchNorm), where a pipeline's micro-batches make a difference: `layers` (children named by
    their model-wide index, as `build_layers` names them; trained in place) train on `batches`, step t (1, 2, ...)
    cutting its batch into `micro_batches` as the driver does and, for each micro-batch m in order, running each
    layer with its draws seeded by (seed, t, m, layer) (arceus.model.seeding) and the loss at the global batch's
    scale; gradients add up, the optimizer steps once a step and the buffers move by the mean of the micro-batches'
    changes, each forward starting from the step's start (arceus.model.buffers)."""
    params = list(layers.parameters())
    step_optimizer = make_optimizer(
        params, optimizer.name, optimizer.lr, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay
    )
    buffers = BufferSteps(layers)
    losses: list[float] = []
    for step, (x, y) in enumerate(batches, 1):
        total = 0.0
        for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches),
                                         strict=True)):
            h = xm
            for name, layer in layers.named_children():
                if draws_random(layer):
                    with seeded_draws(draw_seed(seed, step, m, int(name)), torch.device("cpu")):
                        h = layer(h)
                else:
                    h = layer(h)
            buffers.forwarded()
            loss = F.cross_entropy(h.flatten(0, -2), ym.flatten(), reduction="sum") / y.numel()
            loss.backward()
            total += loss.item()
        step_optimizer.step()
        buffers.apply()
        step_optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return MicroBatchedRun(
        losses=losses,
        weights={f"layers.{name}": p.detach().clone() for name, p in layers.named_parameters()},
        buffers={f"layers.{name}": b.detach().clone() for name, b in persistent_buffers(layers)},
    )


def _assign(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over every label: one per sample, or one per position of a GPT's [B, T, V] logits."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def fetch_weights(plan: TrainPlan) -> dict[str, torch.Tensor]:
    """All parameters of the pipeline in `plan`, under their model-wide names ("layers.0.weight", ...)."""
    weights: dict[str, torch.Tensor] = {}
    with Pipeline(plan) as pipeline, tempfile.TemporaryDirectory() as directory:
        for state in pipeline.states(Path(directory), include_optimizer_state=False):
            weights.update(StateFile(state.path))
    return weights
