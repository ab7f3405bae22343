"""A dishonest node agent for the spot-check test: the shipped agent, except that every training
forward it sends on is perturbed, from the step after `--honest-steps N` (default 0) of its first
driver run. Run as `python -m tests.e2e.dishonest_agent [--honest-steps N] <agent args>`."""

from __future__ import annotations

import sys

import torch

from nodeagent.cli import main
from nodeagent.runtime import StageRuntime

honest_forward = StageRuntime.forward
honest_steps = 0


def perturbed_forward(self: StageRuntime, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    out = honest_forward(self, key, x)
    step, _ = key  # the driver's RunStep id: train steps 1, 2, ... until the first validation
    return out if step <= honest_steps else out + 0.01 * torch.randn_like(out)


StageRuntime.forward = perturbed_forward  # type: ignore[method-assign]

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--honest-steps" in args:
        at = args.index("--honest-steps")
        honest_steps = int(args[at + 1])
        del args[at : at + 2]
    sys.exit(main(args))
