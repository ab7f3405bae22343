"""A running job's step grant: the last training step its agents may run (`Job.step_grant`), a pure rule.

Agents train only up to the grant they last heard in a heartbeat reply (nodeagent/step_grants.py), so a driver that
is stale (after a lease hand-over) or keeps going after a cancel or a cap makes contributors train at most to a step
the control plane wrote down. The grant is set when the job starts running (controlplane/controller/transitions.py
`job_run`) and extended when its progress is recorded (controlplane/driver/recording.py): to the recorded step plus
a window long enough to cover a few heartbeat intervals at the job's measured step time, never past its total steps,
and only as far as its budget and deadline allow. A frozen job (cancelled, a hand-over asked, a node of it flagged) is
not extended: its agents stop at the grant stored then. A grant never goes down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GrantWindow:
    """How far ahead of the recorded step a grant reaches."""

    heartbeat_seconds: float  # how often agents hear the grant (ARCEUS_HEARTBEAT_INTERVAL_SECONDS)
    beats: int = 3  # heartbeat intervals of steps a window covers, so a late or lost reply does not stall a step
    # Steps granted beyond those: the step under way and the one chained after it (arceus/training/driver.py), and the
    # steps run while a report waits for its flush (controlplane/driver/sink.py).
    margin_steps: int = 4
    # The window before any step time is measured (a job's first steps; their time includes warming up).
    initial_steps: int = 8


def step_grant(
    *,
    current: int | None,
    recorded: int,
    total_steps: int | None,
    step_seconds: float | None,
    window: GrantWindow,
    frozen: bool = False,
    budget_left_micros: float | None = None,
    micros_per_second: float = 0.0,
    seconds_left: float | None = None,
) -> int | None:
    """The job's new grant. `current`: the stored one (None: none yet); `recorded`: its newest recorded step;
    `step_seconds`: its measured time per step (None: not measured yet); `budget_left_micros`: what its
    `max_total_usd` leaves (None: no cap), spent at `micros_per_second` by the devices it holds; `seconds_left`: until
    its deadline (None: none). A frozen job keeps `current`; otherwise the window is the steps that cover
    `window.beats` heartbeats plus `window.margin_steps`, cut to the steps the budget and the deadline allow at
    `step_seconds`, the grant `recorded` plus it, at most `total_steps`, and never below `current`."""
    if frozen:
        return current
    spent = budget_left_micros is not None and budget_left_micros <= 0
    late = seconds_left is not None and seconds_left <= 0
    if spent or late:
        steps = 0
    elif step_seconds is not None and math.isfinite(step_seconds) and step_seconds > 0:
        steps = window.margin_steps + math.ceil(window.beats * window.heartbeat_seconds / step_seconds)
        if budget_left_micros is not None and micros_per_second > 0:
            steps = min(steps, _whole(budget_left_micros / (step_seconds * micros_per_second)))
        if seconds_left is not None:
            steps = min(steps, _whole(seconds_left / step_seconds))
    else:  # nothing to project a cost or a time by: the first window
        steps = window.initial_steps
    target = recorded + steps
    if total_steps is not None:
        target = min(target, total_steps)
    return target if current is None else max(current, target)


def _whole(steps: float) -> int:
    """Whole steps in `steps` (none below zero; an unbounded count stays a finite int)."""
    return max(0, math.floor(min(steps, 2**31)))


def step_seconds_of(*, batch_size: int | None, samples_per_second: float | None) -> float | None:
    """A job's time per step from its recorded speed (None: not measured yet)."""
    if not batch_size or samples_per_second is None or not math.isfinite(samples_per_second) or samples_per_second <= 0:
        return None
    return batch_size / samples_per_second
