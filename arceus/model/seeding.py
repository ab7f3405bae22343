"""Where a model's randomness comes from.

Initial weights: each layer's from a generator seeded by (seed, layer index) only, so a stage [1, 3) on one
machine holds exactly the weights layers 1 and 2 have in the single-process model.

A training forward's draws (dropout's masks): each layer's, for micro-batch m of training step t, from the
global generators seeded by (seed, t, m, layer index) only. So a micro-batch draws the same masks on whichever
replica runs it, in a recompute (the repair of a lost replica's micro-batch, activation checkpointing's second
forward) and in one process running the same micro-batches, however the model is cut into stages. Those generators
are the process's: seeded draws on two threads at once (an agent's stages, a sibling's recompute beside them, agents
sharing a process) take turns, else one's seed would move the other's draws."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_SEED_STRIDE = 1_000_003  # a prime, so (seed, layer) pairs do not collide for any realistic depth
_MASK = 2**63
_DRAWING = threading.RLock()  # one seeded draw at a time per process: the generators are global


def layer_generator(seed: int, layer_index: int) -> torch.Generator:
    """The generator that initialises `layer_index`; depends on nothing else."""
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + layer_index) % _MASK)


def draw_seed(seed: int, step: int, micro_batch: int, layer_index: int) -> int:
    """The seed of layer `layer_index`'s draws in micro-batch `micro_batch` of training step `step`."""
    value = seed
    for part in (step, micro_batch, layer_index):
        value = (value * _SEED_STRIDE + part + 1) % _MASK
    return value


def draws_random(layer: nn.Module) -> bool:
    """Whether `layer`'s training forward draws random numbers: it holds a torch dropout module, or says so
    (`draws_random = True`, as an exported layer whose graph calls dropout does)."""
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) or getattr(m, "draws_random", False) is True
        for m in layer.modules()
    )


@contextmanager
def seeded_draws(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: the CPU's generator (and `device`'s, when it is an accelerator) seeded by `seed`, held by this thread
    alone; after: the generators as they were, so nothing else's draws depend on how many this one took."""
    devices = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    with _DRAWING, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
