"""A staleness-1 step (PipeDream-2BW) computes what a synchronous one does: the same aten ops on the same micro-batches,
its forwards and backwards over its own weights version, with one copy of the weights a step (the version the
update writes, which the memory model counts), whether it runs alone or overlaps the step before it."""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers
from arceus.model.gpt.spec import GPTSpec
from nodeagent.runtime import StageRuntime

SPEC = GPTSpec(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16)
MICRO_BATCHES = 3
# Beside the ops it computes, a stale step takes views (detach) of its version's tensors: no data moves.
VIEWS = "aten.detach.default"


class OpCounts(TorchDispatchMode):
    """Every aten op run under it (in the thread that entered it), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def middle_stage() -> StageRuntime:
    return StageRuntime(
        build_layers(SPEC, 1, 3, seed=0), optimizer=OptimizerConfig("adam", 1e-3), is_first=False, is_last=False,
        input_layout=SPEC.input_layout(1), max_micro_batch_size=2, device=torch.device("cpu"),
    )


def inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(2, 8, 16, generator=g) for _ in range(MICRO_BATCHES)],
            [torch.randn(2, 8, 16, generator=g) for _ in range(MICRO_BATCHES)])


def forwards(stage: StageRuntime, step: int, xs: list[torch.Tensor]) -> None:
    for m, x in enumerate(xs):
        stage.forward((step, m), x)


def backwards(stage: StageRuntime, step: int, grads: list[torch.Tensor]) -> None:
    for m, grad in enumerate(grads):
        stage.backward((step, m), grad)


def extra_ops(got: Counter[str], want: Counter[str]) -> dict[str, int]:
    """The ops `got` ran more (or fewer) times than `want`, views left out."""
    return {op: got[op] - want[op] for op in got.keys() | want.keys() if got[op] != want[op] and op != VIEWS}


def synchronous_step(stage: StageRuntime, step: int) -> Counter[str]:
    xs, grads = inputs()
    with OpCounts() as ops:
        forwards(stage, step, xs)
        backwards(stage, step, grads)
        stage.optimizer_step()
    return ops.counts


def test_a_stale_step_alone_runs_the_synchronous_ops_and_copies_the_weights_once() -> None:
    xs, grads = inputs()
    synchronous, stale = middle_stage(), middle_stage()
    synchronous_step(synchronous, 1)
    want = synchronous_step(synchronous, 2)
    stale.stale_begin(1)
    forwards(stale, 1, xs)
    backwards(stale, 1, grads)
    stale.stale_gradients(1)
    stale.optimizer_step()
    with OpCounts() as ops:
        stale.stale_begin(2)
        forwards(stale, 2, xs)
        backwards(stale, 2, grads)
        stale.stale_gradients(2)
        stale.optimizer_step()
    assert extra_ops(ops.counts, want) == {"aten.clone.default": len(list(stale.layers.parameters()))}


def test_overlapping_stale_steps_run_the_synchronous_ops() -> None:
    """Step 2's forwards in a thread of their own while step 1's backwards run, as a stage chains them."""
    xs, grads = inputs()
    synchronous, stale = middle_stage(), middle_stage()
    want = synchronous_step(synchronous, 1) + synchronous_step(synchronous, 2)
    chained_ops = OpCounts()  # a dispatch mode holds for the thread that entered it

    def chained_forwards() -> None:
        with chained_ops:
            stale.stale_begin(2)
            forwards(stale, 2, xs)

    with OpCounts() as ops:
        stale.stale_begin(1)
        forwards(stale, 1, xs)
        chained = threading.Thread(target=chained_forwards)
        chained.start()
        backwards(stale, 1, grads)
        chained.join()
        stale.stale_gradients(1)
        stale.optimizer_step()
        backwards(stale, 2, grads)
        stale.stale_gradients(2)
        stale.optimizer_step()
    copies = 2 * len(list(stale.layers.parameters()))  # one a step
    assert extra_ops(ops.counts + chained_ops.counts, want) == {"aten.clone.default": copies}
