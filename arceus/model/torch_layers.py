"""Torch pieces the architectures share: the activation functions by name, and torch's default
initialisation of a linear or convolutional layer drawn from a given generator (so a layer gets the same
weights on whichever stage builds it)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


def init_like_torch(weight: torch.Tensor, bias: torch.Tensor, generator: torch.Generator) -> None:
    """nn.Linear's and nn.Conv2d's default distributions (fan-in scaled), drawn from `generator` instead of
    the global random state."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
        bound = 1 / math.sqrt(weight[0].numel())  # 1/sqrt(fan_in)
        nn.init.uniform_(bias, -bound, bound, generator=generator)
