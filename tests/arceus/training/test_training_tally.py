"""The driver bills what it can vouch for, whatever an agent's RunStep reply claims."""

from __future__ import annotations

import math

from arceus.training.tally import WorkTally
from arceus.v1 import stage_pb2


def reported(compute: float, sent: int = 0, received: int = 0, samples: int = 0) -> stage_pb2.StageCounters:
    return stage_pb2.StageCounters(
        samples=samples, micro_batches=samples, compute_seconds=compute, bytes_sent=sent, bytes_received=received
    )


def step(tally: WorkTally, counters: stage_pb2.StageCounters, *, wall: float = 2.0, node: str = "n"):  # noqa: ANN201
    return tally.record(index=1, node_id=node, samples=32, micro_batches=4, wall_seconds=wall, max_bytes=10_000,
                        reported=counters)


def test_an_honest_agent_is_counted_as_it_reports_and_samples_as_the_driver_sent_them() -> None:
    tally = WorkTally()
    step(tally, reported(1.5, sent=4000, received=3000, samples=999))
    counted = step(tally, reported(2.5, sent=8000, received=6000, samples=999))
    assert (counted.index, counted.node_id, counted.samples, counted.micro_batches) == (1, "n", 64, 8)
    assert counted.compute_seconds == 2.5 and (counted.bytes_sent, counted.bytes_received) == (8000, 6000)


def test_claims_beyond_what_the_driver_saw_are_cut_to_it() -> None:
    tally = WorkTally()
    first = step(tally, reported(1e9, sent=10**15, received=10**15), wall=1.25)
    assert first.compute_seconds == 1.25  # no more than the call took
    assert (first.bytes_sent, first.bytes_received) == (10_000, 10_000)  # no more than the messages carry
    assert step(tally, reported(1e9 + 1.0), wall=3.0).compute_seconds == 2.25  # the honest 1 s on top


def test_non_numbers_and_counters_running_backwards_add_nothing() -> None:
    tally = WorkTally()
    step(tally, reported(3.0, sent=500))
    for bad in (math.inf, -math.inf, math.nan, 1.0):
        counted = step(tally, reported(bad, sent=100))
        assert (counted.compute_seconds, counted.bytes_sent) == (2.0, 500), bad  # the first step's, capped at 2 s
    assert step(tally, reported(4.0, sent=900)).compute_seconds == 3.0  # growth past the highest seen: 1 s


def test_each_agent_is_tallied_on_its_own() -> None:
    tally = WorkTally()
    step(tally, reported(1.0), node="a")
    assert step(tally, reported(0.5), node="b").compute_seconds == 0.5
    assert step(tally, reported(1.5), node="a").compute_seconds == 1.5
