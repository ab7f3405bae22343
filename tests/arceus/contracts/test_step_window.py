"""How many steps a window holds: never past the epoch's or run's last step, never past a checkpoint's step, at most
MAX_WINDOW_STEPS, within WINDOW_SECONDS at the last step's time, and always at least one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.contracts.step_window import MAX_WINDOW_STEPS, WINDOW_SECONDS, window_length


@given(
    step=st.integers(0, 500), left=st.integers(1, 100), interval=st.integers(0, 40),
    seconds=st.one_of(st.none(), st.floats(0.0, 5.0)),
)
def test_a_window_stops_at_every_boundary(step: int, left: int, interval: int, seconds: float | None) -> None:
    n = window_length(step=step, last_step=step + left, checkpoint_interval=interval, step_seconds=seconds)
    assert 1 <= n <= min(MAX_WINDOW_STEPS, left)
    if interval:  # no checkpoint's step inside the window but its last
        assert all((step + k) % interval for k in range(1, n))
    if seconds is None:
        assert n == 1
    elif n > 1:
        assert n * seconds <= WINDOW_SECONDS


def test_fast_steps_fill_a_window_up_to_the_next_boundary() -> None:
    assert window_length(step=0, last_step=45, checkpoint_interval=0, step_seconds=0.001) == MAX_WINDOW_STEPS
    assert window_length(step=40, last_step=45, checkpoint_interval=0, step_seconds=0.001) == 5
    assert window_length(step=12, last_step=45, checkpoint_interval=10, step_seconds=0.001) == 8
    assert window_length(step=0, last_step=45, checkpoint_interval=0, step_seconds=WINDOW_SECONDS / 3) == 3
    assert window_length(step=0, last_step=45, checkpoint_interval=0, step_seconds=10.0) == 1
    assert window_length(step=0, last_step=45, checkpoint_interval=0, step_seconds=0.0) == MAX_WINDOW_STEPS
    assert window_length(step=0, last_step=1, checkpoint_interval=0, step_seconds=5e-324) == 1  # a subnormal time


def test_no_window_after_the_last_step() -> None:
    with pytest.raises(ValueError, match="no step is left"):
        window_length(step=45, last_step=45, checkpoint_interval=0, step_seconds=0.01)
