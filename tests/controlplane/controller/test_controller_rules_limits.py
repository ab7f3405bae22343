"""plan() on a job's limits while it trains: past its deadline, or about to be charged its max_total_usd, a job stops,
its live driver checkpointing first, and ends failed saying which limit it met."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from controlplane.controller.actions import FailJob, RequestHandover
from controlplane.controller.views import JobView
from tests.controlplane.controller.test_controller_rules import NOW
from tests.controlplane.controller.test_controller_rules_facts import NODES, decide, running

PRICED = tuple(replace(n, price_per_hour=3.6) for n in NODES)  # $0.001 a second each


def budgeted(charged: int, held_for: float, **fields: object) -> JobView:
    """A running job on a, b and c with a $0.05 cap, charged `charged` micro-dollars, its nodes' time unbilled for
    the last `held_for` seconds, 10 s to stop."""
    view = running(max_total_micros=50_000, charged_micros=charged, stop_seconds=10.0, **fields)
    since = NOW - timedelta(seconds=held_for)
    return replace(view, stages=tuple(replace(s, held_from=since) for s in view.stages))


def test_a_job_whose_charges_could_not_stop_short_of_its_cap_checkpoints_and_then_ends() -> None:
    # $0.02 charged, 3 nodes x (5 s held + 10 s to stop) x $0.001: $0.065 would pass $0.05.
    [action] = decide(budgeted(20_000, 5.0), PRICED)
    assert isinstance(action, RequestHandover) and action.generation == 2
    [stopping] = [c for c in action.conditions if c["type"] == "Stopping"]
    assert stopping["reason"] == "BudgetExhausted" and "max_total_usd $0.050000" in stopping["message"]
    # Checkpointing: nothing more until the driver lets go of its lease.
    assert decide(budgeted(20_000, 5.0, handover_requested=True), PRICED) == []
    handed_over = budgeted(20_000, 5.0, handover_requested=True, driver_lease_expires_at=NOW)
    assert decide(replace(handed_over, driver_lease_expires_at=NOW - timedelta(seconds=1)), PRICED) == [FailJob(
        "j1", 2, "BudgetExhausted",
        "charged $0.020000, and $0.045000 more for its devices until it could stop (10 s), would reach its "
        "max_total_usd $0.050000; stopped at its newest checkpoint",
    )]


def test_a_job_with_room_left_trains_on_and_one_without_a_cap_is_never_stopped() -> None:
    # $0.019 charged, and 3 nodes x 10 s to stop x $0.001: $0.049, short of $0.05.
    assert decide(budgeted(19_000, 0.0), PRICED) == []
    assert decide(replace(budgeted(20_000, 5.0), max_total_micros=None), PRICED) == []


def test_a_job_without_a_live_driver_stops_at_once() -> None:
    placing = budgeted(49_000, 0.0, status="placing", driver_lease_expires_at=None, driver_claimed=False)
    [action] = decide(placing, PRICED)
    assert isinstance(action, FailJob) and action.reason == "BudgetExhausted"


def test_a_job_past_its_deadline_checkpoints_and_ends() -> None:
    late = running(deadline=NOW - timedelta(seconds=1))
    [action] = decide(late)
    assert isinstance(action, RequestHandover)
    [stopping] = [c for c in action.conditions if c["type"] == "Stopping"]
    assert stopping["reason"] == "DeadlineExceeded"
    assert decide(running(deadline=NOW + timedelta(seconds=1))) == []
    [ended] = decide(replace(late, driver_lease_expires_at=NOW - timedelta(seconds=1)))
    assert ended == FailJob("j1", 2, "DeadlineExceeded",
                            "its deadline 2025-01-01T11:59:59+00:00 passed; stopped at its newest checkpoint")
