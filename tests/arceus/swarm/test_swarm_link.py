"""A link's timing rule (the shaper's and the swarm model's), without sockets."""

from __future__ import annotations

import pytest

from arceus.swarm.link import BURST_BYTES, LinkPlan

MBIT = 1e6


def test_a_lone_chunk_arrives_after_the_delay() -> None:
    plan = LinkPlan(delay_s=0.02, rate_bps=100 * MBIT)
    assert plan.arrival(5.0, 1000) == pytest.approx(5.02)


def test_a_backlog_drains_at_the_rate_then_arrives_after_the_delay() -> None:
    plan = LinkPlan(delay_s=0.02, rate_bps=100 * MBIT)
    arrivals = [plan.arrival(0.0, BURST_BYTES) for _ in range(100)]
    assert arrivals == sorted(arrivals)
    # The first chunk is the bucket's burst; each further one waits for its tokens.
    assert arrivals[-1] == pytest.approx(0.02 + 99 * BURST_BYTES * 8 / (100 * MBIT))


def test_an_idle_link_refills_its_bucket_and_no_more() -> None:
    plan = LinkPlan(delay_s=0.0, rate_bps=8 * MBIT, burst_bytes=4000)
    for _ in range(10):
        plan.arrival(0.0, 4000)  # 40 ms of backlog
    assert plan.arrival(0.01, 4000) == pytest.approx(0.04)  # still queued behind it
    assert plan.arrival(10.0, 4000) == pytest.approx(10.0)  # idle: a full bucket
    assert plan.arrival(10.0, 4000) == pytest.approx(10.004)  # but only one bucket's worth


@pytest.mark.parametrize("args", [(-0.1, 1e6), (0.0, 0.0)])
def test_nonsense_links_are_refused(args: tuple[float, float]) -> None:
    with pytest.raises(ValueError):
        LinkPlan(*args)
