"""plan() under its guard against a cascade of rewinds (controlplane/controller/moves.py): at most `max_moves` jobs'
lost stages move a pass, oldest first, the rest later; none while a disruption silences most nodes hosting stages."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.common.conditions import get_condition
from controlplane.controller.actions import Action, MovesHeld, RewindJob, SetCondition
from controlplane.controller.moves import MoveGuard
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, JobView, NodeView, Observed
from tests.controlplane.controller.test_controller_rules import NOW, job, node, placed

LOST_REASONS = ("NodeLost", "WaitingForNode", "NoNodeWithRoom")
LIVE = NOW + timedelta(seconds=30)  # the drivers' leases: a running job with nothing lost wants nothing


def fleet(count: int, silent: set[int], spares: int) -> tuple[tuple[JobView, ...], tuple[NodeView, ...]]:
    """`count` running jobs, oldest first, each with 3 stages on nodes of its own (node k of job j is the fleet's
    3j + k), those numbered in `silent` silent past their lease; and `spares` free Ready nodes."""
    jobs = tuple(job(f"j{j:02d}", "running", generation=2, driver_lease_expires_at=LIVE,
                     stages=placed(f"j{j:02d}", [f"n{3 * j + k}" for k in range(3)])) for j in range(count))
    hosts = tuple(node(f"n{i}", silent=20, ready="Unknown") if i in silent else node(f"n{i}") for i in range(3 * count))
    return jobs, (*hosts, *(node(f"spare{i}") for i in range(spares)))


def lost_rewinds(actions: list[Action]) -> list[RewindJob]:
    return [a for a in actions if isinstance(a, RewindJob) and a.reason in LOST_REASONS]


def applied(jobs: tuple[JobView, ...], actions: list[Action]) -> tuple[JobView, ...]:
    """`jobs` as the executor would leave them: rewinds' moves and new generations, conditions set."""
    by_job = {a.job_id: a for a in actions if isinstance(a, RewindJob | SetCondition)}
    out = []
    for j in jobs:
        action = by_job.get(j.id)
        if isinstance(action, RewindJob):
            target = {(i, r, p): n for i, r, p, n in action.moves}
            stages = tuple(replace(s, node_id=target.get(s.key, s.node_id), generation=j.generation + 1)
                           for s in j.stages)
            j = replace(j, generation=j.generation + 1, status=action.status, stages=stages)
        elif isinstance(action, SetCondition):
            j = replace(j, conditions=action.conditions)
        out.append(j)
    return tuple(out)


def lost_jobs(jobs: tuple[JobView, ...], silent: set[int]) -> list[str]:
    names = {f"n{i}" for i in silent}
    return [j.id for j in jobs if any(s.node_id in names for s in j.stages)]


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 25), data=st.data(), cap=st.integers(1, 12))
def test_a_pass_moves_at_most_the_cap_of_jobs_oldest_first_and_every_lost_stage_moves_in_later_passes(
    count: int, data: st.DataObject, cap: int
) -> None:
    silent = data.draw(st.sets(st.integers(0, 3 * count - 1)))
    jobs, nodes = fleet(count, silent, spares=len(silent))
    waiting = lost_jobs(jobs, silent)
    guard = MoveGuard(max_moves=cap)
    for _ in range(math.ceil(len(waiting) / cap)):
        actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)
        rewinds = lost_rewinds(actions)
        assert len(rewinds) <= cap
        # the oldest jobs still waiting move, as many as the cap allows; the others say why they wait
        assert [a.job_id for a in rewinds] == waiting[:cap]
        assert all(a.status == "placing" for a in rewinds)
        held = [a for a in actions if isinstance(a, MovesHeld)]
        assert [(h.reason, h.jobs) for h in held] == ([("MovesDeferred", len(waiting) - cap)]
                                                      if len(waiting) > cap else [])
        for a in actions:
            if isinstance(a, SetCondition) and a.job_id in waiting[cap:]:
                assert get_condition(a.conditions, "Placed")["reason"] == "MovesDeferred"
        jobs = applied(jobs, actions)
        waiting = waiting[cap:]
    # liveness: every lost stage moved, within ceil(lost jobs / cap) passes, no two stages on one node
    names = {f"n{i}" for i in silent}
    hosted = [s.node_id for j in jobs for s in j.stages]
    assert not names & set(hosted) and len(hosted) == len(set(hosted))
    assert lost_rewinds(plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)) == []


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 12), data=st.data(), threshold=st.sampled_from([0.3, 0.55, 0.8]),
       least=st.integers(0, 10))
