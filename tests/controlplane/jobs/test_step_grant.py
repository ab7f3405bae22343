"""The step grant's rule (controlplane/jobs/step_grant.py), by its properties."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from controlplane.jobs.step_grant import GrantWindow, step_grant

steps = st.integers(min_value=0, max_value=10**6)
seconds = st.one_of(st.none(), st.floats(min_value=1e-4, max_value=600.0))
windows = st.builds(
    GrantWindow,
    heartbeat_seconds=st.floats(min_value=0.5, max_value=60.0),
    beats=st.integers(min_value=1, max_value=5),
    margin_steps=st.integers(min_value=0, max_value=8),
    initial_steps=st.integers(min_value=1, max_value=32),
)
facts = st.fixed_dictionaries({
    "current": st.one_of(st.none(), steps),
    "recorded": steps,
    "total_steps": st.one_of(st.none(), steps),
    "step_seconds": seconds,
    "window": windows,
    "frozen": st.booleans(),
    "budget_left_micros": st.one_of(st.none(), st.floats(min_value=-1e6, max_value=1e9)),
    "micros_per_second": st.floats(min_value=0.0, max_value=1e4),
    "seconds_left": st.one_of(st.none(), st.floats(min_value=-100.0, max_value=1e5)),
})


@given(facts)
def test_a_grant_never_goes_down(f: dict) -> None:
    grant = step_grant(**f)
    if f["current"] is not None:
        assert grant is not None and grant >= f["current"]


@given(facts)
def test_a_frozen_job_keeps_its_grant(f: dict) -> None:
    assert step_grant(**{**f, "frozen": True}) == f["current"]


@given(facts)
def test_an_extension_never_passes_the_total_steps(f: dict) -> None:
    grant = step_grant(**{**f, "frozen": False})
    assert grant is not None
    if grant != f["current"] and f["total_steps"] is not None:
        assert grant <= f["total_steps"]


@given(facts)
def test_an_extension_stays_within_the_budget_and_the_deadline(f: dict) -> None:
    """The steps granted past the recorded one, at the measured step time, cost no more than the budget leaves and
    end by the deadline."""
    f = {**f, "frozen": False, "current": None}
    grant = step_grant(**f)
    assert grant is not None
    ahead = max(0, grant - f["recorded"])
    if (f["budget_left_micros"] is not None and f["budget_left_micros"] <= 0) or (
            f["seconds_left"] is not None and f["seconds_left"] <= 0):
        assert ahead == 0  # spent, or past the deadline: not a step more
        return
    if f["step_seconds"] is None:
        assert ahead <= f["window"].initial_steps
        return
    if f["budget_left_micros"] is not None and f["micros_per_second"] > 0:
        assert ahead * f["step_seconds"] * f["micros_per_second"] <= max(0.0, f["budget_left_micros"]) * (1 + 1e-9)
    if f["seconds_left"] is not None:
        assert ahead * f["step_seconds"] <= max(0.0, f["seconds_left"]) * (1 + 1e-9)


@given(recorded=steps, step_seconds=st.floats(min_value=1e-4, max_value=600.0), window=windows)
def test_an_unlimited_window_covers_its_heartbeats_and_margin(recorded: int, step_seconds: float,
                                                             window: GrantWindow) -> None:
    """Without limits, the agents may run every step of `beats` heartbeat intervals past the recorded one, and the
    margin besides: a normal job is never held up between replies."""
    grant = step_grant(current=None, recorded=recorded, total_steps=None, step_seconds=step_seconds, window=window)
    assert grant is not None
    assert (grant - recorded - window.margin_steps) * step_seconds >= window.beats * window.heartbeat_seconds - 1e-6
    assert grant - recorded >= window.margin_steps + 1


def test_the_first_window_and_slow_steps() -> None:
    window = GrantWindow(heartbeat_seconds=10.0)
    # Before any step is measured: the first window.
    assert step_grant(current=None, recorded=0, total_steps=None, step_seconds=None, window=window) == 8
    # A step slower than the heartbeats still leaves the margin ahead (a 10 s interval, 60 s steps).
    assert step_grant(current=8, recorded=1, total_steps=None, step_seconds=60.0, window=window) == 8
    assert step_grant(current=8, recorded=5, total_steps=None, step_seconds=60.0, window=window) == 10
    # Fast steps: three intervals' worth.
    assert step_grant(current=10, recorded=5, total_steps=None, step_seconds=0.01, window=window) == 5 + 4 + 3000
    assert step_grant(current=10, recorded=5, total_steps=100, step_seconds=0.01, window=window) == 100


def test_the_budget_cuts_the_window_to_what_it_pays_for() -> None:
    window = GrantWindow(heartbeat_seconds=2.0)
    # 1 s steps at 100 micro-dollars a second, 550 left: five steps.
    assert step_grant(current=10, recorded=10, total_steps=None, step_seconds=1.0, window=window,
                      budget_left_micros=550, micros_per_second=100) == 15
    # Nothing left: the grant stays where it is.
    assert step_grant(current=10, recorded=10, total_steps=None, step_seconds=1.0, window=window,
                      budget_left_micros=0, micros_per_second=100) == 10
    # Past the deadline: no step more.
    assert step_grant(current=12, recorded=10, total_steps=None, step_seconds=1.0, window=window,
                      seconds_left=-1.0) == 12
    assert step_grant(current=None, recorded=0, total_steps=None, step_seconds=math.nan, window=window,
                      seconds_left=-1.0) == 0
