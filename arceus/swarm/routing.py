"""Which replica of each stage takes each micro-batch of a step (its route), and the speeds routes follow.

A stage's micro-batches are shared among its members in proportion to their speed (samples per second),
so a fast replica takes more and a slow or distant one fewer; every member takes at least one, so each
one's gradient enters the exchange. The route of micro-batch m is `Routes.of[m]`: its forward goes
from `of[m][i]` to `of[m][i + 1]` and its gradient comes back the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from arceus.errors import SpecError
from arceus.swarm.json_fields import array, exact_object, integers

Speeds = Mapping[tuple[int, int], float]  # (stage, replica id) -> samples per second


@dataclass(frozen=True)
class Routes:
    """One step's members and routes. `members[i]`: stage i's replica ids, ascending; `of[m][i]`: the
    replica of stage i that takes micro-batch m. R = 1 everywhere is today's pipeline (`single`)."""

    members: tuple[tuple[int, ...], ...]
    of: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise SpecError("routes.members", "a pipeline needs at least 1 stage")
        for i, ids in enumerate(self.members):
            _check_members(ids, f"routes.members[{i}]")
        if not self.of:
            raise SpecError("routes.of", "a step needs at least 1 micro-batch")
        for m, route in enumerate(self.of):
            if len(route) != len(self.members):
                raise SpecError(f"routes.of[{m}]", f"names {len(route)} replicas for {len(self.members)} stages")
            for i, replica in enumerate(route):
                if replica not in self.members[i]:
                    raise SpecError(
                        f"routes.of[{m}][{i}]", f"replica {replica} is not a member of stage {i}: {self.members[i]}"
                    )

    @property
    def num_stages(self) -> int:
        return len(self.members)

    @property
    def num_micro_batches(self) -> int:
        return len(self.of)

    @classmethod
    def single(cls, num_stages: int, num_micro_batches: int) -> Routes:
        """Every stage served by replica 0 alone: today's pipeline."""
        if num_stages < 1 or num_micro_batches < 1:
            raise ValueError(f"need at least 1 stage and 1 micro-batch, got {num_stages} and {num_micro_batches}")
        return cls(((0,),) * num_stages, ((0,) * num_stages,) * num_micro_batches)

    def micro_batches_of(self, stage: int, replica: int) -> tuple[int, ...]:
        """The micro-batches `replica` of `stage` takes, ascending (empty for a member with none)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {stage}")
        if replica not in self.members[stage]:
            raise ValueError(f"replica {replica} is not a member of stage {stage}: {self.members[stage]}")
        return tuple(m for m, route in enumerate(self.of) if route[stage] == replica)

    def to_json(self) -> dict[str, Any]:
        return {"members": [list(ids) for ids in self.members], "of": [list(route) for route in self.of]}

    @classmethod
    def from_json(cls, data: Any, field: str = "routes") -> Routes:
        """Parse `to_json`'s form strictly; a SpecError names the field (`routes.of[3][1]`) that is wrong."""
        data = exact_object(data, field, ("members", "of"))
        stages = array(data["members"], f"{field}.members")
        members = tuple(integers(v, f"{field}.members[{i}]") for i, v in enumerate(stages))
        of = tuple(integers(v, f"{field}.of[{m}]") for m, v in enumerate(array(data["of"], f"{field}.of")))
        try:
            return cls(members, of)
        except SpecError as exc:
            raise SpecError(field + exc.field.removeprefix("routes"), exc.message) from None


def route_step(num_micro_batches: int, members: Sequence[Sequence[int]], speeds: Speeds) -> Routes:
    """Route one step: each stage's micro-batches shared among its members by speed (`shares`), each
    member's spread through the step (`spread`) so the pipeline fills evenly. Deterministic. A stage with
    more members than micro-batches is an error: a member without a micro-batch would only slow the
    exchange."""
    if num_micro_batches < 1:
        raise ValueError(f"a step needs at least 1 micro-batch, got {num_micro_batches}")
    columns = []
    for i, ids in enumerate(members):
        ids = tuple(ids)
        _check_members(ids, f"members[{i}]")
        if len(ids) > num_micro_batches:
            raise ValueError(
                f"stage {i} has {len(ids)} replicas for {num_micro_batches} micro-batches; every replica needs "
                "at least one: use at most as many replicas as micro_batches"
            )
        counts = shares(num_micro_batches, stage_speeds(i, ids, speeds))
        columns.append([ids[k] for k in spread(counts)])
    return Routes(tuple(tuple(ids) for ids in members), tuple(zip(*columns, strict=True)))


