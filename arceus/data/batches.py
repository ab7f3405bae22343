"""Deterministic mini-batch order: the driver and the single-process reference see the same batches."""

from __future__ import annotations

import torch

_EPOCH_STRIDE = 1_000_003


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Index tensors of one epoch: a shuffle seeded by (seed, epoch) only, cut into `batch_size` chunks;
    the last, partial batch is kept."""
    if n < 0 or batch_size < 1:
        raise ValueError(f"need n >= 0 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    generator = torch.Generator().manual_seed((seed * _EPOCH_STRIDE + epoch) % 2**63)
    return [] if n == 0 else list(torch.randperm(n, generator=generator).split(batch_size))
