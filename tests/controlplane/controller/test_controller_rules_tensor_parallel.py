"""plan() with tensor-parallel stages, property-tested: a placement gives every rank of every stage its
own Ready node with room for its share (or says why not), and when a rank's node goes silent only that
rank moves: to the fastest free node with room, after which the re-formed group starts training again,
or it is unplaced and the job waits pending with a reason until a node turns up."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.placement.solver import LayerProfile, Workload, stage_memory
from controlplane.common.conditions import get_condition
from controlplane.controller.actions import MarkNodeUnknown, PlaceJob, RewindJob, SetCondition, StartDriver
from controlplane.controller.rules import plan
from controlplane.controller.views import (
    Desired,
    JobView,
    NodeView,
    Observed,
    PlacedStage,
    Requirements,
    StageReport,
    TensorParallel,
)

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
WORKLOAD = Workload(micro_batch_size=2, micro_batches=2)
BIG = 10**9
MEMORIES = [60_000, 120_000, BIG]  # a rank's share fits in 60 KB only for some splits; a whole block in 120 KB


def node(name: str, *, flops: float, memory: int, silent: float = 1.0) -> NodeView:
    return NodeView(
        id=name,
        name=name,
        ready_status="True",
        lease_renewed_at=NOW - timedelta(seconds=silent),
        lease_duration_seconds=6.0,
        flops=flops,
        memory_bytes=memory,
        owner=f"owner-of-{name}",  # every node another contributor's
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[JobView, list[NodeView]]:
    blocks = draw(st.integers(1, 3))
    layers = (
        LayerProfile(1e3, 500, 256),
        *(LayerProfile(1e5, 5_000, 256, tensor_parallel=True) for _ in range(blocks)),
        LayerProfile(1e4, 500, 1024),
    )
    stages = draw(st.integers(1, min(len(layers), 3)))
    split = draw(st.one_of(st.none(), st.sets(st.integers(0, stages - 1), min_size=1).map(lambda s: tuple(sorted(s)))))
    job = JobView(
        id="j",
        status="queued",
        generation=1,
        stages_requested=stages,
        layers=layers,
        workload=WORKLOAD,
        tensor_parallel=TensorParallel(size=draw(st.integers(2, 3)), stages=split),
        requirements=Requirements(owner_diversity=False),  # one-stage jobs too (owners: test_controller_rules_owners)
    )
    nodes = [
        node(f"n{i}", flops=draw(st.sampled_from([1e9, 2e9, 4e9])), memory=draw(st.sampled_from(MEMORIES)))
        for i in range(draw(st.integers(1, 9)))
    ]
    return job, nodes


def rows_by_stage(rows: tuple[PlacedStage, ...] | tuple) -> dict[int, list]:
    stages: dict[int, list] = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r.index, r.rank)):
        stages[row.index].append(row)
    return stages


def need(job: JobView, row: PlacedStage) -> int:
    return stage_memory(job.layers[row.layer_start : row.layer_end], WORKLOAD, job.tensor_parallel.ranks(row.index))


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), pick=st.integers(0, 100), spares=st.lists(st.sampled_from(MEMORIES), max_size=2))
def test_every_rank_gets_its_own_node_and_a_lost_rank_moves_alone(scenario, pick, spares) -> None:
    job, nodes = scenario
    [action] = plan(Desired(jobs=(job,)), Observed(nodes=tuple(nodes)), NOW)
    split = job.tensor_parallel
    by_id = {n.id: n for n in nodes}
    if not isinstance(action, PlaceJob):
        # Not placed: the job says why, and with room everywhere it is only for want of nodes.
        assert isinstance(action, SetCondition)
        placed = get_condition(action.conditions, "Placed")
        assert placed["status"] == "False" and placed["message"]
        assert placed["reason"] in {"WaitingForNodes", "NoFeasiblePlacement"}
        if all(n.memory_bytes == BIG for n in nodes):
            assert len(nodes) < split.nodes(job.stages_requested) and placed["reason"] == "WaitingForNodes"
        return

    # Every rank of every stage is filled, each on a distinct node with room for its share.
    stages = rows_by_stage(action.stages)
    assert sorted(stages) == list(range(job.stages_requested))
    for index, rows in stages.items():
        assert [r.rank for r in rows] == list(range(split.ranks(index)))
        assert len({(r.layer_start, r.layer_end) for r in rows}) == 1
    bounds = [stages[i][0].layer_start for i in sorted(stages)] + [stages[max(stages)][0].layer_end]
    assert bounds[0] == 0 and bounds[-1] == len(job.layers)
    assert all(stages[i][0].layer_end == bounds[i + 1] for i in sorted(stages))
    assert len({r.node_id for r in action.stages}) == len(action.stages)
    assert all(need(job, r) <= by_id[r.node_id].memory_bytes for r in action.stages)

    # One rank's node goes silent; spare nodes (and any the placement left free) may take its place.
    generation = action.generation + 1
    rows = tuple(PlacedStage(r.index, r.layer_start, r.layer_end, r.node_id, generation, r.rank) for r in action.stages)
    lost = rows[pick % len(rows)]
    silent_since = NOW - timedelta(seconds=20)
    nodes = [replace(n, lease_renewed_at=silent_since) if n.id == lost.node_id else n for n in nodes]
    nodes += [node(f"spare{i}", flops=1e9, memory=m) for i, m in enumerate(spares)]
    running = replace(job, status="running", generation=generation, stages=rows)
    ready = {("j", *r.key): StageReport(generation, "ready") for r in rows}
    actions = plan(Desired(jobs=(running,)), Observed(nodes=tuple(nodes), stages=ready), NOW)
    assert actions[0] == MarkNodeUnknown(lost.node_id, silent_since, "NodeLeaseExpired", "no heartbeat for 20s")
    [rewind] = actions[1:]
    assert isinstance(rewind, RewindJob) and rewind.generation == generation
    holding = {r.node_id for r in rows}
    free = sorted((n for n in nodes if n.id not in holding), key=lambda n: (-n.flops, n.id))
    room = [n for n in free if n.memory_bytes >= need(job, lost)]
    # Marked Unknown from the next pass on.
    nodes = [replace(n, ready_status="Unknown") if n.id == lost.node_id else n for n in nodes]
    label = f"stage {lost.index}" + (f" rank {lost.rank}" if split.ranks(lost.index) > 1 else "")
    if not room:
        # Nowhere to go: only that rank is unplaced, and the job waits, saying for what.
        # Every free Ready node too small (not merely none free): the job says so.
        assert (rewind.status, rewind.moves, rewind.reason) == ("pending", ((lost.index, lost.rank, 0, None),),
                                                                "NoNodeWithRoom" if free else "WaitingForNode")
        assert label in rewind.message
        arrival = node("late", flops=1e9, memory=BIG)
        pending = replace(running, status="pending", generation=generation + 1, stages=tuple(
            replace(r, node_id=None) if r == lost else replace(r, generation=generation + 1) for r in rows))
        [placed] = plan(Desired(jobs=(pending,)), Observed(nodes=(*nodes, arrival)), NOW)
        assert isinstance(placed, RewindJob) and placed.moves == ((lost.index, lost.rank, 0, "late"),)
        return
    # Only the lost rank moves, to the fastest free node with room, never one of the group's others.
    assert (rewind.status, rewind.moves, rewind.reason) == ("placing", ((lost.index, lost.rank, 0, room[0].id),),
                                                            "NodeLost")
    assert label in rewind.message
    # The re-formed job rebuilds at the next generation; once every rank reports ready, training resumes.
    moved = tuple(
        replace(r, node_id=room[0].id if r == lost else r.node_id, generation=generation + 1) for r in rows
    )
    assert len({r.node_id for r in moved}) == len(moved)
    placing = replace(running, status="placing", generation=generation + 1, stages=moved)
    ready = {("j", *r.key): StageReport(generation + 1, "ready") for r in moved}
    [start] = plan(Desired(jobs=(placing,)), Observed(nodes=tuple(nodes), stages=ready), NOW)
    assert isinstance(start, StartDriver)
