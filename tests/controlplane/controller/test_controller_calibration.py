"""A node's speed on a job's stage (controlplane/controller/calibration.py): measured where the job's driver timed it,
else its benchmark calibrated by the job's timed nodes (the stage's, else every stage's, else its market figure), and
never above its market figure; and plan() weighing one more replica by it (issue 29): an untimed node is not taken
for ~100x faster than the job's timed ones because a small model reaches ~1% of a matmul benchmark."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import Workload
from controlplane.controller.actions import AddReplicas
from controlplane.controller.calibration import calibration
from controlplane.controller.rules import plan
from controlplane.controller.views import (
    Desired,
    JobView,
    NodeView,
    Observed,
    PlacedStage,
    Requirements,
    StageReport,
)
from tests.controlplane.controller.test_controller_rules import NOW, job, node

FLOPS = st.floats(1e6, 1e12)
# (measured or market FLOP/s, benchmark; 0: none) of a node
NODE = st.tuples(FLOPS, st.sampled_from([0.0, 1e9, 5e10, 2e11]))


def benchmarked(name: str, flops: float, declared: float) -> NodeView:
    return replace(node(name, flops=flops), declared_flops=declared)


def three_stages(rows: list[tuple[int, str, bool]]) -> JobView:
    """A job of three one-layer stages whose rows are (index, node, timed)."""
    return job(status="running", stages=tuple(
        PlacedStage(i, i, i + 1, n, 2, replica=k, timed=t) for k, (i, n, t) in enumerate(rows)))


@settings(max_examples=200, deadline=None)
@given(hosts=st.lists(st.tuples(st.integers(0, 2), NODE, st.booleans()), min_size=1, max_size=6),
       other=NODE, index=st.integers(0, 2))
def test_a_node_is_never_above_its_market_figure_and_a_timed_one_is_at_its_measured(
    hosts: list[tuple[int, tuple[float, float], bool]], other: tuple[float, float], index: int
) -> None:
    nodes = {f"h{k}": benchmarked(f"h{k}", f, d) for k, (_, (f, d), _) in enumerate(hosts)}
    nodes["x"] = benchmarked("x", *other)
    running = three_stages([(i, f"h{k}", t) for k, (i, _, t) in enumerate(hosts)])
    speeds = calibration(running, nodes)
    for k, (i, _, timed) in enumerate(hosts):
        if timed:
            assert speeds.flops(nodes[f"h{k}"], i) == nodes[f"h{k}"].flops
    assert 0 <= speeds.flops(nodes["x"], index) <= nodes["x"].flops
    if not any(t and nodes[f"h{k}"].declared_flops > 0 for k, (_, _, t) in enumerate(hosts)):
        assert speeds.flops(nodes["x"], index) == nodes["x"].flops  # nothing timed to calibrate by


@settings(max_examples=200, deadline=None)
@given(ratio=st.floats(1e-4, 1.0), declared=st.lists(st.floats(1e8, 1e12), min_size=1, max_size=4),
       benchmark=st.floats(1e8, 1e12), more=st.floats(1.0, 10.0))
def test_an_untimed_node_counts_at_its_benchmark_times_what_the_timed_ones_showed_of_theirs(
    ratio: float, declared: list[float], benchmark: float, more: float
) -> None:
    # stage 1's replicas all reached `ratio` of their benchmarks; a candidate's market figure is its benchmark
    nodes = {f"h{k}": benchmarked(f"h{k}", d * ratio, d) for k, d in enumerate(declared)}
    running = three_stages([(1, f"h{k}", True) for k in range(len(declared))])
    speeds = calibration(running, nodes)
    candidate, faster = benchmarked("x", benchmark, benchmark), benchmarked("y", benchmark * more, benchmark * more)
    expected = benchmark * ratio
    assert abs(speeds.flops(candidate, 1) - expected) <= 1e-9 * expected
    assert speeds.flops(faster, 1) >= speeds.flops(candidate, 1)  # a better benchmark never counts slower
    # no stage of its own timed: the job's other stages calibrate it
    assert abs(speeds.flops(candidate, 0) - expected) <= 1e-9 * expected


def test_a_stage_is_calibrated_by_its_own_timed_nodes_before_the_jobs_others() -> None:
    nodes = {"a": benchmarked("a", 1e8, 1e10), "b": benchmarked("b", 3e9, 1e10), "x": benchmarked("x", 1e10, 1e10)}
    speeds = calibration(three_stages([(0, "a", True), (1, "b", True)]), nodes)
    assert speeds.flops(nodes["x"], 0) == 1e8  # stage 0 reaches 1% of its benchmark
    assert speeds.flops(nodes["x"], 1) == 3e9  # stage 1, 30%
    assert abs(speeds.flops(nodes["x"], 2) - 1e10 * 3.1e9 / 2e10) < 1  # stage 2: pooled over both, 15.5%
    # a row not timed yet (a replica that just joined) calibrates nothing: it is calibrated itself
    fresh = calibration(three_stages([(0, "a", False), (1, "b", True)]), nodes)
    assert fresh.flops(nodes["a"], 0) == min(1e8, 1e10 * 0.3)


# The e2e's elastic job (tests/e2e/test_swarm_stages.py GROWING): one stage of the digits MLP, 32 samples a step in 4
# micro-batches, grown up to 3 replicas. Its driver measures a replica at ~1% of the node's matmul benchmark.
MLP = tuple(layer_profiles(model_spec_from_config({"layer_sizes": [64, 128, 64, 10]})))


def elastic(rows: list[tuple[str, bool]]) -> JobView:
    stages = tuple(PlacedStage(0, 0, len(MLP), n, 2, replica=k, timed=t) for k, (n, t) in enumerate(rows))
    return job(status="running", generation=2, stages_requested=1, layers=MLP, workload=Workload(8, 4),
               replicas_min=1, replicas_max=3, next_replica=len(rows), stages=stages,
               requirements=Requirements(owner_diversity=False),  # one stage: any replica's owner holds every stage
               driver_lease_expires_at=NOW + timedelta(seconds=5))


def host(name: str, flops: float, latency_s: float, declared: float = 5e10) -> NodeView:
    return replace(benchmarked(name, flops, declared), latency_s=latency_s, bandwidth_bytes_per_s=1e8)


def grown(running: JobView, nodes: tuple[NodeView, ...]) -> list[str]:
    reports = {(running.id, *s.key): StageReport(2, "ready") for s in running.stages}
    actions = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=reports), NOW)
    assert all(isinstance(a, AddReplicas) for a in actions)
    return [s.node_id for a in actions for s in a.stages]


def test_an_untimed_spare_is_weighed_at_the_speed_the_jobs_timed_replica_showed() -> None:
    # "a" trains at 1% of its benchmark; spare "x" has the same benchmark. 1.5 ms one way, the replicas' exchange
    # costs more than half a step: a second replica as fast as "a" is not worth it. Taken at its benchmark (100x
    # "a"), "x" would have looked worth it: all the compute gone, only the exchange left.
    slow_links = (host("a", 5e8, 1.5e-3), host("x", 5e10, 1.5e-3))
    assert grown(elastic([("a", True)]), slow_links) == []
    # timed at the same speed, the same answer: the calibration stands for the measurement it lacks
    assert grown(elastic([("a", True)]), (slow_links[0], host("x", 5e8, 1.5e-3, declared=0.0))) == []
    # over 0.5 ms links the exchange is cheap and the second replica halves the compute: it is added
    assert grown(elastic([("a", True)]), (host("a", 5e8, 5e-4), host("x", 5e10, 5e-4))) == ["x"]


@settings(max_examples=60, deadline=None)
@given(measured=st.floats(1e7, 5e10), spare=st.floats(1e9, 1e11), joined=st.booleans(),
       latency=st.sampled_from([0.0, 5e-4, 1.5e-3]))
def test_growth_decides_on_untimed_nodes_as_if_they_had_been_timed_at_their_calibrated_speed(
    measured: float, spare: float, joined: bool, latency: float
) -> None:
    # replica 0 timed on "a" (benchmark 5e10); maybe replica 1 joined on "b", not timed yet; spare "x"
    ratio = measured / 5e10
    rows = [("a", True), ("b", False)] if joined else [("a", True)]
    untimed = (host("a", measured, latency), host("b", 5e10, latency), host("x", min(spare, 1e11), latency, spare))
    known = (untimed[0], host("b", 5e10 * ratio, latency, 0.0), host("x", min(spare * ratio, 1e11), latency, 0.0))
    assert grown(elastic(rows), untimed) == grown(elastic(rows), known)


def test_a_third_replica_is_added_while_the_second_is_untimed_where_the_micro_batches_split_three_ways() -> None:
    # "b" joined and is not timed yet; it and spare "x" count at "a"'s 1% of the benchmark, not at 100x "a"
    nodes = (host("a", 5e8, 2.5e-4), host("b", 5e10, 2.5e-4), host("x", 5e10, 2.5e-4))
    joined = elastic([("a", True), ("b", False)])
    assert grown(replace(joined, workload=Workload(6, 6)), nodes) == ["x"]  # 3 + 3 micro-batches -> 2 + 2 + 2
    # of 4 micro-batches one replica of three still takes 2, as each of two does: a third adds only its exchange
    assert grown(joined, nodes) == []
