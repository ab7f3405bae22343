"""plan() for a replica the driver keeps fencing (failed steps between live replicas): dropped once fenced
`max_fences` times, while fenced and only where its stage keeps a replica that trains; its node then takes none of the
job's replicas for `fenced_out_seconds`, and the stage grows on another node."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.controller.actions import AddReplicas, DropReplicas
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, JobView, Observed, PlacedStage
from tests.controlplane.controller.test_controller_rules import NOW, node, seen
from tests.controlplane.controller.test_controller_rules_replicas import TWO_EACH, ready, replicated


def fenced(view: JobView, fences: dict[tuple[int, int], int], *, now_fenced: bool = True) -> JobView:
    """`view` with the replicas of `fences` ((index, replica) -> times) fenced that often (and fenced now)."""
    return replace(view, stages=tuple(
        replace(s, fenced=now_fenced, fences=fences[s.index, s.replica]) if (s.index, s.replica) in fences else s
        for s in view.stages
    ))


NODES = tuple(node(n) for n in "abcdef")


def test_a_replica_fenced_max_fences_times_is_dropped_and_its_node_is_passed_over_for_a_while() -> None:
    running = fenced(replicated(rows=TWO_EACH), {(1, 1): 3})
    [drop] = plan(Desired(jobs=(running,)), Observed(nodes=(*NODES, node("spare")), stages=ready(running)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 1),) and drop.fenced == ((1, 1, 3),)
    condition = drop.conditions[0]
    assert (condition["type"], condition["reason"]) == ("Replicas", "ReplicaFencedOut")
    assert condition["message"].startswith(f"stage 1 replica 1 on {seen('d')} left: the driver fenced it 3 times")
    # dropped: the stage is below its min, and grows on another node; "d", the fastest free node now, is passed over
    # until `fenced_out_seconds` after the drop, though it heartbeats
    dropped_at = NOW - timedelta(seconds=60)
    left = replace(running, stages=tuple(s for s in running.stages if s.key != (1, 0, 1)),
                   released=(("d", dropped_at),), fenced_out=(("d", dropped_at),))
    nodes = (*(node(n) for n in "abcef"), node("d", silent=0.1, flops=4e9), node("spare"))
    [grow] = plan(Desired(jobs=(left,)), Observed(nodes=nodes, stages=ready(left)), NOW)
    assert isinstance(grow, AddReplicas) and [(s.index, s.node_id) for s in grow.stages] == [(1, "spare")]
    alone = tuple(n for n in nodes if n.id != "spare")
    assert plan(Desired(jobs=(left,)), Observed(nodes=alone, stages=ready(left)), NOW) == []
    later = NOW + timedelta(seconds=left.fenced_out_seconds)
    live = replace(left, driver_lease_expires_at=later + timedelta(seconds=5))
    [grow] = plan(Desired(jobs=(live,)), Observed(nodes=tuple(replace(n, lease_renewed_at=later) for n in alone),
                                                   stages=ready(live)), later)
    assert [(s.index, s.node_id) for s in grow.stages] == [(1, "d")]


def test_a_replica_below_max_fences_or_training_again_is_kept() -> None:
    below = fenced(replicated(rows=TWO_EACH), {(1, 1): 2})
    assert plan(Desired(jobs=(below,)), Observed(nodes=NODES, stages=ready(below)), NOW) == []
    rejoined = fenced(replicated(rows=TWO_EACH), {(1, 1): 5}, now_fenced=False)  # dropped when fenced again
    assert plan(Desired(jobs=(rejoined,)), Observed(nodes=NODES, stages=ready(rejoined)), NOW) == []
    fewer = replace(below, max_fences=2)
    [drop] = plan(Desired(jobs=(fewer,)), Observed(nodes=NODES, stages=ready(fewer)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 1),)


def test_a_lost_replica_and_a_fenced_out_one_leave_in_one_drop_while_a_third_trains() -> None:
    rows = [*TWO_EACH, (1, 2, "g")]
    running = fenced(replicated(rows=rows, replicas_max=3), {(1, 2): 4})
    nodes = (*(n for n in NODES if n.id != "c"), node("c", silent=60.0), node("g"))
    *_, drop = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 0), (1, 2)) and drop.fenced == ((1, 2, 4),)
    assert drop.conditions[0]["reason"] == "ReplicaLost"  # not every replica left for its fences


# A replica of a stage of 2 or 3: its node lost (silent past the job's tolerance), a joiner yet to copy the stage's
# state, fenced now (and how often), or fenced before.
REPLICA = st.fixed_dictionaries({
    "lost": st.booleans(), "joining": st.booleans(), "fenced": st.booleans(), "fences": st.integers(0, 5),
})


@settings(max_examples=200, deadline=None)
@given(stages=st.lists(st.lists(REPLICA, min_size=2, max_size=3), min_size=3, max_size=3),
       max_fences=st.integers(1, 4))
def test_a_fenced_out_replica_is_dropped_exactly_where_its_stage_keeps_a_replica_that_trains(
    stages: list[list[dict]], max_fences: int
) -> None:
    """Whatever the stages' replicas are doing, a drop for fences takes exactly the replicas fenced now at least
    `max_fences` times, of a stage that keeps one that trains (alive, not fenced, not a joiner yet to copy): never the
    last; a stage that keeps none drops no fenced replica (its lost ones go as before), and no stage loses every row."""
    rows, silent = [], {}
    for index, replicas in enumerate(stages):
        for replica, r in enumerate(replicas):
            name = f"n{index}{replica}"
            rows.append(PlacedStage(index, index, index + 1, name, 2, replica=replica, joining=r["joining"],
                                    fenced=r["fenced"], fences=r["fences"]))
            silent[name] = 60.0 if r["lost"] else 1.0
    running = replicated(rows=[(0, 0, "x")], replicas_max=3, max_fences=max_fences, stages=tuple(rows),
                         next_replica=3)
    nodes = tuple(node(name, silent=s) for name, s in silent.items())
    actions = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    drops = [a for a in actions if isinstance(a, DropReplicas)]
    dropped = {key for a in drops for key in a.replicas}
    for_fences = {(i, r) for a in drops for i, r, _ in a.fenced}
    expected = set()
    for index, replicas in enumerate(stages):
        trains = any(not r["lost"] and not r["joining"] and not r["fenced"] for r in replicas)
        holds = any(not r["lost"] and not r["joining"] for r in replicas)
        left = {r for r, x in enumerate(replicas) if (index, r) not in dropped}
        assert left, "a stage lost every row"
        if holds:
            assert {(index, r) for r in range(len(replicas)) if (index, r) in dropped} == {
                (index, r) for r, x in enumerate(replicas)
                if x["lost"] or (trains and x["fenced"] and x["fences"] >= max_fences)}
        if trains:
            expected |= {(index, r) for r, x in enumerate(replicas)
                         if not x["lost"] and x["fenced"] and x["fences"] >= max_fences}
            assert any(not replicas[r]["lost"] and not replicas[r]["joining"] and not replicas[r]["fenced"]
                       for r in left)
    assert for_fences == expected
    for a in drops:  # each names the fences it saw, for the executor's check
        assert all(f == stages[i][r]["fences"] for i, r, f in a.fenced)


@settings(max_examples=80, deadline=None)
@given(ago=st.lists(st.sampled_from([None, 1.0, 300.0, 599.0, 600.0, 3600.0]), min_size=1, max_size=4))
def test_a_node_a_replica_was_fenced_out_of_is_no_candidate_until_its_time_is_up(ago: list[float | None]) -> None:
    """The job grows its stage as if the nodes it fenced a replica out of less than `fenced_out_seconds` ago were
    absent; the others are candidates as any."""
    names = [f"s{i}" for i in range(len(ago))]
    out = tuple((name, NOW - timedelta(seconds=a)) for name, a in zip(names, ago, strict=True) if a is not None)
    rows = [r for r in TWO_EACH if r[2] != "d"]
    running = replicated(rows=rows, fenced_out=out)
    spares = tuple(node(name, silent=0.1, flops=1e9 + i) for i, name in enumerate(names))
    hosts = tuple(node(n) for n in "abcef")
    barred = {name for name, a in zip(names, ago, strict=True) if a is not None and a < running.fenced_out_seconds}
    actions = plan(Desired(jobs=(running,)), Observed(nodes=(*hosts, *spares), stages=ready(running)), NOW)
    without = plan(Desired(jobs=(replace(running, fenced_out=()),)),
                   Observed(nodes=(*hosts, *(n for n in spares if n.id not in barred)), stages=ready(running)), NOW)
    assert actions == without
    grown = {s.node_id for a in actions if isinstance(a, AddReplicas) for s in a.stages}
    assert not grown & barred and (grown or len(barred) == len(names))
