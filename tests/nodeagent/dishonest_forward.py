"""A stage that computes a wrong forward, for the spot-check tests (in process and the e2e cheat agent): one
wrapper of StageRuntime.forward that passes every argument on, so a change of its signature breaks no test."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from nodeagent.runtime import MicroBatchKey, StageRuntime

Perturb = Callable[[torch.Tensor, MicroBatchKey], torch.Tensor]


def dishonest_forward(honest: Callable[..., torch.Tensor], perturb: Perturb) -> Callable[..., torch.Tensor]:
    """`honest` (StageRuntime.forward, bound to a runtime or not) returning `perturb(output, key)` instead of its
    output, `key` the micro-batch's (step, micro_batch)."""
    signature = inspect.signature(honest)

    @functools.wraps(honest)
    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        key = signature.bind(*args, **kwargs).arguments["key"]
        return perturb(honest(*args, **kwargs), key)

    return forward


def make_dishonest(runtime: StageRuntime, perturb: Perturb) -> None:
    """`runtime` returns `perturb(output, key)` from now on. Set on the instance, not through pytest's monkeypatch,
    whose undo list would hold the runtime past its agent's stop: the stage's drop then waits its whole grace for a
    runtime nothing else holds. The runtime goes with its agent at the test's end."""
    runtime.forward = dishonest_forward(runtime.forward, perturb)  # type: ignore[method-assign]


def noise(out: torch.Tensor, _key: MicroBatchKey) -> torch.Tensor:
    """An output off by 0.01 to 0.02 in every element: far beyond any rounding a spot check allows."""
    return out + 0.01 * (1 + torch.rand(1))
