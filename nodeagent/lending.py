"""Core lending between stages that share a machine: the torch threads of each computation, and whether
borrowing pays.

A stage computes with its agent's share of threads (`own`), and with `solo` threads in the actions no
other stage of its pipeline computes alongside (arceus.pipeline.solo): then the cores of the stages
that wait for it idle. Only while that measurably pays, though: a borrowed core may be busy with another
program, and an action whose OpenMP threads wait for a descheduled peer runs slower than on the own
share. So each stage keeps the compute seconds per sample of its last forwards and backwards, with either
count, stops borrowing for a kind whose median was not faster, and tries again every PROBE_EVERY-th
chance. Medians, so one slow action on a busy moment does not stop it. The first figure of each count is
left out: the first computation with a thread count starts its threads and warms their caches.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from arceus.pipeline.schedule import Action
from arceus.pipeline.solo import SoloPlanner

PROBE_EVERY = 4
KEPT = 5  # figures per kind and count that the medians are taken over


@dataclass(frozen=True)
class ComputeThreads:
    """Torch intra-op threads of a step's computations."""

    own: int  # the agent's share
    solo: int  # while no other stage of the pipeline computes (>= own; more only on a shared machine)

    def apply(self, solo: bool) -> None:
        """Set the count on the calling thread (OpenMP counts are per OS thread: call it where torch
        computes)."""
        wanted = self.solo if solo else self.own
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)


class LendingGauge:
    """One stage's last compute seconds per sample, by action kind ("F", "B") and by whether the action
    borrowed; what decides if a solo action borrows."""

    def __init__(self) -> None:
        self._per_sample: dict[tuple[str, bool], deque[float]] = {}
        self._warm: set[tuple[str, bool]] = set()
        self._declined: dict[str, int] = {}

    def pays(self, kind: str) -> bool:
        """False while borrowing measures no faster than the own share for `kind`."""
        lent, own = self._per_sample.get((kind, True)), self._per_sample.get((kind, False))
        return lent is None or own is None or statistics.median(lent) < statistics.median(own)

    def lend(self, kind: str) -> bool:
        """Whether a solo action of `kind` borrows now: while it pays, and every PROBE_EVERY-th time
        otherwise (a busy machine may have quietened)."""
        if self.pays(kind):
            return True
        self._declined[kind] = self._declined.get(kind, 0) + 1
        if self._declined[kind] < PROBE_EVERY:
            return False
        self._declined[kind] = 0
        return True

    def record(self, kind: str, lent: bool, seconds: float, samples: int) -> None:
        if (kind, lent) not in self._warm:
            self._warm.add((kind, lent))
            return
        self._per_sample.setdefault((kind, lent), deque(maxlen=KEPT)).append(seconds / max(samples, 1))


class StepLending:
    """One step's thread choices: each action computes with the agent's own share, or, when it is solo
    (`arceus.pipeline.solo`) and borrowing pays for its kind (the stage's `LendingGauge`), with the
    borrowed share; the gauge learns from every action's seconds."""

    def __init__(
        self,
        *,
        stage_index: int,
        gauge: LendingGauge,
        threads: ComputeThreads | None,
        planner: SoloPlanner | None,
        arrived: Callable[[], Iterable[Action]],
    ) -> None:
        """`threads` None leaves the calling thread's count alone; `planner` None never borrows;
        `arrived`: the neighbours' actions whose outputs reached the stage so far."""
        self._stage_index, self._gauge, self._threads, self._planner = stage_index, gauge, threads, planner
        self._arrived = arrived

    def start(self, index: int, action: Action) -> bool:
        """Set the threads for the stage's action `index` (its inputs are in); whether it borrows."""
        lent = (
            self._planner is not None
            and self._planner.solo(self._stage_index, index, self._arrived())
            and self._gauge.lend(action.kind)
        )
        if self._threads is not None:
            self._threads.apply(lent)
        return lent

    def done(self, action: Action, lent: bool, seconds: float, samples: int) -> None:
        if self._planner is not None:
            self._gauge.record(action.kind, lent, seconds, samples)

    def optimizer_step(self) -> None:
        """Threads for the optimizer step: borrowed when every other stage is done and both kinds pay."""
        if self._threads is not None:
            self._threads.apply(
                self._planner is not None
                and self._planner.solo_optimizer_step(self._stage_index)
                and self._gauge.pays("F")
                and self._gauge.pays("B")
            )
