"""A dishonest node agent for the spot-check tests: the shipped agent, except that every training
forward it sends on is perturbed, from the step after `--honest-steps N` (default 0) of its first
driver run; with `--cheat partial`, a replica's partial gradient (what it puts into its stage's exchange)
is perturbed instead, from its (N+1)-th exchanged step. Run as
`python -m tests.e2e.dishonest_agent [--honest-steps N] [--cheat forward|partial] <agent args>`."""

from __future__ import annotations

import sys

import torch

from nodeagent.cli import main
from nodeagent.runtime import MicroBatchKey, StageRuntime
from tests.nodeagent.dishonest_forward import dishonest_forward

honest_gradient = StageRuntime.gradient_vector
honest_steps = 0
exchanged = 0  # partial gradients taken so far (one per exchanged train step)


def perturbed_output(out: torch.Tensor, key: MicroBatchKey) -> torch.Tensor:
    step, _ = key  # the driver's RunStep id: train steps 1, 2, ... until the first validation
    return out if step <= honest_steps else out + 0.01 * torch.randn_like(out)


def perturbed_gradient(self: StageRuntime) -> torch.Tensor:
    global exchanged
    exchanged += 1
    flat = honest_gradient(self)
    return flat if exchanged <= honest_steps else flat + 1e-3 * torch.randn_like(flat)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--honest-steps" in args:
        at = args.index("--honest-steps")
        honest_steps = int(args[at + 1])
        del args[at : at + 2]
    cheat = "forward"
    if "--cheat" in args:
        at = args.index("--cheat")
        cheat = args[at + 1]
        del args[at : at + 2]
    if cheat == "partial":
        StageRuntime.gradient_vector = perturbed_gradient  # type: ignore[method-assign]
    elif cheat == "forward":
        StageRuntime.forward = dishonest_forward(StageRuntime.forward, perturbed_output)  # type: ignore[method-assign]
    else:
        sys.exit(f"--cheat must be forward or partial, got {cheat!r}")
    sys.exit(main(args))
