"""plan() keeps every job's stages from a single owner unless the job opts out: a market where one owner holds every
Ready node leaves the job waiting, saying why."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from arceus.placement.solver import Workload
from controlplane.common.conditions import get_condition
from controlplane.controller.actions import FailJob, PlaceJob, RewindJob, ServeJob, SetCondition
from controlplane.controller.diversity import OPT_OUT, owner_of_every_stage
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, NodeView, Observed, PlacedStage, Requirements
from tests.controlplane.controller.test_controller_rules import NOW, job, node, placed, reports
from tests.controlplane.controller.test_controller_rules_serving import served


def owned(name: str, owner: str, flops: float = 1e9) -> NodeView:
    return replace(node(name, flops=flops), owner=owner)


def test_a_job_on_a_market_where_one_owner_holds_every_ready_node_waits_saying_why() -> None:
    nodes = tuple(owned(name, "alice") for name in "abcd")
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, SetCondition)
    placed = get_condition(action.conditions, "Placed")
    assert (placed["status"], placed["reason"]) == ("False", "WaitingForOwners")
    assert placed["message"] == (
        "every free Ready node meeting its requirements (4) belongs to one owner, and no single owner may hold every "
        "stage of a job: waiting for another owner's node, or submit it with requirements.owner_diversity false"
    )
    # The same market places a job that opted out.
    [placed_anyway] = plan(Desired(jobs=(job(requirements=Requirements(owner_diversity=False)),)), Observed(nodes), NOW)
    assert isinstance(placed_anyway, PlaceJob)


def test_another_owners_node_takes_a_part_even_when_one_owner_has_the_fastest_nodes() -> None:
    nodes = (*(owned(name, "alice", flops=4e9) for name in "abc"), owned("slow", "bob"))
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, PlaceJob) and len(action.stages) == 3
    assert "slow" in {s.node_id for s in action.stages}
    # A job that lets the solver choose its stage count gets two stages or more, so that no owner holds it whole.
    [action] = plan(Desired(jobs=(job(stages_requested=None),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, PlaceJob) and len({s.node_id for s in action.stages}) >= 2
    assert "slow" in {s.node_id for s in action.stages}


def test_a_job_of_one_stage_cannot_be_split_between_owners_and_says_how_to_go_on() -> None:
    nodes = (owned("a", "alice"), owned("b", "bob"))
    [action] = plan(Desired(jobs=(job(stages_requested=1),)), Observed(nodes=nodes), NOW)
    placed = get_condition(action.conditions, "Placed")
    assert placed["reason"] == "WaitingForOwners" and placed["message"].startswith("a job of one stage is held whole")


def test_a_lost_stage_moves_to_another_owners_node_rather_than_hand_one_owner_the_whole_model() -> None:
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b"]), stages_requested=2,
                  driver_lease_expires_at=NOW + timedelta(seconds=60), driver_claimed=True)
    lost_b = replace(owned("b", "bob"), ready_status="False")
    market = (owned("a", "alice"), lost_b, owned("fast", "alice", flops=9e9), owned("slow", "carol"))
    [action] = plan(Desired(jobs=(running,)), Observed(nodes=market), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 0, "slow"),)  # not alice's faster node
    [action] = plan(Desired(jobs=(running,)), Observed(nodes=market[:3]), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 0, None),) and action.status == "pending"
    assert "another owner's node" in action.message
    opted_out = replace(running, requirements=Requirements(owner_diversity=False))
    [action] = plan(Desired(jobs=(opted_out,)), Observed(nodes=market[:3]), NOW)
    assert action.moves == ((1, 0, 0, "fast"),)


def test_no_owner_gets_a_replica_of_every_stage_when_placed_or_grown() -> None:
    """Alice's fast nodes would take a replica of each of the three stages; each replica goes elsewhere instead."""
    four = Workload(micro_batch_size=1, micro_batches=4)
    alice = tuple(owned(f"a{i}", "alice", flops=9e9) for i in range(4))
    others = (owned("b", "bob"), owned("c", "carol"), owned("e", "erin"))
    queued = job(replicas_min=2, replicas_max=3, workload=four)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes=(*alice, *others)), NOW)
    assert isinstance(action, PlaceJob) and len(action.stages) == 6
    owners = {n.id: n.owner for n in (*alice, *others)}
    assert owner_of_every_stage([(s.index, s.replica, s.node_id) for s in action.stages], owners) is None
    # Grown while it runs: alice's free node would complete her copy of the model; it is passed over.
    rows = ((0, 0, "a0"), (0, 1, "b"), (1, 0, "a1"), (1, 1, "c"), (2, 0, "e"))
    running = job("j", "running", generation=2, replicas_min=2, replicas_max=2, workload=four, next_replica=2,
                  stages=tuple(PlacedStage(i, i, i + 1, n, 2, replica=r) for i, r, n in rows),
                  driver_lease_expires_at=NOW + timedelta(seconds=5), driver_claimed=True)
    assert plan(Desired(jobs=(running,)), Observed(nodes=(*alice, *others)), NOW) == []
    [grown] = plan(Desired(jobs=(running,)), Observed(nodes=(*alice, *others, owned("d", "dave"))), NOW)
    assert [(s.index, s.node_id) for s in grown.stages] == [(2, "d")]


def test_a_stage_that_failed_to_build_moves_to_another_owners_node_rather_than_hand_one_owner_the_model() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b"]), stages_requested=2)
    market = (owned("a", "alice"), owned("b", "bob"), owned("fast", "alice", flops=9e9), owned("slow", "carol"))
    failed = reports("j", ["ready", "failed"])
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes=market, stages=failed), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 0, "slow"),)
    # With only the owner of the other stage's node left, the job fails saying why and how to go on.
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes=market[:3], stages=failed), NOW)
    assert isinstance(action, FailJob) and "no single owner may hold every stage" in action.message
    assert "requirements.owner_diversity false" in action.message


def test_a_served_job_keeps_owners_apart_and_waits_when_only_one_owner_has_room() -> None:
    # The fastest three are alice's: the last stage placed goes to bob's slower node instead.
    market = (owned("a", "alice", 9e9), owned("b", "alice", 8e9), owned("c", "alice", 7e9), owned("d", "bob"))
    [action] = plan(Desired(jobs=(served(),)), Observed(nodes=market), NOW)
    assert isinstance(action, ServeJob) and "d" in {s.node_id for s in action.stages}
    # Only alice's nodes free: it waits, saying why and how to go on.
    [waiting] = plan(Desired(jobs=(served(),)), Observed(nodes=market[:3]), NOW)
    condition = get_condition(waiting.conditions, "Serving")
    assert (condition["status"], condition["reason"]) == ("False", "WaitingForOwners")
    assert "no single owner may hold every stage" in condition["message"] and OPT_OUT in condition["message"]
    # A job that opted out is served on them.
    opted_out = served(requirements=Requirements(owner_diversity=False))
    [action] = plan(Desired(jobs=(opted_out,)), Observed(nodes=market[:3]), NOW)
    assert isinstance(action, ServeJob)
