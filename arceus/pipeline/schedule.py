"""Pipeline schedules as data: for each stage, the ordered forward/backward actions of one step.

A stage runs its list top to bottom; it sends every output as soon as it has it and blocks only
when an input it needs has not arrived. Any schedule here must therefore respect, per stage, the
order in which its neighbours produce what it consumes; tests simulate that to prove no deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from arceus.errors import SpecError

ActionKind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


Schedule = list[list[Action]]


def gpipe(num_stages: int, num_micro_batches: int, train: bool = True) -> Schedule:
    """GPipe: every stage runs all forwards in order, then (training) all backwards in reverse order."""
    _check(num_stages, num_micro_batches)
    forwards = [Action("F", m) for m in range(num_micro_batches)]
    backwards = [Action("B", m) for m in reversed(range(num_micro_batches))] if train else []
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batches: int, train: bool = True) -> Schedule:
    """1F1B (PipeDream-Flush): after a warm-up of forwards, each stage alternates one forward and one
    backward, so at most `num_stages - stage` micro-batches hold activations at once. Backwards run in
    micro-batch order. Without training it is the same as GPipe's forward-only list.
    """
    _check(num_stages, num_micro_batches)
    if not train:
        return gpipe(num_stages, num_micro_batches, train=False)
    schedule: Schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_micro_batches)
        actions = [Action("F", m) for m in range(warmup)]
        next_backward = 0
        for m in range(warmup, num_micro_batches):
            actions += [Action("F", m), Action("B", next_backward)]
            next_backward += 1
        actions += [Action("B", m) for m in range(next_backward, num_micro_batches)]
        schedule.append(actions)
    return schedule


SCHEDULES: dict[str, Callable[[int, int, bool], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, num_stages: int, num_micro_batches: int, train: bool = True) -> Schedule:
    try:
        factory = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}") from None
    return factory(num_stages, num_micro_batches, train)


def replica_schedule(
    name: str, num_stages: int, stage: int, micro_batches: Sequence[int], train: bool = True, replicas: int = 1
) -> list[Action]:
    """One replica's list in a step of replicated stages (arceus.swarm.routing): its own micro-batches
    (ascending) in the order the job's schedule runs them on one stage, with 1F1B's warm-up `replicas` (the
    most members any stage has) times as deep, so that with micro-batches spread evenly each replica keeps
    about `num_stages - stage` of its own in flight, as a stage does alone. With all micro-batches and
    `replicas` = 1 it is `build_schedule`'s list. After a repair a replica runs the list of the new
    routes, skipping what it has done.
    """
    # Each replica runs a restriction of one order per stage, warm-ups not growing downstream: no deadlock, any routes.
    # Not 1F1B over its own micro-batches: stage 0 would run B0 before F3 while a stage-1 replica of {0, 3} awaits F3.
    if name not in _ORDER:
        build_schedule(name, num_stages, 1)  # raises: the name is unknown
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    ascending = all(a < b for a, b in zip(micro_batches, micro_batches[1:], strict=False))
    if not ascending or any(m < 0 for m in micro_batches):
        raise ValueError(f"a replica's micro-batches must be non-negative, unique and ascending, got {micro_batches}")
    forwards = [Action("F", m) for m in micro_batches]
    if not train:
        return forwards
    warmup = replicas * (num_stages - stage - 1)
    return sorted(forwards + [Action("B", m) for m in micro_batches], key=lambda a: _ORDER[name](a, warmup))


# Where an action falls in its stage's order (warm-up: forwards run before the first backward, in micro-batches).
_ORDER: dict[str, Callable[[Action, int], tuple[int, int]]] = {
    "gpipe": lambda a, warmup: (0, a.micro_batch) if a.kind == "F" else (1, -a.micro_batch),
    "1f1b": lambda a, warmup: (a.micro_batch, 0) if a.kind == "F" else (a.micro_batch + warmup, 1),
}


# A job's `staleness`: 0, synchronous (every step's forwards use the weights of every earlier step's update); 1,
# PipeDream-2BW (a train step's forwards and backwards use the weights before the previous step's update, so a stage
# runs the next step's forwards while this one's backwards drain: W(t+1) = W(t) - lr * g(W(t-1))).
STALENESS = (0, 1)


def staleness_check(value: Any, field: str = "staleness") -> int:
    """A job's staleness (`STALENESS`), or SpecError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in STALENESS:
        raise SpecError(
            field,
            f"must be 0 (synchronous) or 1 (each step's forwards use the weights one update old, "
            f"PipeDream-2BW), got {value!r}",
        )
    return value


@lru_cache(maxsize=4096)
def peak_in_flight(name: str, num_stages: int, num_micro_batches: int, stage: int, staleness: int = 0) -> int:
    """The most micro-batches whose activations `stage` holds at once in a training step of schedule `name`:
    forwards run minus backwards run, at its largest along the stage's actions. With `staleness` 1 the next step
    starts on the stage once this one's forwards are done there: at most what this one still holds then, plus the
    next one's own peak (a bound: how the two steps' actions interleave depends on when their inputs arrive)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    staleness_check(staleness)
    held = peak = at_last_forward = 0
    for action in build_schedule(name, num_stages, num_micro_batches)[stage]:
        held += 1 if action.kind == "F" else -1
        peak = max(peak, held)
        if action.kind == "F":
            at_last_forward = held
    return peak + (at_last_forward if staleness else 0)


def _check(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_micro_batches < 1:
        raise ValueError(f"a step needs at least 1 micro-batch, got {num_micro_batches}")
