"""plan() for a succeeded job its owner serves: its final checkpoint's stages placed for inference (weights and
decoding caches, no training state), moved off lost nodes, watched until ready, and released when asked."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from arceus.placement.solver import LayerProfile, stage_inference_memory, stage_state_bytes
from controlplane.common.conditions import get_condition
from controlplane.controller.actions import PlaceJob, PlannedStage, ServeJob, SetCondition, StopServing
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, JobView, Observed, PlacedStage, Requirements, StageReport
from tests.controlplane.controller.test_controller_rules import NOW, job, node, seen

# Three layers of a text writer: two blocks keeping 100 bytes of keys and values per sequence, and a small head.
LAYERS = (
    LayerProfile(100.0, 62, 8, stash_bytes_per_sample=8, kv_cache_bytes_per_sequence=100),
    LayerProfile(100.0, 62, 8, stash_bytes_per_sample=8, kv_cache_bytes_per_sequence=100),
    LayerProfile(10.0, 6, 8, stash_bytes_per_sample=8),
)
FINAL = ((0, 0, 1), (1, 1, 2), (2, 2, 3))  # the final checkpoint's stages
BLOCK = stage_inference_memory(LAYERS[:1], 4)  # 62 weights of 4 bytes, 4 sequences' caches, a forward: 656


def served(stages: tuple[PlacedStage, ...] = (), **fields: object) -> JobView:
    defaults: dict = {"layers": LAYERS, "serving": True, "served_layers": FINAL, "generation": 5, "stages": stages}
    return job("s1", "succeeded", **{**defaults, **fields})


def on(*nodes: str, generation: int = 5) -> tuple[PlacedStage, ...]:
    return tuple(PlacedStage(i, i, i + 1, n, generation) for i, n in enumerate(nodes))


def test_the_final_checkpoints_stages_go_to_the_fastest_nodes_with_room_for_weights_and_caches() -> None:
    assert BLOCK == 62 * 4 + 4 * 100 + 8
    assert stage_state_bytes(LAYERS[:1]) > 900 > BLOCK  # too small to train the block, enough to serve it
    nodes = (node("fast", flops=4e9, memory=900), node("mid", flops=2e9, memory=900), node("tiny", flops=8e9,
             memory=200), node("slow", flops=1e9, memory=900))
    [action] = plan(Desired(jobs=(served(),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, ServeJob) and (action.job_id, action.generation) == ("s1", 5)
    # The largest first, each on the fastest free node with room: the head fits the tiny node.
    assert action.stages == (PlannedStage(0, 0, 1, "fast"), PlannedStage(1, 1, 2, "mid"), PlannedStage(2, 2, 3, "tiny"))
    condition = get_condition(action.conditions, "Serving")
    assert (condition["status"], condition["reason"]) == ("False", "Placed")
    assert condition["message"] == f"stage 0 on {seen('fast')}; stage 1 on {seen('mid')}; stage 2 on {seen('tiny')}"


def test_without_room_for_every_stage_it_waits_and_says_for_what() -> None:
    [waiting] = plan(Desired(jobs=(served(),)), Observed(nodes=(node("a"), node("small", memory=600))), NOW)
    assert isinstance(waiting, SetCondition)
    condition = get_condition(waiting.conditions, "Serving")
    assert (condition["reason"], condition["message"]) == (
        "WaitingForNodes",
        f"waiting for a Ready node with room for stage 1 (layers 1-1, needs {BLOCK:,} bytes) (2 free Ready nodes now)",
    )
    # Nothing changed: nothing is written again.
    assert plan(Desired(jobs=(served(conditions=waiting.conditions),)), Observed(nodes=(node("a"),
                node("small", memory=600))), NOW) == []


def test_a_stage_on_a_lost_node_moves_and_the_others_stay() -> None:
    nodes = (node("a"), node("b", silent=30, ready="Unknown"), node("c"), node("spare", flops=2e9))
    [action] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, ServeJob)
    assert [s.node_id for s in action.stages] == ["a", "spare", "c"]
    moved = get_condition(action.conditions, "Serving")["message"]
    assert moved == f"stage 1 moved from {seen('b')} to {seen('spare')}"
    # Paused by its owner: moved the same way (nothing trains, so there is nothing to hand over).
    paused = (node("a"), replace(node("b"), paused=True), node("c"), node("spare"))
    [moved] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=paused), NOW)
    assert [s.node_id for s in moved.stages] == ["a", "spare", "c"]


def test_a_lost_stage_with_nowhere_to_go_releases_the_rest_and_the_wish_stands() -> None:
    nodes = (node("a"), node("b", silent=30, ready="Unknown"), node("c"))
    [action] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=nodes), NOW)
    assert isinstance(action, StopServing) and action.serving is True
    assert get_condition(action.conditions, "Serving")["reason"] == "WaitingForNodes"


def test_every_stage_ready_makes_it_servable_and_a_failed_one_stops_serving() -> None:
    nodes = (node("a"), node("b"), node("c"))
    reports = {("s1", i, 0, 0): StageReport(5, "ready") for i in range(3)}
    [ready] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=nodes, stages=reports), NOW)
    assert isinstance(ready, SetCondition)
    condition = get_condition(ready.conditions, "Serving")
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "True", "Ready", "3/3 stages ready to decode"
    )
    stale = {**reports, ("s1", 2, 0, 0): StageReport(4, "ready")}  # a report of an earlier generation
    [waiting] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=nodes, stages=stale), NOW)
    assert get_condition(waiting.conditions, "Serving")["message"] == "2/3 stages ready"

    failed = {**reports, ("s1", 1, 0, 0): StageReport(5, "failed", "out of memory")}
    [stop] = plan(Desired(jobs=(served(on("a", "b", "c")),)), Observed(nodes=nodes, stages=failed), NOW)
    assert isinstance(stop, StopServing) and stop.serving is False
    condition = get_condition(stop.conditions, "Serving")
    assert (condition["reason"], condition["message"]) == (
        "StageFailed",
        f"stage 1 on {seen('b')} could not be built: out of memory; serving stopped (ask for it again to retry)",
    )


def test_serving_no_longer_asked_for_releases_the_nodes_for_a_queued_job() -> None:
    stopping = served(on("a", "b", "c"), serving=False)
    queued = job("q", stages_requested=1, requirements=Requirements(owner_diversity=False))
    nodes = (node("a"), node("b"), node("c"))
    [release, waiting] = plan(Desired(jobs=(stopping, queued)), Observed(nodes=nodes), NOW)
    assert isinstance(release, StopServing) and release.serving is False
    assert get_condition(release.conditions, "Serving")["reason"] == "Stopped"
    # The queued job waits: a served job's nodes are busy until the release is applied.
    assert isinstance(waiting, SetCondition)
    assert get_condition(waiting.conditions, "Placed")["message"] == "needs 1 Ready node, 0 available"
    # Released (no stages left): nothing more to do for it, and the nodes are free again.
    [placed] = plan(Desired(jobs=(served(serving=False), queued)), Observed(nodes=(node("a"),)), NOW)
    assert isinstance(placed, PlaceJob) and placed.job_id == "q"


def test_a_served_job_takes_nodes_that_a_later_queued_job_then_cannot() -> None:
    nodes = (node("a"), node("b"), node("c"))
    [serve, waiting] = plan(Desired(jobs=(served(), job("q", stages_requested=1))), Observed(nodes=nodes),
                            NOW + timedelta(seconds=1))
    assert isinstance(serve, ServeJob) and {s.node_id for s in serve.stages} == {"a", "b", "c"}
    assert isinstance(waiting, SetCondition) and waiting.job_id == "q"
