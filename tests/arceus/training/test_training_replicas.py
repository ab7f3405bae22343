"""The driver's book of replicated stages (arceus/training/replicas.py): routes follow the replicas' measured
speeds step by step, and what RunStep tells a replica names its siblings and neighbours only."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from arceus.swarm.routing import Routes
from arceus.training.plan import StageEndpoint
from arceus.training.replicas import ReplicaRoster
from arceus.wire.tls import new_identity

CERTIFICATE = new_identity().certificate


def roster(replicas: list[int]) -> ReplicaRoster:
    return ReplicaRoster(
        [
            StageEndpoint(index=i, address=f"10.0.0.{i}:{7000 + r}", node_id=f"n{i}-{r}", layer_start=i,
                          layer_end=i + 1, certificate=CERTIFICATE, replica=r)
            for i, count in enumerate(replicas)
            for r in range(count)
        ],
        len(replicas),
        credential="d" * 64,
    )


def test_a_new_job_shares_micro_batches_evenly_and_a_measured_slow_replica_sheds_them() -> None:
    book = roster([2, 1, 3])
    assert book.members() == [(0, 1), (0,), (0, 1, 2)]
    first = book.routes(12)
    assert [len(first.micro_batches_of(2, k)) for k in (0, 1, 2)] == [4, 4, 4]
    # Stage 2's replica 1 ran its 4 micro-batches of 8 samples 3 times slower than its siblings.
    book.measured([((2, 0), 32, 1.0), ((2, 1), 32, 3.0), ((2, 2), 32, 1.0), ((0, 0), 48, 1.0), ((0, 1), 48, 1.0)])
    later = book.routes(12)
    shares = [len(later.micro_batches_of(2, k)) for k in (0, 1, 2)]
    assert shares[1] < 4 < shares[0] and shares[0] == shares[2] and sum(shares) == 12
    assert [len(later.micro_batches_of(0, k)) for k in (0, 1)] == [6, 6]
    # A replica measured nothing this step (no samples, or no time) keeps its speed.
    speeds = dict(book.speeds)
    book.measured([((2, 1), 0, 1.0), ((2, 0), 8, 0.0)])
    assert book.speeds == speeds


def test_a_driver_that_takes_over_routes_its_first_step_by_the_speeds_measured_before() -> None:
    """The replicas' speeds an earlier driver of the job measured come with their endpoints: a new driver's first step
    already sheds micro-batches from the slow one; a replica never measured (or with no usable figure) is routed at
    its stage's median, as a newcomer."""
    speeds = {(2, 0): 30.0, (2, 1): 10.0, (2, 2): 30.0, (0, 0): float("nan")}
    endpoints = [replace(e, samples_per_second=speeds.get(key)) for key, e in roster([2, 1, 3]).endpoints.items()]
    book = ReplicaRoster(endpoints, 3, credential="d" * 64)
    assert book.speeds == {(2, 0): 30.0, (2, 1): 10.0, (2, 2): 30.0}
    first = book.routes(12)
    assert [len(first.micro_batches_of(2, k)) for k in (0, 1, 2)] == [5, 2, 5]
    assert [len(first.micro_batches_of(0, k)) for k in (0, 1)] == [6, 6]


def test_runstep_names_the_routes_the_epoch_and_the_replicas_of_the_stage_and_its_neighbours() -> None:
    book = roster([2, 1, 3])
    routes = book.routes(4)
    step = book.replica_step(0, routes)
    assert Routes.from_json(json.loads(step.routes_json)) == routes and step.epoch == 0
    assert [(p.stage_index, p.replica) for p in step.peers] == [(0, 0), (0, 1), (1, 0)]
    assert all(p.certificate == CERTIFICATE for p in step.peers)
    assert [(p.stage_index, p.replica) for p in book.replica_step(2, routes).peers] == [(1, 0), (2, 0), (2, 1), (2, 2)]


def test_a_lost_replica_leaves_the_routes_under_a_new_epoch_and_a_stage_losing_every_replica_is_an_error() -> None:
    book = roster([2, 1, 3])
    book.measured([((2, 1), 8, 1.0)])
    book.remove([(2, 1)])
    assert book.members() == [(0, 1), (0,), (0, 2)] and book.epoch == 1 and (2, 1) not in book.speeds
    assert all(route[2] in (0, 2) for route in book.routes(4).of)
    with pytest.raises(ValueError, match=r"stage 1 lost every replica \(\[0\]\)"):
        book.remove([(1, 0), (2, 0)])
    assert book.members() == [(0, 1), (0,), (0, 2)] and book.epoch == 1  # nothing removed


def test_a_live_replica_blamed_for_a_failure_is_the_newest_and_may_join_again_after_a_growing_wait() -> None:
    book = roster([2, 2, 1])
    joiner = replace(book.endpoints[(1, 0)], replica=5, node_id="n1-5")
    book.add(joiner, most=4)
    assert book.epoch == 1 and book.newest([0, 1, 2]) == (1, 5)  # the one that joined last
    assert book.newest([0]) == (0, 1) and book.newest([2]) is None  # placed together: the highest id; alone: none
    with pytest.raises(ValueError, match="stage 1 replica 5 is a member already"):
        book.add(joiner, most=4)
    book.renew()
    assert book.epoch == 2 and book.members() == [(0, 1), (0, 1, 5), (0,)]
    assert book.fence((1, 5), train_step=6) == 7  # the step it may join again at
    assert book.members() == [(0, 1), (0, 1), (0,)] and book.epoch == 3 and book.fenced() == [joiner]
    assert not book.may_join((1, 5), 6) and not book.may_join((1, 5), 0) and book.may_join((1, 5), 7)
    book.add(joiner, most=4)
    assert not book.may_join((1, 5), 20) and book.fenced() == []  # a member
    assert book.fence((1, 5), train_step=9) == 11  # fenced again: it waits twice as long
    assert not book.may_join((1, 5), 10) and book.may_join((1, 5), 11)
    book.fence((0, 1), train_step=9)  # one placed with the roster may be fenced, and join again, too
    assert [(e.index, e.replica) for e in book.fenced()] == [(1, 5), (0, 1)] and book.may_join((0, 1), 10)
    book.remove([(1, 1)])  # lost (its agent did not answer): never again
    assert not book.may_join((1, 1), 100)