def test_under_a_disruption_no_lost_stage_moves_and_each_waiting_job_says_why(
    count: int, data: st.DataObject, threshold: float, least: int
) -> None:
    silent = data.draw(st.sets(st.integers(0, 3 * count - 1), min_size=1))
    jobs, nodes = fleet(count, silent, spares=len(silent))
    guard = MoveGuard(disruption_threshold=threshold, disruption_min_nodes=least)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)
    waiting = lost_jobs(jobs, silent)
    if len(silent) >= max(1, least) and len(silent) > threshold * 3 * count:
        assert lost_rewinds(actions) == []
        assert actions[-1] == MovesHeld("NodesDisrupted", len(waiting), len(silent), 3 * count)
        conditions = {a.job_id: get_condition(a.conditions, "Placed") for a in actions if isinstance(a, SetCondition)}
        assert sorted(conditions) == waiting
        assert {(c["status"], c["reason"]) for c in conditions.values()} == {("Unknown", "NodesDisrupted")}
        # the next pass sees the condition set: it writes nothing more, and still moves nothing
        again = plan(Desired(jobs=applied(jobs, actions)), Observed(nodes), NOW, guard=guard)
        assert again == [MovesHeld("NodesDisrupted", len(waiting), len(silent), 3 * count)]
    else:  # below the share, or fewer silent nodes than the minimum: every lost stage moves at once
        assert [a.job_id for a in lost_rewinds(actions)] == waiting
        assert not any(isinstance(a, MovesHeld) for a in actions)


def test_a_small_cluster_losing_most_of_its_nodes_still_moves_their_stages() -> None:
    """2 of 3 nodes silent is two thirds, over the threshold, but below the minimum count: not a disruption."""
    jobs, nodes = fleet(1, {0, 1}, spares=2)
    guard = MoveGuard(max_moves=10, disruption_threshold=0.55, disruption_min_nodes=10)
    [rewind] = lost_rewinds(plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard))
    assert (rewind.reason, [n for *_, n in rewind.moves]) == ("NodeLost", ["spare0", "spare1"])


def test_moves_resume_at_the_capped_rate_once_the_silent_share_falls_and_held_conditions_clear() -> None:
    guard = MoveGuard(max_moves=2, disruption_threshold=0.55, disruption_min_nodes=3)
    silent = set(range(12))  # 12 of 15 nodes: jobs 0-3 lost everything
    jobs, nodes = fleet(5, silent, spares=12)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)
    assert lost_rewinds(actions) == [] and actions[-1] == MovesHeld("NodesDisrupted", 4, 12, 15)
    jobs = applied(jobs, actions)
    # Jobs 0-2's nodes answer again (3 of 15 silent): job 3 moves, its Placed condition rewritten by its rewind,
    # and the others' held conditions clear.
    nodes = tuple(node(n.id) if n.id in {f"n{i}" for i in range(9)} else n for n in nodes)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)
    assert [a.job_id for a in lost_rewinds(actions)] == ["j03"]
    cleared = {a.job_id: get_condition(a.conditions, "Placed")["reason"] for a in actions
               if isinstance(a, SetCondition)}
    assert cleared == {"j00": "NodesBack", "j01": "NodesBack", "j02": "NodesBack"}
    # Below the share, the cap holds: with 9 of 15 silent again but a minimum of 10, two jobs move a pass.
    guard = replace(guard, disruption_min_nodes=10)
    jobs, nodes = fleet(5, set(range(9)), spares=9)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=guard)
    assert [a.job_id for a in lost_rewinds(actions)] == ["j00", "j01"]
    assert actions[-1] == MovesHeld("MovesDeferred", 1, 9, 15)


def test_stages_moved_off_paused_nodes_are_not_capped() -> None:
    """A paused node lives and its owner asked for it; a placing job's stage moves at once (NodeDrained)."""
    jobs, nodes = fleet(3, set(), spares=3)
    jobs = tuple(replace(j, status="placing") for j in jobs)
    nodes = tuple(replace(n, paused=True) if n.id in {"n0", "n3", "n6"} else n for n in nodes)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=MoveGuard(max_moves=1))
    assert [(a.job_id, a.reason) for a in actions if isinstance(a, RewindJob)] == [
        ("j00", "NodeDrained"), ("j01", "NodeDrained"), ("j02", "NodeDrained")]


def test_pending_jobs_placed_again_count_against_the_cap() -> None:
    """A pending job's unplaced stage placed on a node that freed up is a rewind too (NodeLost): capped."""
    jobs, nodes = fleet(2, set(), spares=2)
    jobs = tuple(replace(j, status="pending", stages=(replace(j.stages[0], node_id=None), *j.stages[1:]))
                 for j in jobs)
    actions = plan(Desired(jobs=jobs), Observed(nodes), NOW, guard=MoveGuard(max_moves=1))
    assert [(a.job_id, a.status) for a in lost_rewinds(actions)] == [("j00", "placing")]
    [deferred] = [a for a in actions if isinstance(a, SetCondition)]
    assert deferred.job_id == "j01" and get_condition(deferred.conditions, "Placed")["reason"] == "MovesDeferred"
    assert actions[-1] == MovesHeld("MovesDeferred", 1, 0, 4)
