"""Where each layer's initial weights come from: a generator seeded by (seed, layer index) only, so a
stage [1, 3) on one machine holds exactly the weights layers 1 and 2 have in the single-process model."""

from __future__ import annotations

import torch

_SEED_STRIDE = 1_000_003  # a prime, so (seed, layer) pairs do not collide for any realistic depth


def layer_generator(seed: int, layer_index: int) -> torch.Generator:
    """The generator that initialises `layer_index`; depends on nothing else."""
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + layer_index) % 2**63)
