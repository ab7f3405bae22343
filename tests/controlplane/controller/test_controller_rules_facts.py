"""plan() on the facts services record (a node's agent restarted while hosting a stage, spot checks that caught a
node wrong, the driver's last word): each decides at the generation it was recorded at, before anything else, and
nothing once the job moved on."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from controlplane.controller.actions import FailJob, RewindJob, RollBackJob, SucceedJob
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, DriverOutcome, FailedCheck, JobView, Observed
from tests.controlplane.controller.test_controller_rules import NOW, job, node, placed, seen

NODES = (node("a"), node("b"), node("c"), node("spare"))


def running(**fields: object) -> JobView:
    """A running job at generation 2 on a, b and c, its driver's lease live."""
    defaults: dict = {"generation": 2, "stages": placed("j1", ["a", "b", "c"]),
                      "driver_lease_expires_at": NOW + timedelta(seconds=30), "driver_claimed": True}
    return job(**{"status": "running", **defaults, **fields})


def decide(view: JobView, nodes: tuple = NODES) -> list:
    return plan(Desired(jobs=(view,)), Observed(nodes=nodes), NOW)


def restarted(view: JobView, index: int, generation: int) -> JobView:
    stages = tuple(replace(s, restarted_generation=generation) if s.index == index else s for s in view.stages)
    return replace(view, stages=stages)


def test_a_restart_at_the_jobs_generation_rewinds_it_in_place_as_a_restart_the_node_to_blame() -> None:
    [action] = decide(restarted(running(), 1, 2))
    assert action == RewindJob("j1", 2, "placing", (), True, "NodeRestarted",
                               f"{seen('b')} restarted while hosting stage 1", ("b",))


def test_a_restart_of_an_earlier_generation_decides_nothing_again() -> None:
    assert decide(restarted(running(), 1, 1)) == []  # rewound past it already: the live driver trains on


def test_a_restart_past_the_jobs_restarts_fails_it_and_blames_the_node() -> None:
    [action] = decide(restarted(running(restarts=5, max_restarts=5), 0, 2))
    assert action == FailJob(
        "j1", 2, "BackoffLimitExceeded",
        f"{seen('a')} restarted while hosting stage 0; the job was restarted 5 times without saving a checkpoint in "
        "between", ("a",),
    )


def test_a_restarted_stage_on_a_node_that_may_not_work_is_unplaced() -> None:
    flagged = replace(NODES[2], paused=True, pause_reason="flagged: restarted 3 times")
    [action] = decide(restarted(running(), 2, 2), (NODES[0], NODES[1], flagged, NODES[3]))
    assert isinstance(action, RewindJob) and action.moves == ((2, 0, 0, None),) and action.culprits == ("c",)


def test_failed_spot_checks_roll_the_job_back_past_every_caught_node_before_anything_else() -> None:
    checks = (
        FailedCheck(2, "c", "c", "step 7: output differs"),
        FailedCheck(2, "a", "laptop", "step 7: receipt"),
        FailedCheck(2, "c", "c", "step 8: output differs"),
        FailedCheck(1, "b", "b", "an earlier generation's: already rolled back"),
    )
    view = restarted(running(failed_checks=checks), 1, 2)  # a restart too: the rollback rewinds anyway
    [action] = decide(view, (node("a"), node("b", ready="False"), node("c"), node("spare")))  # and b is lost
    assert action == RollBackJob(
        "j1", 2, ("a", "c"),
        "c failed a spot check (step 7: output differs); laptop failed a spot check (step 7: receipt)",
    )
    assert not any(isinstance(a, RollBackJob) for a in decide(replace(view, failed_checks=checks[3:])))


def test_the_drivers_last_word_ends_a_running_job_at_its_generation() -> None:
    done = DriverOutcome(2, "succeeded", "Completed", "trained 40 steps")
    assert decide(running(driver_outcome=done)) == [SucceedJob("j1", 2, "trained 40 steps")]
    failed = DriverOutcome(2, "failed", "DriverCrashed", "driver crashed: KeyError('x')")
    assert decide(running(driver_outcome=failed)) == [
        FailJob("j1", 2, "DriverCrashed", "driver crashed: KeyError('x')")
    ]
    # Of an earlier generation (the job rewound since), or a job no longer running: the driver's word is spent.
    assert not any(isinstance(a, SucceedJob) for a in decide(running(driver_outcome=replace(done, generation=1))))
    placing = running(status="placing", driver_outcome=done)
    assert not any(isinstance(a, SucceedJob) for a in decide(placing))