def stage_speeds(stage: int, ids: Sequence[int], speeds: Speeds) -> list[float]:
    """The speeds of a stage's members: measured where known, the stage's median where not, all equal
    when none is known (a new job)."""
    known = [speeds[(stage, k)] for k in ids if (stage, k) in speeds]
    for value in known:
        _check_speed(value, f"speed of a replica of stage {stage}")
    fill = statistics.median(known) if known else 1.0
    return [speeds.get((stage, k), fill) for k in ids]


def shares(num_micro_batches: int, weights: Sequence[float]) -> list[int]:
    """Split `num_micro_batches` in proportion to `weights` by largest remainder, each at least 1: members
    whose quota is under 1 get exactly 1 and the rest is shared among the others, again by weight.
    A heavier member never gets fewer than a lighter one; ties of remainder go to the earlier member."""
    n = len(weights)
    if not 1 <= n <= num_micro_batches:
        raise ValueError(f"cannot give {n} members at least 1 of {num_micro_batches} micro-batches each")
    exact = [Fraction(w) for w in weights]
    pinned: set[int] = set()
    while True:
        free = [k for k in range(n) if k not in pinned]
        total = sum(exact[k] for k in free)
        quota = {k: (num_micro_batches - len(pinned)) * exact[k] / total for k in free}
        under = {k for k in free if quota[k] < 1}
        if not under:
            break
        pinned |= under  # the largest quota is >= 1 (they sum to >= len(free)), so this ends
    counts = [1] * n
    for k in free:
        counts[k] = math.floor(quota[k])
    left = num_micro_batches - sum(counts)
    for k in sorted(free, key=lambda k: (-(quota[k] - counts[k]), k))[:left]:
        counts[k] += 1
    return counts


def spread(counts: Sequence[int]) -> list[int]:
    """Interleave members by smooth weighted round-robin (nginx's): over sum(counts) picks member k is
    picked exactly counts[k] times, and in every prefix within 2 of its proportional share, never in a
    block. Returns the member index of each pick."""
    total = sum(counts)
    current = [0] * len(counts)
    picks = []
    for _ in range(total):
        for k, c in enumerate(counts):
            current[k] += c
        chosen = max(range(len(counts)), key=lambda k: (current[k], -k))
        current[chosen] -= total
        picks.append(chosen)
    return picks


def reroute(routes: Routes, lost: Iterable[tuple[int, int]], speeds: Speeds) -> Routes:
    """Routes without the `lost` (stage, replica)s: only their micro-batches move, each (ascending) to the
    surviving member of its stage that would finish its share soonest ((count + 1) / speed; ties to the
    lower id). Every other micro-batch keeps its replica, so nothing a survivor holds is invalidated."""
    lost = set(lost)
    members = tuple(tuple(k for k in ids if (i, k) not in lost) for i, ids in enumerate(routes.members))
    for i, ids in enumerate(members):
        if not ids:
            raise ValueError(f"stage {i} lost every replica: nothing to route to (the job rewinds)")
    of = [list(route) for route in routes.of]
    for i, ids in enumerate(members):
        if len(ids) == len(routes.members[i]):
            continue
        speed = dict(zip(ids, stage_speeds(i, ids, speeds), strict=True))
        load = {k: sum(1 for route in of if route[i] == k) for k in ids}
        for route in of:
            if (i, route[i]) in lost:
                route[i] = min(ids, key=lambda k: ((load[k] + 1) / speed[k], k))
                load[route[i]] += 1
    return Routes(members, tuple(tuple(route) for route in of))


def speeds_update(previous: Speeds, measured: Speeds, alpha: float) -> dict[tuple[int, int], float]:
    """Smooth measured speeds (EWMA): `alpha * measured + (1 - alpha) * previous`; a replica measured for
    the first time takes its measurement, one not measured this step keeps its previous speed."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    for key, value in measured.items():
        _check_speed(value, f"measured speed of stage {key[0]} replica {key[1]}")
    out = dict(previous)
    for key, value in measured.items():
        out[key] = alpha * value + (1 - alpha) * previous[key] if key in previous else value
    return out


def _check_members(ids: Sequence[int], field: str) -> None:
    if not ids:
        raise SpecError(field, "a stage needs at least 1 replica")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ids):
        raise SpecError(field, f"replica ids must be non-negative integers, got {list(ids)}")
    if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise SpecError(field, f"replica ids must be unique and ascending, got {list(ids)}")


def _check_speed(value: float, what: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number of samples per second, got {value!r}")
