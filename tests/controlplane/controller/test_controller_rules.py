"""plan(): the reconciler's pure decisions, on hand-made snapshots (no database)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from arceus.placement.solver import LayerProfile, Workload, stage_memory
from controlplane.common.conditions import get_condition
from controlplane.controller.actions import (
    FailJob,
    MarkNodeUnknown,
    PlaceJob,
    PlannedStage,
    RequestHandover,
    RequeueJob,
    RewindJob,
    SetCondition,
    StartDriver,
)
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, JobView, NodeView, Observed, PlacedStage, Requirements, StageReport
from controlplane.nodes.labels import OTHERS_NODE

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
# Three layers: forward FLOPs per sample, and parameters (16 bytes each to train: 1,000 and 100 bytes).
LAYERS = (LayerProfile(100.0, 62, 0), LayerProfile(100.0, 62, 0), LayerProfile(10.0, 6, 0))


def node(name: str, *, ready: str = "True", silent: float = 1.0, flops: float = 1e9, memory: int = 10**6) -> NodeView:
    return NodeView(
        id=name,
        name=name,
        ready_status=ready,
        lease_renewed_at=NOW - timedelta(seconds=silent),
        lease_duration_seconds=6.0,
        flops=flops,
        memory_bytes=memory,
        owner=f"owner-of-{name}",  # every node another contributor's
    )


def seen(name: str) -> str:
    """A node of these tests as its job's owner sees it in conditions: every node is another contributor's."""
    return f"{OTHERS_NODE} {name[:8]}"


def job(job_id: str = "j1", status: str = "queued", **fields: object) -> JobView:
    defaults: dict = {"generation": 1, "stages_requested": 3, "layers": LAYERS}
    return JobView(id=job_id, status=status, **{**defaults, **fields})


def placed(job_id: str, nodes: list[str], generation: int = 2) -> tuple[PlacedStage, ...]:
    return tuple(PlacedStage(i, i, i + 1, n, generation) for i, n in enumerate(nodes))


def reports(job_id: str, states: list[str], generation: int = 2) -> dict:
    return {(job_id, i, 0, 0): StageReport(generation, state, f"msg {i}") for i, state in enumerate(states)}


def test_a_node_silent_past_its_lease_is_marked_unknown_once() -> None:
    silent = node("a", silent=9.4)
    actions = plan(Desired(jobs=()), Observed(nodes=(silent, node("b"))), NOW)
    assert actions == [MarkNodeUnknown("a", silent.lease_renewed_at, "NodeLeaseExpired", "no heartbeat for 9s")]
    # Already Unknown: nothing more to write.
    assert plan(Desired(jobs=()), Observed(nodes=(node("a", ready="Unknown", silent=9.4),)), NOW) == []


def test_a_queued_job_is_placed_one_stage_per_ready_node_fastest_first() -> None:
    nodes = (node("slow", flops=1e9), node("fast", flops=4e9), node("mid", flops=2e9), node("spare", flops=5e8))
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, PlaceJob)
    assert (action.job_id, action.generation) == ("j1", 1)
    assert action.stages == (
        PlannedStage(0, 0, 1, "fast"),
        PlannedStage(1, 1, 2, "mid"),
        PlannedStage(2, 2, 3, "slow"),
    )
    placed_condition = get_condition(action.conditions, "Placed")
    assert placed_condition["status"] == "True"
    assert placed_condition["message"] == (
        f"3 stages on {seen('fast')} (layers 0-0), {seen('mid')} (layers 1-1), {seen('slow')} (layers 2-2); "
        "$0.0000/hour"
    )
    assert placed_condition["last_transition_time"] == NOW.isoformat()


def test_without_enough_ready_nodes_the_job_waits_and_says_why() -> None:
    nodes = (node("a"), node("gone", silent=30), node("unknown", ready="Unknown"))
    actions = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    assert isinstance(actions[0], MarkNodeUnknown)
    [waiting] = actions[1:]
    assert isinstance(waiting, SetCondition)
    condition = get_condition(waiting.conditions, "Placed")
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "WaitingForNodes",
        "needs 3 Ready nodes, 1 available",
    )


def test_an_unchanged_waiting_condition_is_not_rewritten() -> None:
    [waiting] = plan(Desired(jobs=(job(),)), Observed(nodes=(node("a"),)), NOW)
    again = job(conditions=waiting.conditions)
    assert plan(Desired(jobs=(again,)), Observed(nodes=(node("a"),)), NOW + timedelta(seconds=2)) == []


def test_without_a_stage_count_a_job_takes_every_free_node_up_to_its_layers() -> None:
    nodes = tuple(node(name) for name in "abcde")
    [action] = plan(Desired(jobs=(job(stages_requested=None),)), Observed(nodes=nodes), NOW)
    assert len(action.stages) == 3
    [two] = plan(Desired(jobs=(job(stages_requested=None),)), Observed(nodes=nodes[:2]), NOW)
    assert [(s.layer_start, s.layer_end) for s in two.stages] == [(0, 1), (1, 3)]
    [none] = plan(Desired(jobs=(job(stages_requested=None),)), Observed(nodes=()), NOW)
    assert get_condition(none.conditions, "Placed")["message"] == "needs 1 Ready node, 0 available"


def test_nodes_of_active_jobs_are_not_reused_and_a_later_job_may_use_what_is_left() -> None:
    running = job(
        "old", "running", stages=placed("old", ["a", "b"]), driver_lease_expires_at=NOW + timedelta(seconds=60)
    )
    big = job("big", stages_requested=3)
    small = job("small", stages_requested=1, requirements=Requirements(owner_diversity=False))
    nodes = tuple(node(name) for name in "abcd")
    actions = plan(Desired(jobs=(running, big, small)), Observed(nodes=nodes), NOW)
    assert isinstance(actions[0], SetCondition) and actions[0].job_id == "big"
    assert get_condition(actions[0].conditions, "Placed")["message"] == "needs 3 Ready nodes, 2 available"
    assert isinstance(actions[1], PlaceJob) and actions[1].job_id == "small"
    assert actions[1].stages[0].node_id in {"c", "d"}


def test_two_queued_jobs_in_one_pass_never_share_a_node() -> None:
    nodes = tuple(node(name) for name in "abcdef")
    first, second = plan(Desired(jobs=(job("x"), job("y"))), Observed(nodes=nodes), NOW)
    assert {s.node_id for s in first.stages}.isdisjoint({s.node_id for s in second.stages})


def test_placement_that_fits_no_memory_says_so() -> None:
    nodes = tuple(node(name, memory=500) for name in "abc")
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    condition = get_condition(action.conditions, "Placed")
    assert condition["reason"] == "NoFeasiblePlacement"
    assert "layer 0 needs" in condition["message"]


def test_a_placing_job_starts_its_driver_once_every_stage_is_ready_at_its_generation() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = tuple(node(name) for name in "abc")
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes, reports("j", ["ready"] * 3)), NOW)
    assert action == StartDriver("j", 2, "placing", None, action.conditions)
    assert get_condition(action.conditions, "StagesReady")["status"] == "True"
    assert get_condition(action.conditions, "Training")["reason"] == "DriverStarting"


def test_actions_that_take_no_node_leave_every_free_node_to_the_jobs_after_them() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = tuple(node(name, flops=flops) for name, flops in zip("abcdef", (1e9, 1e9, 1e9, 3e9, 2e9, 1e9), strict=True))
    start, place = plan(Desired(jobs=(placing, job("q"))), Observed(nodes, reports("j", ["ready"] * 3)), NOW)
    assert isinstance(start, StartDriver)
    assert isinstance(place, PlaceJob) and [s.node_id for s in place.stages] == ["d", "e", "f"]
    assert get_condition(place.conditions, "Placed")["message"].startswith(f"3 stages on {seen('d')} (layers 0-0)")


def test_reports_about_an_older_generation_do_not_count() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = tuple(node(name) for name in "abc")
    stale = {**reports("j", ["ready"] * 3), ("j", 2, 0, 0): StageReport(1, "ready")}
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes, stale), NOW)
    assert isinstance(action, SetCondition)
    assert get_condition(action.conditions, "StagesReady")["message"] == "2/3 stages ready"


def test_a_failed_stage_fails_the_job_with_its_message() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = tuple(node(name) for name in "abc")
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes, reports("j", ["ready", "failed", "ready"])), NOW)
    assert action == FailJob("j", 2, "StageFailed", "stage 1 on node b failed: msg 1")


def test_a_stage_its_node_cannot_build_moves_to_a_free_node_as_a_restart() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = (*(node(name) for name in "abc"), node("d", flops=2e9), node("tiny", flops=9e9, memory=10))
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes, reports("j", ["ready", "failed", "ready"])), NOW)
    assert action == RewindJob(
        "j", 2, "placing", ((1, 0, 0, "d"),), True, "StageFailed",
        f"stage 1 on node b failed: msg 1; moved from {seen('b')} to {seen('d')}"
    )
    # A failure that followed the stage to as many nodes as the job may restart fails the job.
    worn = replace(placing, restarts=5)
    [action] = plan(Desired(jobs=(worn,)), Observed(nodes, reports("j", ["ready", "failed", "ready"])), NOW)
    assert isinstance(action, FailJob) and action.reason == "BackoffLimitExceeded"
    assert action.message.startswith("stage 1 on node b failed: msg 1; the job was restarted 5 times")


def test_a_lost_stage_moves_alone_to_the_fastest_free_node_with_room() -> None:
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = (
        node("a"),
        node("b", silent=20),
        node("c"),
        node("small", flops=9e9, memory=500),  # fastest, but stage 1 needs 1000 bytes
        node("slow", flops=1e9),
        node("fast", flops=4e9),
    )
    actions = plan(Desired(jobs=(running,)), Observed(nodes, reports("j", ["ready"] * 3)), NOW)
    assert isinstance(actions[0], MarkNodeUnknown)
    assert actions[1] == RewindJob(
        "j", 2, "placing", ((1, 0, 0, "fast"),), False, "NodeLost", f"stage 1 moved from {seen('b')} to {seen('fast')}"
    )


def test_a_job_tolerates_silence_up_to_its_own_grace() -> None:
    patient = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), node_grace_seconds=30.0,
                  driver_lease_expires_at=NOW + timedelta(seconds=5))
    nodes = (node("a"), node("b", silent=20, ready="Unknown"), node("c"), node("spare"))
    assert plan(Desired(jobs=(patient,)), Observed(nodes), NOW) == []
    nodes = (node("a"), node("b", silent=31, ready="Unknown"), node("c"), node("spare"))
    [action] = plan(Desired(jobs=(patient,)), Observed(nodes), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 0, "spare"),)


def test_a_lost_stage_is_not_moved_onto_a_node_silent_past_the_jobs_grace() -> None:
    """A node silent past the job's tolerance but within its own lease is Ready and free (the node a lost stage of
    the job just left, its agent dead), yet the job would count it lost at once: no place for the stage."""
    hasty = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), node_grace_seconds=2.0)
    nodes = (node("a"), node("b", silent=3), node("c"), node("left", silent=3, flops=4e9), node("spare"))
    [action] = plan(Desired(jobs=(hasty,)), Observed(nodes, reports("j", ["ready"] * 3)), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 0, "spare"),)


def test_a_lost_stage_with_no_room_anywhere_unplaces_and_waits_pending() -> None:
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = (node("a"), node("b", silent=20, ready="Unknown"), node("c"), node("tiny", memory=10))
    [action] = plan(Desired(jobs=(running,)), Observed(nodes), NOW)
    assert isinstance(action, RewindJob)
    assert (action.status, action.moves, action.reason) == ("pending", ((1, 0, 0, None),), "NoNodeWithRoom")
    assert action.message == (
        f"waiting for a Ready node with room for stage 1 (layers 1-1, needs 992 bytes; the roomiest free node, "
        f"{seen('tiny')}, has 10 for stages: 982 short) (1 free Ready node now); every Ready node, busy or free, is "
        "too small for stage 1: it waits until a node's owner raises its max_memory_bytes or a node with more memory "
        "joins (with fewer or smaller micro-batches, or activation checkpointing, a job's stages need less)"
    )
    # Pending and still nothing fits: only the condition is kept up to date, no new generation.
    pending = job("j", "pending", generation=3, stages=(*placed("j", ["a"], 3), PlacedStage(1, 1, 2, None, 3),
                                                       PlacedStage(2, 2, 3, "c", 3)))
    [action] = plan(Desired(jobs=(pending,)), Observed(nodes), NOW)
    assert isinstance(action, SetCondition)
    assert get_condition(action.conditions, "Placed")["reason"] == "NoNodeWithRoom"
    # A node with room registers: the stage is placed and the job rewinds onto it.
    [action] = plan(Desired(jobs=(pending,)), Observed((*nodes, node("new"))), NOW)
    assert isinstance(action, RewindJob) and (action.status, action.moves) == ("placing", ((1, 0, 0, "new"),))


def test_a_lost_stage_waits_for_a_busy_node_with_room_without_calling_every_node_too_small() -> None:
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]))
    other = job("k", "running", generation=2, stages=placed("k", ["big"]), stages_requested=1,
                driver_lease_expires_at=NOW + timedelta(seconds=30))
    nodes = (node("a"), node("b", silent=20, ready="Unknown"), node("c"), node("tiny", memory=10), node("big"))
    action = next(a for a in plan(Desired(jobs=(running, other)), Observed(nodes), NOW) if isinstance(a, RewindJob))
    assert (action.status, action.reason) == ("pending", "WaitingForNode")
    assert action.message.endswith(f"the roomiest free node, {seen('tiny')}, has 10 for stages: 982 short) "
                                   "(1 free Ready node now)")


def test_jobs_of_different_tolerances_in_one_pass_each_judge_the_nodes_they_count() -> None:
    """Whether any node could ever take a lost stage is judged once a pass per kind of job: a busy node with room
    that is silent past the hasty job's tolerance (but not the patient one's) makes only the patient job wait for it,
    whichever job the pass looks at first."""
    heavy = (LAYERS[0], LayerProfile(100.0, 10**6, 0), LAYERS[2])  # its stage 1 needs ~16 MB: only "big" has it
    hasty = job("h", "running", generation=2, stages=placed("h", ["d", "e", "f"]), node_grace_seconds=2.0,
                layers=heavy)
    patient = job("p", "running", generation=2, stages=placed("p", ["a", "b", "c"]))
    other = job("k", "running", generation=2, stages=placed("k", ["big"]), stages_requested=1,
                driver_lease_expires_at=NOW + timedelta(seconds=30))
    nodes = (node("a"), node("b", silent=20, ready="Unknown"), node("c"), node("d"),
             node("e", silent=20, ready="Unknown"), node("f"), node("tiny", memory=10),
             node("big", silent=3, memory=10**8))
    for jobs in ((hasty, patient, other), (patient, hasty, other)):
        reasons = {a.job_id: a.reason for a in plan(Desired(jobs=jobs), Observed(nodes), NOW)
                   if isinstance(a, RewindJob)}
        assert reasons == {"h": "NoNodeWithRoom", "p": "WaitingForNode"}


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 300)), min_size=2, max_size=6),
    micro_batches=st.integers(1, 8),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    stages=st.integers(2, 4),
    shares=st.lists(st.floats(0.3, 1.5), min_size=4, max_size=4),
    lost_index=st.integers(0, 3),
)
def test_a_lost_stage_fits_on_a_spare_with_the_room_its_node_had(
    shape: list[tuple[int, int]], micro_batches: int, schedule: str, stages: int, shares: list[float],
    lost_index: int,
) -> None:
    """A replacement needs what the solver placed the stage by (the micro-batches in flight at its place in the
    pipeline, as its agent checks), so a spare with the room the lost node had takes it."""
    assume(stages <= len(shape) and lost_index < stages)
    layers = tuple(LayerProfile(100.0, params, 0, stash_bytes_per_sample=stash) for params, stash in shape)
    workload = Workload(1, micro_batches, schedule)
    whole = stage_memory(layers, workload)
    nodes = tuple(node(f"n{i}", flops=1e9 * (i + 1), memory=int(share * whole)) for i, share in enumerate(shares))
    queued = job("j", stages_requested=stages, layers=layers, workload=workload)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes), NOW)
    assume(isinstance(action, PlaceJob))
    lost = next(s for s in action.stages if s.index == lost_index)
    rows = tuple(PlacedStage(s.index, s.layer_start, s.layer_end, s.node_id, 2) for s in action.stages)
    placed_workload = replace(workload, activation_checkpointing=action.activation_checkpointing)  # as it is stored
    running = job("j", "running", generation=2, stages_requested=stages, layers=layers, workload=placed_workload,
                  stages=rows, driver_lease_expires_at=NOW + timedelta(seconds=30))
    by_id = {n.id: n for n in nodes}
    spare = node("spare", flops=1e8, memory=by_id[lost.node_id].memory_bytes)
    after = tuple(replace(n, lease_renewed_at=NOW - timedelta(seconds=20), ready_status="Unknown")
                  if n.id == lost.node_id else n for n in nodes if n.id in {s.node_id for s in rows})
    actions = plan(Desired(jobs=(running,)), Observed((*after, spare)), NOW)
    [rewind] = [a for a in actions if isinstance(a, RewindJob)]
    assert (rewind.status, rewind.moves) == ("placing", ((lost_index, 0, 0, "spare"),))


def test_two_lost_stages_never_share_a_replacement() -> None:
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = (node("a", silent=20, ready="Unknown"), node("b", silent=20, ready="Unknown"), node("c"), node("d"))
    [action] = plan(Desired(jobs=(running,)), Observed(nodes), NOW)
    assert isinstance(action, RewindJob) and action.status == "pending"
    assert action.moves == ((0, 0, 0, None), (1, 0, 0, None))


def test_a_running_job_gets_a_new_driver_only_when_its_lease_expired() -> None:
    nodes = tuple(node(name) for name in "abc")
    live = NOW + timedelta(seconds=30)
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=live)
    assert plan(Desired(jobs=(running,)), Observed(nodes), NOW) == []
    expired = NOW - timedelta(seconds=1)
    dead = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=expired)
    [action] = plan(Desired(jobs=(dead,)), Observed(nodes), NOW)
    assert action == StartDriver("j", 2, "running", expired, action.conditions)
    assert get_condition(action.conditions, "Training")["reason"] == "DriverRestarted"
    # A driver that had claimed the lease and stopped renewing it died mid-run: rewind, counting it.
    claimed = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=expired,
                  driver_claimed=True, restarts=1)
    [action] = plan(Desired(jobs=(claimed,)), Observed(nodes), NOW)
    assert isinstance(action, RewindJob) and (action.moves, action.count_restart) == ((), True)
    exhausted = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=expired,
                    driver_claimed=True, restarts=5)
    [action] = plan(Desired(jobs=(exhausted,)), Observed(nodes), NOW)
    assert isinstance(action, FailJob) and action.reason == "BackoffLimitExceeded"


def test_a_stage_agent_dying_under_the_driver_costs_one_rewind_that_moves_its_stage() -> None:
    # b's agent dies at NOW; the driver's call to it fails and the driver gives its lease back at once, while b
    # is still Ready within its lease. Passes every second, the others heartbeating every 2 s: the first rewind
    # must move stage 1 off b (a rewind in place would rebuild it on the dead node, and the node's loss would
    # rewind the job a second time).
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=NOW,
                  driver_claimed=True)
    rewinds = []
    for t in range(1, 15):
        at = NOW + timedelta(seconds=t)
        heard = at - timedelta(seconds=t % 2)
        nodes = (*(replace(node(n), lease_renewed_at=heard) for n in "ac"), node("b", silent=0.5),
                 replace(node("spare"), lease_renewed_at=heard))
        rewinds += [a for a in plan(Desired(jobs=(running,)), Observed(nodes), at) if isinstance(a, RewindJob)]
        if rewinds:
            break
    assert [(r.reason, r.moves, r.count_restart) for r in rewinds] == [("NodeLost", ((1, 0, 0, "spare"),), False)]
    # An interruption from a live node's refusal: once every node heartbeated since, the job rewinds in place.
    alive = tuple(node(n, silent=0.0) for n in ("a", "b", "c", "spare"))
    [rewind] = plan(Desired(jobs=(running,)), Observed(alive), NOW + timedelta(seconds=1))
    assert (rewind.reason, rewind.moves, rewind.count_restart) == ("DriverLost", (), True)


def test_a_stored_model_that_no_longer_validates_fails_the_job() -> None:
    broken = job(layers=(), spec_error="model_config.type: unknown model type 'x'")
    [action] = plan(Desired(jobs=(broken,)), Observed(nodes=(node("a"),)), NOW)
    assert action == FailJob("j1", 1, "InvalidModel", "model_config.type: unknown model type 'x'")


def test_a_placing_job_without_stages_is_requeued() -> None:
    [action] = plan(Desired(jobs=(job("j", "placing", generation=2),)), Observed(nodes=(node("a"),)), NOW)
    assert action == RequeueJob("j", 2, "StagesMissing", "the placement has no stages")


def test_a_paused_node_takes_no_new_stage() -> None:
    queued = job("j", stages_requested=2)
    nodes = (node("fast", flops=9e9), node("paused", flops=8e9), node("slow"))
    nodes = (nodes[0], replace(nodes[1], paused=True), nodes[2])
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes), NOW)
    assert isinstance(action, PlaceJob) and {s.node_id for s in action.stages} == {"fast", "slow"}


def test_a_running_job_on_a_paused_node_first_asks_its_driver_to_hand_over() -> None:
    live = NOW + timedelta(seconds=5)
    running = job("j", "running", generation=2, stages=placed("j", ["a", "b", "c"]), driver_lease_expires_at=live,
                  driver_claimed=True)
    nodes = (node("a"), replace(node("b"), paused=True), node("c"), node("spare"))
    [action] = plan(Desired(jobs=(running,)), Observed(nodes), NOW)
    assert isinstance(action, RequestHandover) and (action.job_id, action.generation) == ("j", 2)
    draining = get_condition(action.conditions, "Draining")
    assert draining["status"] == "True"
    assert f"stage 1 on {seen('b')} (paused by its owner): checkpointing" in draining["message"]
    # Asked already: nothing more until the driver lets go.
    asked = replace(running, handover_requested=True)
    assert plan(Desired(jobs=(asked,)), Observed(nodes), NOW) == []
    # Let go (checkpointed; claimed lease expired): only the drained stage moves, counted as no restart.
    handed = replace(asked, driver_lease_expires_at=NOW - timedelta(seconds=1))
    [action] = plan(Desired(jobs=(handed,)), Observed(nodes), NOW)
    assert action == RewindJob(
        "j", 2, "placing", ((1, 0, 0, "spare"),), False, "NodeDrained",
        f"stage 1 moved from {seen('b')} (paused by its owner) to {seen('spare')}",
    )


def test_a_placing_job_on_a_paused_node_moves_at_once() -> None:
    placing = job("j", "placing", generation=2, stages=placed("j", ["a", "b", "c"]))
    nodes = (node("a"), node("b"), replace(node("c"), paused=True), node("spare"))
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes, reports("j", ["ready"] * 3)), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((2, 0, 0, "spare"),) and action.reason == "NodeDrained"


def test_placement_honours_the_jobs_requirements_and_budget() -> None:
    nodes = (
        replace(node("gpu", flops=9e9), device_type="cuda", price_per_hour=2.0),
        replace(node("big", memory=10**7), price_per_hour=0.3),
        replace(node("small", memory=10**6), price_per_hour=0.3),
        replace(node("other"), price_per_hour=0.3),
    )
    needs = Requirements(device_types=("cpu",), min_memory_bytes=2 * 10**6, owner_diversity=False)
    picky = job(stages_requested=None, requirements=needs)
    [action] = plan(Desired(jobs=(picky,)), Observed(nodes), NOW)
    assert isinstance(action, PlaceJob) and [s.node_id for s in action.stages] == ["big"]  # the only cpu ≥ 2 MB
    frugal = job(stages_requested=None, requirements=Requirements(max_price_per_hour=0.7, owner_diversity=False))
    [action] = plan(Desired(jobs=(frugal,)), Observed(nodes), NOW)
    assert isinstance(action, PlaceJob) and "gpu" not in {s.node_id for s in action.stages}
    assert len(action.stages) == 2  # two $0.30 devices fit the $0.70 budget, three would not
    wide = job(stages_requested=None, requirements=Requirements(min_devices=3, device_types=("cuda",)))
    [action] = plan(Desired(jobs=(wide,)), Observed(nodes), NOW)
    condition = get_condition(action.conditions, "Placed")
    assert condition["message"] == "needs 3 Ready nodes meeting its requirements, 1 available"


def test_small_fast_nodes_do_not_crowd_out_the_big_slow_ones_a_job_needs() -> None:
    # Far more fast nodes than the solver searches, none with room for even the smallest layer (96 bytes to
    # train), and three slow ones that hold the model: the job goes to those, not waiting for room.
    tiny = tuple(node(f"fast{i:02}", flops=1e12, memory=50) for i in range(40))
    big = (node("big0"), node("big1"), node("big2"))
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=tiny + big), NOW)
    assert isinstance(action, PlaceJob)
    assert sorted(s.node_id for s in action.stages) == ["big0", "big1", "big2"]
    # With too few that fit, it waits, saying the others have no room.
    [action] = plan(Desired(jobs=(job(),)), Observed(nodes=tiny + big[:2]), NOW)
    condition = get_condition(action.conditions, "Placed")
    assert condition["message"] == "needs 3 Ready nodes with room for a stage, 2 available"


def test_where_a_stage_would_not_fit_placement_has_the_job_recompute_its_activations() -> None:
    # Six layers of 1,000 parameters (16 KB to train with Adam) that take in and hand on 10 KB per sample and stash
    # 1 MB; eight micro-batches of one sample in flight, two layers a stage. Whole, a stage needs 16 MB for them;
    # recomputing, 8 x 20 KB of inputs and outputs and 8 MB of heap that one layer's forward each left.
    layers = tuple(
        LayerProfile(100.0, 1000, 10_000, stash_bytes_per_sample=10**6, input_bytes_per_sample=10_000) for _ in range(6)
    )
    workload = Workload(1, 8)
    whole = stage_memory(layers[:2], workload)
    recomputing = stage_memory(layers[:2], replace(workload, activation_checkpointing=True))
    assert recomputing < whole
    nodes = tuple(node(name, memory=recomputing) for name in "abc")
    [action] = plan(Desired(jobs=(job(layers=layers, workload=workload),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, PlaceJob) and action.activation_checkpointing
    assert "recompute their activations" in get_condition(action.conditions, "Placed")["message"]
    roomy = tuple(node(name, memory=whole) for name in "abc")
    [action] = plan(Desired(jobs=(job(layers=layers, workload=workload),)), Observed(nodes=roomy), NOW)
    assert isinstance(action, PlaceJob) and not action.activation_checkpointing  # it fits whole: no recompute
    small = tuple(node(name, memory=recomputing - 1) for name in "abc")  # no room even recomputing
    [action] = plan(Desired(jobs=(job(layers=layers, workload=workload),)), Observed(nodes=small), NOW)
    message = get_condition(action.conditions, "Placed")["message"]
    assert message.startswith("no split of 6 layers over 3 or more of the 3 devices fits their memory")
