"""A dishonest node agent for the spot-check test: the shipped agent, except that every training
forward it sends on is perturbed. Run as `python -m tests.e2e.dishonest_agent <agent args>`."""

from __future__ import annotations

import sys

import torch

from nodeagent.cli import main
from nodeagent.runtime import StageRuntime

honest_forward = StageRuntime.forward


def perturbed_forward(self: StageRuntime, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    out = honest_forward(self, key, x)
    return out + 0.01 * torch.randn_like(out)


StageRuntime.forward = perturbed_forward  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
