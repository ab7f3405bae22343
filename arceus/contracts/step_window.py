"""A window of consecutive train steps the driver sends in one RunSteps call (each stage runs them back to back, with
no round trip to the driver between them): how many steps one may hold, and where the driver ends one."""

from __future__ import annotations

# The most steps one RunSteps call may name: what a stop or checkpoint request waits for at most (with
# `WINDOW_SECONDS`), and the agent's bound on one request.
MAX_WINDOW_STEPS = 16
# A window holds no more steps than the last step's time fits in this (a slow model's windows are of one step): a
# sink's stop or checkpoint request is taken between windows, so it waits about this long at most.
WINDOW_SECONDS = 0.5


def window_length(
    *, step: int, last_step: int, checkpoint_interval: int, step_seconds: float | None,
    most: int = MAX_WINDOW_STEPS, seconds: float = WINDOW_SECONDS,
) -> int:
    """How many train steps, from step `step` + 1 on, the next window holds: at least one; none past `last_step` (the
    epoch's or the run's last), none past the next multiple of `checkpoint_interval` (0: none) so a checkpoint falls
    at a window's end, at most `most`, and no more than `seconds` takes at the last step's `step_seconds` (None: no
    step measured yet, a window of one)."""
    if last_step <= step:
        raise ValueError(f"no step is left to run after step {step} (the last is {last_step})")
    length = min(most, last_step - step)
    if checkpoint_interval:
        length = min(length, checkpoint_interval - step % checkpoint_interval)
    if step_seconds is None:
        return 1
    if length * step_seconds > seconds:  # so the quotient is finite: a time near 0 would overflow int()
        length = int(seconds / step_seconds)
    return max(1, length)
