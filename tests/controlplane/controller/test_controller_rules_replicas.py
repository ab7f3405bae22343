"""plan() for replicated stages (arceus/swarm): placing `replicas_min` per stage on distinct nodes, dropping a lost
replica without a rewind while its stage keeps another, rewinding only a stage that lost them all, and growing a
running job up to `replicas_max` where a replica is worth it."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.placement.solver import MAX_CANDIDATES, Workload
from controlplane.controller.actions import (
    AddReplicas,
    DropReplicas,
    MarkNodeUnknown,
    PlaceJob,
    RewindJob,
    SetCondition,
    StartDriver,
)
from controlplane.controller.rules import plan
from controlplane.controller.views import Desired, JobView, Observed, PlacedStage, StageReport
from tests.controlplane.controller.test_controller_rules import NOW, job, node, seen

FOUR = Workload(micro_batch_size=1, micro_batches=4)


def replicated(status: str = "running", *, rows: list[tuple[int, int, str]], **fields: object) -> JobView:
    """A job of three one-layer stages whose rows are (index, replica, node)."""
    stages = tuple(PlacedStage(i, i, i + 1, n, 2, replica=r) for i, r, n in rows)
    defaults: dict = {
        "generation": 2, "replicas_min": 2, "replicas_max": 2, "workload": FOUR, "stages": stages,
        "next_replica": 1 + max(r for _, r, _ in rows), "driver_lease_expires_at": NOW + timedelta(seconds=5),
    }
    return job(status=status, **{**defaults, **fields})


TWO_EACH = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (1, 1, "d"), (2, 0, "e"), (2, 1, "f")]


def ready(view: JobView) -> dict:
    return {(view.id, *s.key): StageReport(view.generation, "ready") for s in view.stages}


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.integers(1, 4),
    memories=st.lists(st.sampled_from([500, 10**6]), min_size=3, max_size=18),
)
def test_placement_puts_min_replicas_of_every_stage_on_distinct_fitting_nodes(
    replicas: int, memories: list[int]
) -> None:
    nodes = tuple(node(f"n{i}", flops=1e9 + i, memory=m) for i, m in enumerate(memories))
    queued = job(replicas_min=replicas, replicas_max=4, workload=FOUR)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes=nodes), NOW)
    if isinstance(action, SetCondition):  # it waits, saying so, and places nothing
        assert action.conditions[0]["status"] == "False"
        # With enough large nodes it always places, as long as the two stages of a large layer find large nodes
        # among the fastest few the solver searches (MAX_CANDIDATES; node i is the i-th slowest).
        assert memories.count(10**6) < 3 * replicas or memories[-MAX_CANDIDATES:].count(10**6) < 2
        return
    assert isinstance(action, PlaceJob)
    assert len({s.node_id for s in action.stages}) == len(action.stages) == 3 * replicas
    for index in range(3):
        assert sorted(s.replica for s in action.stages if s.index == index) == list(range(replicas))
    memory = {n.id: n.memory_bytes for n in nodes}
    # stages 0 and 1 hold 62 parameters each (992 bytes to train): a 500-byte node takes only stage 2
    assert all(memory[s.node_id] == 10**6 for s in action.stages if s.index < 2)


def test_too_few_nodes_for_min_replicas_waits_with_a_condition() -> None:
    queued = job(replicas_min=2, replicas_max=2, workload=FOUR)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes=tuple(node(n) for n in "abcde")), NOW)
    assert isinstance(action, SetCondition)
    assert action.conditions[0]["message"] == "needs 6 Ready nodes, 5 available"


def test_a_lost_replica_is_dropped_without_a_rewind_while_its_stage_keeps_another() -> None:
    running = replicated(rows=TWO_EACH)
    nodes = [node(n) for n in "abcef"] + [node("d", silent=60.0), node("spare")]
    mark, action = plan(Desired(jobs=(running,)), Observed(nodes=tuple(nodes), stages=ready(running)), NOW)
    assert isinstance(mark, MarkNodeUnknown) and isinstance(action, DropReplicas)
    assert action.replicas == ((1, 1),) and action.generation == running.generation
    assert f"stage 1 replica 1 on {seen('d')} left: its node was lost" in action.conditions[0]["message"]
    # once dropped, the stage is below its min: a new replica (a fresh id) goes to the spare, still no rewind
    dropped = replace(running, stages=tuple(s for s in running.stages if s.key != (1, 0, 1)))
    live = tuple(n for n in nodes if n.id != "d")  # its lease gone too: nothing left to mark
    [grow] = plan(Desired(jobs=(dropped,)), Observed(nodes=live, stages=ready(dropped)), NOW)
    assert isinstance(grow, AddReplicas) and (grow.generation, grow.next_replica) == (2, 2)
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, "spare")]


def test_a_restarted_or_failed_replica_is_dropped_too() -> None:
    running = replicated(rows=TWO_EACH)
    restarted = replace(running, stages=tuple(
        replace(s, restarted_generation=2) if s.key == (0, 0, 0) else s for s in running.stages
    ))
    nodes = tuple(node(n) for n in "abcdef")
    [action] = plan(Desired(jobs=(restarted,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    assert isinstance(action, DropReplicas) and action.replicas == ((0, 0),)
    failed = {**ready(running), (running.id, 2, 0, 1): StageReport(2, "failed", "out of memory")}
    [action] = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=failed), NOW)
    assert isinstance(action, DropReplicas) and action.replicas == ((2, 1),)


def test_a_stage_that_lost_every_replica_keeps_one_row_which_a_rewind_moves() -> None:
    running = replicated(rows=TWO_EACH)
    nodes = [node(n) for n in "abef"] + [node("c", silent=60.0), node("d", silent=60.0), node("spare")]
    *_, drop = plan(Desired(jobs=(running,)), Observed(nodes=tuple(nodes), stages=ready(running)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 1),)
    left = replace(running, stages=tuple(s for s in running.stages if s.key != (1, 0, 1)))
    live = tuple(n for n in nodes if n.id not in "cd")
    [rewind] = plan(Desired(jobs=(left,)), Observed(nodes=live, stages=ready(left)), NOW)
    assert isinstance(rewind, RewindJob) and rewind.moves == ((1, 0, 0, "spare"),)


# Stage 1 replica 1 was on node "d" and was dropped: the job's tolerance for a silent node (2 s) ran out before the
# node's lease (6 s), so "d" still looks Ready and free.
DROPPED = [r for r in TWO_EACH if r[2] != "d"]


def test_a_node_a_replica_was_dropped_from_takes_none_of_the_jobs_stages_until_it_heartbeats_again() -> None:
    dropped_at = NOW - timedelta(seconds=0.5)
    running = replicated(rows=DROPPED, node_grace_seconds=2.0, released=(("d", dropped_at),))
    # the fastest free node, silent since before the drop (yet within the job's 2 s tolerance: only the drop rules it
    # out)
    dead = node("d", silent=1.0, flops=4e9)
    nodes = (*(node(n) for n in "abcef"), dead, node("spare"))
    [grow] = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    assert isinstance(grow, AddReplicas) and (grow.generation, grow.next_replica) == (2, 2)
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, "spare")]
    # with no other node, nothing is added rather than a replica bound to fail
    alone = tuple(n for n in nodes if n.id != "spare")
    assert plan(Desired(jobs=(running,)), Observed(nodes=alone, stages=ready(running)), NOW) == []
    # a heartbeat after the drop (its agent alive, or a new one registered) makes it a candidate again
    heard = (*alone, node("d", silent=0.2, flops=4e9), node("spare"))
    [grow] = plan(Desired(jobs=(running,)), Observed(nodes=heard, stages=ready(running)), NOW)
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, "d")]
    # another job's dropped replica says nothing about this one's
    other = replace(running, released=(("x", dropped_at),))
    [grow] = plan(Desired(jobs=(other,)), Observed(nodes=nodes, stages=ready(other)), NOW)
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, "d")]


def test_a_stage_that_lost_its_last_replica_is_not_moved_onto_the_node_its_other_left() -> None:
    running = replicated(rows=DROPPED, node_grace_seconds=2.0, released=(("d", NOW - timedelta(seconds=0.5)),))
    nodes = (*(node(n) for n in "abef"), node("c", silent=3.0), node("d", silent=3.0, flops=4e9), node("spare"))
    [rewind] = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    assert isinstance(rewind, RewindJob) and rewind.moves == ((1, 0, 0, "spare"),)


def test_a_joiner_left_alone_in_its_stage_is_rebuilt_from_the_checkpoint_where_it_is() -> None:
    """Stage 1 lost replica 1, and replica 2 joined on the spare; then replica 0 is lost too, before the joiner
    copied its state: the stage holds its state nowhere. The joiner stays, the lost replica goes, and the job rewinds
    with the joiner in place (not as a restart: no driver had to give up first)."""
    joining = replace(replicated(rows=[*DROPPED, (1, 2, "spare")], node_grace_seconds=2.0), stages=tuple(
        replace(PlacedStage(i, i, i + 1, n, 2, replica=r), joining=r == 2) for i, r, n in [*DROPPED, (1, 2, "spare")]))
    nodes = (*(node(n) for n in "abef"), node("c", silent=3.0), node("spare"))
    [drop] = plan(Desired(jobs=(joining,)), Observed(nodes=nodes, stages=ready(joining)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 0),)
    # of two joiners, the lower stays: the rewind intends one row for the stage
    third = replace(PlacedStage(1, 1, 2, "x", 2, replica=3), joining=True)
    two = replace(joining, stages=(*joining.stages, third), next_replica=4)
    [drop] = plan(Desired(jobs=(two,)), Observed(nodes=(*nodes, node("x")), stages=ready(two)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 0), (1, 3))
    assert f"replica 3 on {seen('x')} left: its stage lost every replica" in drop.conditions[0]["message"]
    alone = replace(joining, stages=tuple(s for s in joining.stages if s.key != (1, 0, 0)))
    [rewind] = plan(Desired(jobs=(alone,)), Observed(nodes=nodes, stages=ready(alone)), NOW)
    assert isinstance(rewind, RewindJob) and (rewind.moves, rewind.count_restart) == ((), False)
    assert (rewind.status, rewind.reason) == ("placing", "ReplicasLost")
    # once it copied a live replica's state, it is a replica like any other: a lost sibling is dropped, no rewind
    copied = replace(joining, stages=tuple(replace(s, joining=False) for s in joining.stages))
    [drop] = plan(Desired(jobs=(copied,)), Observed(nodes=nodes, stages=ready(copied)), NOW)
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 0),)
    kept = replace(copied, stages=tuple(s for s in copied.stages if s.key != (1, 0, 0)))
    assert plan(Desired(jobs=(kept,)), Observed(nodes=nodes, stages=ready(kept)), NOW) == []


def test_a_node_whose_exchange_did_not_answer_hosts_no_replica_but_may_host_an_unreplicated_stage() -> None:
    closed = replace(node("closed", flops=4e9), exchange_reachable=False)  # the fastest node
    nodes = (closed, *(node(f"n{i}") for i in range(6)))
    [placed] = plan(Desired(jobs=(job(replicas_min=2, replicas_max=2, workload=FOUR),)), Observed(nodes=nodes), NOW)
    assert isinstance(placed, PlaceJob) and "closed" not in {s.node_id for s in placed.stages}
    [single] = plan(Desired(jobs=(job(),)), Observed(nodes=nodes), NOW)
    assert isinstance(single, PlaceJob) and "closed" in {s.node_id for s in single.stages}
    [waits] = plan(Desired(jobs=(job(replicas_min=2, replicas_max=2, workload=FOUR),)), Observed(nodes=nodes[:6]),
                   NOW)
    assert isinstance(waits, SetCondition)
    assert waits.conditions[0]["message"] == "needs 6 Ready nodes whose replicas' exchange answers, 5 available"
    # nor grown onto it, though it is the fastest free node
    running = replicated(rows=DROPPED)
    hosts = (*(node(n) for n in "abcef"), closed)
    [grow] = plan(Desired(jobs=(running,)), Observed(nodes=(*hosts, node("spare")), stages=ready(running)), NOW)
    assert isinstance(grow, AddReplicas) and [s.node_id for s in grow.stages] == ["spare"]
    assert plan(Desired(jobs=(running,)), Observed(nodes=hosts, stages=ready(running)), NOW) == []


# Agents heartbeat every second (as tests/e2e's clusters); the job's tolerance of a silent node is 2 s, within the 6 s
# node lease, and its driver's lease runs 10 s past each renewal.
HEARTBEAT, GRACE, DRIVER_LEASE = 1.0, 2.0, 10.0


@settings(max_examples=120, deadline=None)
@given(
    index=st.integers(0, 2),
    heard=st.tuples(st.floats(0.0, HEARTBEAT, exclude_max=True), st.floats(0.0, HEARTBEAT, exclude_max=True)),
    every=st.sampled_from([0.25, 0.5, 1.0]),
    phase=st.floats(0.0, 1.0, exclude_max=True),
    gives_up=st.booleans(),
)
def test_a_stage_that_loses_every_replica_ends_with_one_row_on_the_spare_whichever_passes_find_them_gone(
    index: int, heard: tuple[float, float], every: float, phase: float, gives_up: bool
) -> None:
    """Both replicas of one stage die at once (SIGKILL); each agent's last heartbeat came a while before, so the
    passes (every `every` s) may find them gone in one pass or in two, with others between. The driver gives up at
    its next step (it lets its lease go: the job rewinds in place, a restart, before the losses are found), or it is
    stuck where it does not notice (between steps) and its lease runs out. Pass after pass, each action applied as the
    executor does: no replica is ever placed on a dead node (the job could end meanwhile with that row in its
    placement), and once it settles the stage has one row, on the spare, rebuilt from the checkpoint, the others
    untouched, and the only restart counted is the driver's that gave up (a stuck one's lease never runs out: the
    rules rewind first)."""
    running = replicated(rows=TWO_EACH, node_grace_seconds=GRACE, driver_claimed=True)
    victims = [s.node_id for s in running.stages if s.index == index]
    last_heard = dict(zip(victims, heard, strict=True))  # seconds before the kill at 0
    unknown: set[str] = set()
    names = [*"abcdef", "spare"]
    view, t = running, phase
    while t < 30.0:
        now = NOW + timedelta(seconds=t)
        nodes = tuple(replace(
            node(n), ready_status="Unknown" if n in unknown else "True",
            lease_renewed_at=NOW - timedelta(seconds=last_heard[n]) if n in last_heard
            else now - timedelta(seconds=t % HEARTBEAT),
        ) for n in names)
        view = _driver_step(view, set(victims), now, gives_up)
        reports = {(view.id, *s.key): StageReport(view.generation, "ready") for s in view.stages
                   if s.node_id not in victims}
        for action in plan(Desired(jobs=(view,)), Observed(nodes=nodes, stages=reports), now):
            targets = {s.node_id for s in action.stages} if isinstance(action, AddReplicas) else (
                {n for *_, n in action.moves} if isinstance(action, RewindJob) else set())
            assert not targets & set(victims), (t, action)
            if isinstance(action, MarkNodeUnknown):
                unknown.add(action.node_id)
            else:
                view = _applied(view, action, now)
        t += every
    assert view.status == "running" and view.generation > running.generation and view.restarts == int(gives_up)
    assert [(s.node_id, s.joining) for s in view.stages if s.index == index] == [("spare", False)]
    assert {s.key: s.node_id for s in view.stages if s.index != index} == {
        s.key: s.node_id for s in running.stages if s.index != index}


def _driver_step(view: JobView, dead: set[str], now: datetime, gives_up: bool) -> JobView:
    """What the job's driver does between two passes: a joiner copies its stage's state from a live replica that
    holds it; the driver renews its lease while every stage has one, else it lets the lease go (`gives_up`, as
    arceus.training.driver does at a step that finds a stage without replicas) or, stuck, lets it run out."""
    if view.status != "running" or view.driver_lease_expires_at is None:
        return view
    holders = {s.index for s in view.stages if not s.joining and s.node_id not in dead}
    stages = tuple(replace(s, joining=s.joining and s.index not in holders) for s in view.stages)
    lease = now + timedelta(seconds=DRIVER_LEASE) if len(holders) == 3 else (
        None if gives_up else view.driver_lease_expires_at)
    return replace(view, stages=stages, driver_lease_expires_at=lease)


def _applied(view: JobView, action: object, now: datetime) -> JobView:
    """`view` as the executor leaves it after `action` (controlplane/controller/transitions.py), its driver claiming
    the lease at once when started."""
    if isinstance(action, DropReplicas):
        dropped = [s for s in view.stages if (s.index, s.replica) in action.replicas]
        return replace(view, stages=tuple(s for s in view.stages if s not in dropped), conditions=action.conditions,
                       released=(*view.released, *((s.node_id, now) for s in dropped)))
    if isinstance(action, AddReplicas):
        added = tuple(PlacedStage(s.index, s.layer_start, s.layer_end, s.node_id, view.generation,
                                  replica=s.replica, joining=True) for s in action.stages)
        return replace(view, stages=(*view.stages, *added), next_replica=view.next_replica + len(added),
                       conditions=action.conditions)
    if isinstance(action, RewindJob):
        moves = {(i, r, p): n for i, r, p, n in action.moves}
        generation = view.generation + 1
        stages = tuple(replace(s, node_id=moves.get(s.key, s.node_id), generation=generation, joining=False)
                       for s in view.stages)
        return replace(view, status=action.status, generation=generation, stages=stages,
                       restarts=view.restarts + action.count_restart, driver_lease_expires_at=None,
                       driver_claimed=False)
    if isinstance(action, StartDriver):
        return replace(view, status="running", conditions=action.conditions, driver_claimed=True,
                       driver_lease_expires_at=now + timedelta(seconds=DRIVER_LEASE))
    assert isinstance(action, SetCondition), action
    return replace(view, conditions=action.conditions)


# A free node: seconds since its last heartbeat (within its 6 s lease: Ready), seconds since a replica of the job was
# dropped from it (None: never), FLOP/s.
FREED = st.tuples(st.sampled_from([0.1, 1.0, 3.0, 5.0]), st.sampled_from([None, 0.5, 2.0, 4.0]),
                  st.sampled_from([5e8, 1e9, 4e9]))


@settings(max_examples=80, deadline=None)
@given(free=st.lists(FREED, min_size=1, max_size=5), lost=st.booleans(), memory=st.sampled_from([500, 10**6]))
def test_a_node_not_heard_from_since_a_replica_left_it_is_to_the_job_as_if_absent(
    free: list[tuple[float, float | None, float]], lost: bool, memory: int
) -> None:
    """Whether the job grows its stage or moves it (its last replica lost too), whatever else is free: the plan is the
    one made without the nodes not heard from since a replica of the job was dropped from them, and a drop its node
    heartbeat after changes nothing."""
    names = [f"s{i}" for i in range(len(free))]
    released = tuple((name, NOW - timedelta(seconds=ago)) for name, (_, ago, _) in zip(names, free, strict=True)
                     if ago is not None)
    running = replicated(rows=DROPPED, node_grace_seconds=2.0, released=released)
    hosts = (*(node(n) for n in "abef"), node("c", silent=3.0 if lost else 1.0))
    spares = tuple(node(name, silent=silent, flops=flops, memory=memory)
                   for name, (silent, _, flops) in zip(names, free, strict=True))
    unheard = {n.id for n in spares for name, at in released if n.id == name and n.lease_renewed_at <= at}
    actions = plan(Desired(jobs=(running,)), Observed(nodes=(*hosts, *spares), stages=ready(running)), NOW)
    targets = {s.node_id for a in actions if isinstance(a, AddReplicas) for s in a.stages} | {
        node_id for a in actions if isinstance(a, RewindJob) for *_, node_id in a.moves}
    assert not targets & unheard
    without = plan(Desired(jobs=(replace(running, released=()),)),
                   Observed(nodes=(*hosts, *(n for n in spares if n.id not in unheard)), stages=ready(running)), NOW)
    assert actions == without


def test_a_running_job_grows_to_its_max_only_where_a_replica_is_worth_it() -> None:
    one_each = [(0, 0, "a"), (1, 0, "b"), (2, 0, "c")]
    running = replicated(rows=one_each, replicas_min=1, replicas_max=3)
    nodes = (node("a"), node("b"), node("c"), node("x", flops=2e9), node("y"))
    [grow] = plan(Desired(jobs=(running,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    assert isinstance(grow, AddReplicas) and grow.next_replica == 1
    # the fastest spare goes to stage 0; a replica of stage 1 would gain little while stage 0 is as slow
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(0, 1, "x")]
    grown = replace(running, next_replica=2, stages=(*running.stages, PlacedStage(0, 0, 1, "x", 2, replica=1)))
    [again] = plan(Desired(jobs=(grown,)), Observed(nodes=nodes, stages=ready(grown)), NOW)
    assert isinstance(again, AddReplicas) and [(s.index, s.replica, s.node_id) for s in again.stages] == [
        (1, 2, "y")
    ]
    # a job whose driver died rewinds first (its rows rebuild from the checkpoint anyway)
    dead = replace(running, driver_lease_expires_at=NOW - timedelta(seconds=1), driver_claimed=True)
    [rewind] = plan(Desired(jobs=(dead,)), Observed(nodes=nodes, stages=ready(dead)), NOW)
    assert isinstance(rewind, RewindJob) and rewind.reason == "DriverLost"
    # a spare far slower than the stage's replicas adds almost nothing: not worth its price
    slow = (node("a"), node("b"), node("c"), node("z", flops=1e5))
    assert plan(Desired(jobs=(running,)), Observed(nodes=slow, stages=ready(running)), NOW) == []
    # the job's price cap bounds it too
    priced = tuple(replace(n, price_per_hour=1.0) for n in nodes)
    capped = replace(running, requirements=replace(running.requirements, max_price_per_hour=3.5))
    assert plan(Desired(jobs=(capped,)), Observed(nodes=priced, stages=ready(running)), NOW) == []


SPARE = st.tuples(
    st.sampled_from([0.1, 0.5, 1.0, 2.0]),  # price per hour
    st.sampled_from([1e5, 5e8, 1e9, 4e9]),  # FLOP/s
    st.sampled_from([1e3, 1e6, 1e12]),  # bandwidth, bytes/s
)


@settings(max_examples=60, deadline=None)
@given(spares=st.lists(SPARE, min_size=1, max_size=6), cap=st.sampled_from([None, 1.5, 3.0]))
def test_a_stage_grows_on_the_cheapest_spare_worth_its_price_under_the_cap(
    spares: list[tuple[float, float, float]], cap: float | None
) -> None:
    # only stage 1 may grow (the others are at their max of 2); its hosts cost 0.2 an hour each
    rows = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (2, 0, "e"), (2, 1, "f")]
    running = replicated(rows=rows, replicas_min=1, replicas_max=2)
    running = replace(running, requirements=replace(running.requirements, max_price_per_hour=cap))
    hosts = tuple(replace(node(n), price_per_hour=0.2) for n in "abcef")
    offered = [replace(node(f"s{i}", flops=f), price_per_hour=p, bandwidth_bytes_per_s=b)
               for i, (p, f, b) in enumerate(spares)]

    def added(spare: list) -> list[str]:
        actions = plan(Desired(jobs=(running,)), Observed(nodes=(*hosts, *spare), stages=ready(running)), NOW)
        assert all(isinstance(a, AddReplicas) and [s.index for s in a.stages] == [1] for a in actions)
        return [s.node_id for a in actions for s in a.stages]

    # each spare on its own: is its replica worth its price (and within the cap)?
    worth = [n for n in offered if added([n]) == [n.id]]
    chosen = added(offered)
    if not worth:
        assert chosen == []
        return
    [node_id] = chosen
    price = next(n.price_per_hour for n in offered if n.id == node_id)
    assert node_id in {n.id for n in worth} and price == min(n.price_per_hour for n in worth)
    assert cap is None or 5 * 0.2 + price <= cap


def test_a_stage_never_grows_past_its_max_or_the_micro_batches() -> None:
    full = replicated(rows=TWO_EACH, replicas_min=1, replicas_max=2)
    nodes = tuple(node(n) for n in "abcdefxyz")
    assert plan(Desired(jobs=(full,)), Observed(nodes=nodes, stages=ready(full)), NOW) == []
    two_micro_batches = replace(full, replicas_max=4, workload=Workload(micro_batch_size=2, micro_batches=2))
    assert plan(Desired(jobs=(two_micro_batches,)), Observed(nodes=nodes, stages=ready(full)), NOW) == []


def test_a_placing_replicated_job_starts_its_driver_once_every_replica_is_ready() -> None:
    placing = replicated("placing", rows=TWO_EACH, driver_lease_expires_at=None)
    nodes = tuple(node(n) for n in "abcdefxy")
    [start] = plan(Desired(jobs=(placing,)), Observed(nodes=nodes, stages=ready(placing)), NOW)
    assert isinstance(start, StartDriver)


@settings(max_examples=80, deadline=None)
@given(
    prices=st.lists(st.sampled_from([0.1, 0.3, 1.0, 3.0]), min_size=6, max_size=12),
    cap=st.sampled_from([0.6, 1.2, 2.5, 6.0, None]),
    replicas=st.integers(2, 3),
)
def test_min_replicas_are_placed_within_the_jobs_price_cap(
    prices: list[float], cap: float | None, replicas: int
) -> None:
    # Node i is faster the dearer it is (flops grow with the price): the fastest are the dearest.
    nodes = tuple(replace(node(f"n{i}", flops=1e9 * (1 + p) + i), price_per_hour=p) for i, p in enumerate(prices))
    price = {n.id: n.price_per_hour for n in nodes}
    needs = replace(job().requirements, max_price_per_hour=cap, owner_diversity=False)
    queued = job(replicas_min=replicas, replicas_max=replicas, workload=FOUR, requirements=needs)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes=nodes), NOW)
    if isinstance(action, SetCondition):  # it waits, saying why: too few nodes, or the cap
        message = action.conditions[0]["message"]
        assert len(prices) < 3 * replicas or (cap is not None and ("price cap" in message or "budget" in message))
        return
    assert isinstance(action, PlaceJob) and len(action.stages) == 3 * replicas
    assert cap is None or sum(price[s.node_id] for s in action.stages) <= cap + 1e-9
    # It never waits where the cheapest nodes fit the cap with a copy of the pipeline in each share of it.


def test_a_capped_job_takes_the_fastest_replicas_its_cap_affords() -> None:
    # Three stages, two replicas each, a cap of $2/hour: three fast nodes cost $1 each, five slow ones $0.1. One
    # copy of the pipeline is placed within its share of the cap ($1: three slow nodes), the replicas on the
    # fastest nodes the rest affords while the cheapest could still fill the others: one fast node, two slow.
    fast = tuple(replace(node(f"fast{i}", flops=4e9), price_per_hour=1.0) for i in range(3))
    slow = tuple(replace(node(f"slow{i}", flops=1e9), price_per_hour=0.1) for i in range(5))
    needs = replace(job().requirements, max_price_per_hour=2.0, owner_diversity=False)
    queued = job(replicas_min=2, replicas_max=2, workload=FOUR, requirements=needs)
    [action] = plan(Desired(jobs=(queued,)), Observed(nodes=fast + slow), NOW)
    assert isinstance(action, PlaceJob)
    spent = sum(1.0 if s.node_id.startswith("fast") else 0.1 for s in action.stages)
    assert spent == pytest.approx(1.5) and sum(s.node_id.startswith("fast") for s in action.stages) == 1
    # Without a cap, every fast node is used.
    free = job(replicas_min=2, replicas_max=2, workload=FOUR,
               requirements=replace(needs, max_price_per_hour=None))
    [action] = plan(Desired(jobs=(free,)), Observed(nodes=fast + slow), NOW)
    assert {f"fast{i}" for i in range(3)} <= {s.node_id for s in action.stages}
    # A cap the cheapest six cannot meet: it waits, saying so.
    poor = job(replicas_min=2, replicas_max=2, workload=FOUR, requirements=replace(needs, max_price_per_hour=0.5))
    [action] = plan(Desired(jobs=(poor,)), Observed(nodes=fast + slow), NOW)
    assert isinstance(action, SetCondition)
    assert action.conditions[0]["message"] == (
        "every placement that fits costs more than the budget of $0.2500/hour (the cheapest is $0.3000/hour); raise "
        "the budget or wait for cheaper devices (the budget of one copy of the pipeline: its share of the job's "
        "$0.5000/hour cap over 2 replicas of each stage)"
    )
    # A cap whose share places one copy, but that leaves too little for the replicas: it waits, saying so.
    tight = job(replicas_min=2, replicas_max=2, workload=FOUR, requirements=replace(needs, max_price_per_hour=0.62))
    nodes = (*fast, *slow[:3], *(replace(node(f"dear{i}", flops=1e9), price_per_hour=0.5) for i in range(3)))
    [action] = plan(Desired(jobs=(tight,)), Observed(nodes=nodes), NOW)
    assert isinstance(action, SetCondition)
    assert "within the price cap of $0.6200/hour" in action.conditions[0]["message"]


def test_a_replica_below_the_min_is_added_only_within_the_price_cap() -> None:
    # Stage 1 lost its second replica; the only spare would take the job past its cap of $3.5/hour.
    rows = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (2, 0, "e"), (2, 1, "f")]
    running = replicated(rows=rows)
    nodes = tuple(replace(node(n), price_per_hour=0.6) for n in ["a", "b", "c", "e", "f", "spare"])
    capped = replace(running, requirements=replace(running.requirements, max_price_per_hour=3.5))
    assert plan(Desired(jobs=(capped,)), Observed(nodes=nodes, stages=ready(capped)), NOW) == []
    roomy = replace(running, requirements=replace(running.requirements, max_price_per_hour=3.6))
    [grow] = plan(Desired(jobs=(roomy,)), Observed(nodes=nodes, stages=ready(roomy)), NOW)
    assert isinstance(grow, AddReplicas) and [(s.index, s.node_id) for s in grow.stages] == [(1, "spare")]


def test_a_replica_on_a_distant_node_is_worth_it_only_where_the_replicas_sync_rarely() -> None:
    # One stage, 0.3 s a sample on each node, 4 one-sample micro-batches: a second replica halves the compute (1.2 s
    # to 0.6 s) but exchanges over 0.5 s links, 1 s a step: a loss every step, a gain when it happens every 16th.
    far = tuple(replace(node(n, flops=1e3), latency_s=0.5) for n in ("a", "spare"))
    running = replicated(rows=[(0, 0, "a")], replicas_min=1, replicas_max=2)
    running = replace(running, requirements=replace(running.requirements, owner_diversity=False))  # one stage
    assert plan(Desired(jobs=(running,)), Observed(nodes=far, stages=ready(running)), NOW) == []
    rarely = replace(running, replica_sync_every=16)
    [grow] = plan(Desired(jobs=(rarely,)), Observed(nodes=far, stages=ready(rarely)), NOW)
    assert isinstance(grow, AddReplicas) and [(s.index, s.node_id) for s in grow.stages] == [(0, "spare")]


# A move names the replica it moves (index, rank, replica, node): the executor re-places that row alone, so a sibling
# added since the snapshot (AddReplicas keeps the generation) is never carried along to the same node.
ONE_LEFT_OF_STAGE_1 = [(0, 0, "a"), (0, 1, "b"), (1, 1, "d"), (2, 0, "e"), (2, 1, "f")]  # its replica 0 dropped


def test_a_failed_build_moves_only_the_replica_that_failed() -> None:
    placing = replicated("placing", rows=ONE_LEFT_OF_STAGE_1)
    failed = {**ready(placing), (placing.id, 1, 0, 1): StageReport(2, "failed", "out of memory")}
    nodes = tuple(node(n) for n in "abdef") + (node("spare"),)
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes=nodes, stages=failed), NOW)
    assert isinstance(action, RewindJob) and action.reason == "StageFailed" and action.count_restart
    assert action.moves == ((1, 0, 1, "spare"),)


def test_a_lost_or_paused_node_moves_only_its_replica() -> None:
    running = replicated(rows=ONE_LEFT_OF_STAGE_1)
    nodes = [node(n) for n in "abef"] + [node("spare")]
    lost = (*nodes, node("d", silent=60.0))
    *_, action = plan(Desired(jobs=(running,)), Observed(nodes=lost, stages=ready(running)), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 1, "spare"),) and action.reason == "NodeLost"
    placing = replace(running, status="placing")
    paused = (*nodes, replace(node("d"), paused=True, pause_reason="paused by its owner"))
    [action] = plan(Desired(jobs=(placing,)), Observed(nodes=paused, stages=ready(placing)), NOW)
    assert isinstance(action, RewindJob) and action.moves == ((1, 0, 1, "spare"),) and action.reason == "NodeDrained"


def test_a_stage_whose_replicas_all_restarted_unplaces_only_the_one_on_a_paused_node() -> None:
    running = replicated(rows=TWO_EACH)
    restarted = replace(running, stages=tuple(
        replace(s, restarted_generation=2) if s.index == 1 else s for s in running.stages
    ))
    nodes = (*(node(n) for n in "abcef"), replace(node("d"), paused=True, pause_reason="paused by its owner"))
    [action] = plan(Desired(jobs=(restarted,)), Observed(nodes=nodes, stages=ready(running)), NOW)
    # every replica of stage 1 rebuilds from the checkpoint; only replica 1 leaves its (paused) node, replica 0 stays
    assert isinstance(action, RewindJob) and action.reason == "NodeRestarted"
    assert action.moves == ((1, 0, 1, None),)


def test_a_replica_that_brings_the_job_exactly_to_its_cap_is_added() -> None:
    # The hosts cost 0.1 + 0.2 an hour (0.30000000000000004 in floats) and the spare 0.3: exactly the cap of 0.6,
    # which the sum's last bit of rounding must not refuse (the solver's PRICE_ROUNDING); a cent more is refused.
    rows = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (2, 0, "e"), (2, 1, "f")]
    running = replicated(rows=rows, replicas_min=1, replicas_max=2)
    prices = {"a": 0.1, "b": 0.2, "c": 0.0, "e": 0.0, "f": 0.0}
    hosts = tuple(replace(node(n), price_per_hour=p) for n, p in prices.items())
    spare = replace(node("spare", flops=4e9), price_per_hour=0.3, bandwidth_bytes_per_s=1e12)
    for cap, grows in ((0.6, True), (0.59, False)):
        capped = replace(running, requirements=replace(running.requirements, max_price_per_hour=cap))
        actions = plan(Desired(jobs=(capped,)), Observed(nodes=(*hosts, spare), stages=ready(capped)), NOW)
        assert [(s.index, s.node_id) for a in actions for s in a.stages] == ([(1, "spare")] if grows else [])
