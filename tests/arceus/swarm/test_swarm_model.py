"""The step-time model: the pipeline's known closed forms, the link rule, the exchange's cost, and more
replicas never slower where the exchange is free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from arceus.swarm.link import BURST_BYTES
from arceus.swarm.model import (
    Link,
    Replica,
    SharedHost,
    Workload,
    cpu_seconds_per_step,
    mean_step_seconds,
    replica_gain,
    samples_per_second,
    shared_host_samples_per_second,
    shared_host_step_seconds,
    step_time,
)

FREE = Link(latency_s=0.0, bandwidth_bps=1e18)
schedules = st.sampled_from(["gpipe", "1f1b"])


def workload(
    stages: int, m: int, batch: int, schedule: str = "1f1b", boundary: float = 0.0, gradient: float = 0.0
) -> Workload:
    return Workload(m, batch, (boundary,) * (stages - 1), (gradient,) * stages, schedule)


@given(n=st.integers(1, 6), m=st.integers(1, 12), per=st.integers(1, 4), schedule=schedules)
def test_one_replica_per_stage_takes_the_textbook_time(n: int, m: int, per: int, schedule: str) -> None:
    """Equal stages, free links: (M + S - 1) micro-batch times, for GPipe and 1F1B alike."""
    c = 0.01
    t = step_time([[Replica(c, FREE)]] * n, workload(n, m, m * per, schedule))
    assert t.seconds == pytest.approx((m + n - 1) * c * per)
    assert t.exchange_seconds == (0.0,) * n and t.micro_batches == ((m,),) * n


def test_a_boundary_costs_the_shapers_rule_each_way() -> None:
    """Two stages, one micro-batch: F0, the activation over stage 0's uplink, F1 B1, the gradient over
    stage 1's uplink, B0; a message leaves at the link's rate less one burst, and arrives a latency later."""
    link = Link(latency_s=0.02, bandwidth_bps=8e6)
    nbytes = 100_000
    transfer = nbytes * 8 / 8e6 - BURST_BYTES * 8 / 8e6 + 0.02
    t = step_time([[Replica(0.3, link)], [Replica(0.6, link)]], Workload(1, 1, (nbytes,), (0.0, 0.0)))
    assert t.seconds == pytest.approx(0.3 + transfer + 0.6 + transfer)


@given(r=st.integers(2, 8), gradient=st.floats(1e5, 1e9))
def test_the_exchange_costs_two_phases_of_r_minus_one_chunks(r: int, gradient: float) -> None:
    link = Link(latency_s=0.05, bandwidth_bps=1e8)
    t = step_time([[Replica(1e-6, link)] * r], workload(1, r, r, gradient=gradient))
    per_phase = max(0.0, (r - 1) / r * gradient * 8 / 1e8 - BURST_BYTES * 8 / 1e8) + 0.05
    assert t.exchange_seconds[0] == pytest.approx(2 * per_phase)
    assert t.seconds == pytest.approx(t.pipeline_seconds + t.exchange_seconds[0])


@given(r=st.integers(2, 8), gradient=st.floats(1e6, 1e9))
def test_a_link_per_peer_carries_each_siblings_part_side_by_side(r: int, gradient: float) -> None:
    """Links per peer (each connection shaped apart, as the bench's shaper does): a phase sends 1/R of the
    gradient to each sibling at once, R - 1 times sooner than through one uplink."""
    link = Link(latency_s=0.05, bandwidth_bps=1e8, per_peer=True)
    t = step_time([[Replica(1e-6, link)] * r], workload(1, r, r, gradient=gradient))
    per_phase = max(0.0, gradient / r * 8 / 1e8 - BURST_BYTES * 8 / 1e8) + 0.05
    assert t.exchange_seconds[0] == pytest.approx(2 * per_phase)
    shared = step_time([[Replica(1e-6, replace(link, per_peer=False))] * r], workload(1, r, r, gradient=gradient))
    assert t.seconds <= shared.seconds


@settings(deadline=None)
@given(r=st.integers(2, 6), h=st.integers(1, 64), gradient=st.floats(1e5, 1e9))
def test_replicas_that_sync_every_h_steps_pay_the_exchange_once_in_h(r: int, h: int, gradient: float) -> None:
    """replica_sync every H steps: H - 1 steps end at their last backward, one pays the exchange too."""
    link = Link(latency_s=0.05, bandwidth_bps=1e8)
    stages = [[Replica(0.01, link)] * r] * 2
    every = Workload(r, 4 * r, (1000.0,), (gradient, gradient), "1f1b", sync_every=h)
    t = step_time(stages, every)
    assert mean_step_seconds(stages, every) == pytest.approx((t.seconds + (h - 1) * t.pipeline_seconds) / h)
    assert samples_per_second(stages, every) == pytest.approx(4 * r / mean_step_seconds(stages, every))
    if h > 1:
        assert samples_per_second(stages, every) > samples_per_second(stages, replace(every, sync_every=1))


@settings(deadline=None)  # each example replays up to a dozen steps
@given(gradient=st.floats(1e6, 1e9), latency=st.floats(0, 0.1))
def test_the_exchange_cost_grows_with_r(gradient: float, latency: float) -> None:
    link = Link(latency_s=latency, bandwidth_bps=1e8)
    costs = [step_time([[Replica(0.01, link)] * r], workload(1, 8, 64, gradient=gradient)).exchange_seconds[0]
             for r in range(1, 9)]
    assert costs[0] == 0.0
    assert all(a < b for a, b in zip(costs, costs[1:], strict=False))


@settings(deadline=None)  # each example replays up to a dozen steps
@given(n=st.integers(1, 4), m=st.integers(2, 12), per=st.integers(1, 3), schedule=schedules,
       latency=st.sampled_from([0.0, 0.005]), boundary=st.sampled_from([0.0, 1e4]), data=st.data())
def test_more_replicas_everywhere_are_never_slower_when_the_exchange_is_free(
    n: int, m: int, per: int, schedule: str, latency: float, boundary: float, data: st.DataObject
) -> None:
    link = Link(latency, 1e8)
    speeds = data.draw(st.lists(st.sampled_from([0.01, 0.02, 0.05]), min_size=n, max_size=n))
    w = workload(n, m, m * per, schedule, boundary)
    rates = [samples_per_second([[Replica(c, link)] * r for c in speeds], w) for r in range(1, m + 1)]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(rates, rates[1:], strict=False)), rates


@settings(deadline=None)  # each example replays up to a dozen steps
@given(n=st.integers(1, 4), m=st.integers(2, 12), per=st.integers(1, 3), latency=st.sampled_from([0.0, 0.005]),
       boundary=st.sampled_from([0.0, 1e4]), data=st.data())
def test_gpipe_gains_from_one_more_equal_replica_at_any_stage(
    n: int, m: int, per: int, latency: float, boundary: float, data: st.DataObject
) -> None:
    link = Link(latency, 1e8)
    speeds = data.draw(st.lists(st.sampled_from([0.01, 0.02, 0.05]), min_size=n, max_size=n))
    counts = data.draw(st.lists(st.integers(1, m - 1), min_size=n, max_size=n))
    stage = data.draw(st.integers(0, n - 1))
    stages = [[Replica(c, link)] * r for c, r in zip(speeds, counts, strict=True)]
    gain = replica_gain(stages, workload(n, m, m * per, "gpipe", boundary), stage, Replica(speeds[stage], link))
    assert gain.gain >= -1e-9 * gain.before


def test_replica_gain_weighs_compute_against_the_exchange() -> None:
    link = Link(latency_s=0.02, bandwidth_bps=100e6)
    stages = [[Replica(0.01, link)], [Replica(0.01, link)]]
    cheap = replica_gain(stages, workload(2, 8, 64, gradient=1e5), 1, Replica(0.01, link))
    dear = replica_gain(stages, workload(2, 8, 64, gradient=1e9), 1, Replica(0.01, link))
    assert cheap.gain > 0 > dear.gain
    assert cheap.before == pytest.approx(samples_per_second(stages, workload(2, 8, 64, gradient=1e5)))


def test_a_fast_replica_takes_the_larger_share() -> None:
    t = step_time([[Replica(0.01, FREE), Replica(0.03, FREE)]], workload(1, 8, 64))
    assert t.micro_batches == ((6, 2),)


@given(n=st.integers(1, 4), r=st.integers(1, 4), per=st.integers(1, 3), overhead=st.floats(0, 1), other=st.floats(0, 1))
def test_a_steps_cpu_is_its_compute_once_plus_each_replicas_overhead(
    n: int, r: int, per: int, overhead: float, other: float
) -> None:
    """Replicas share a stage's samples: more of them add only their overhead (each runs the optimizer step)."""
    w = workload(n, 4, 4 * per)
    cpu = cpu_seconds_per_step([[Replica(0.01, FREE)] * r] * n, w, SharedHost(2, overhead, other))
    assert cpu == pytest.approx(n * 4 * per * 0.01 + n * r * overhead + other)


def test_a_faster_replica_costs_its_own_compute_for_its_larger_share() -> None:
    cpu = cpu_seconds_per_step([[Replica(0.01, FREE), Replica(0.03, FREE)]], workload(1, 8, 64), SharedHost(1))
    assert cpu == pytest.approx(6 * 8 * 0.01 + 2 * 8 * 0.03)


def test_a_shared_host_is_bound_by_its_cores_or_by_the_pipeline() -> None:
    """Nine replicas on two cores: at least the CPU bound; on as many cores as replicas: the replay's own time."""
    stages, w = [[Replica(0.01, FREE)] * 3] * 3, workload(3, 6, 24)
    host = SharedHost(2, replica_overhead_s=0.05, other_cpu_s=0.1)
    cpu = 3 * 24 * 0.01 + 9 * 0.05 + 0.1
    assert cpu_seconds_per_step(stages, w, host) == pytest.approx(cpu)
    rate = shared_host_samples_per_second(stages, w, host)
    assert 24 / (cpu / 2) > rate > 24 / (cpu / 2 + step_time(stages, w).seconds)
    assert shared_host_samples_per_second(stages, w, SharedHost(9)) == pytest.approx(samples_per_second(stages, w))
    # Half a core, free links: some replica can always compute, so the CPU bound exactly.
    assert shared_host_samples_per_second(stages, w, SharedHost(0.5)) == pytest.approx(24 / (3 * 24 * 0.01 / 0.5))


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 3), r=st.integers(1, 3), per=st.integers(1, 3), schedule=schedules,
    latency=st.sampled_from([0.0, 0.01]), boundary=st.sampled_from([0.0, 1e5]), gradient=st.sampled_from([0.0, 1e6]),
    cores=st.sampled_from([0.5, 1.0, 1.5, 2.0]), overhead=st.sampled_from([0.0, 0.01]),
    per_byte=st.sampled_from([0.0, 1e-8]), other=st.sampled_from([0.0, 0.05]),
)
# Two replicas of a stage ending their lists at one instant: the second's exchange (here its overhead) started at
# once and the first's an event later, so the step took longer on free cores (0.07 s) than on two (0.068 s).
@example(n=2, r=2, per=1, schedule="1f1b", latency=0.01, boundary=0.0, gradient=0.0, cores=2.0, overhead=0.01,
         per_byte=0.0, other=0.0)
def test_processes_sharing_cores_take_at_least_both_bounds_and_at_most_their_sum(
    n: int, r: int, per: int, schedule: str, latency: float, boundary: float, gradient: float, cores: float,
    overhead: float, per_byte: float, other: float,
) -> None:
    """Processor sharing: a step on a shared host takes at least its replay on free cores and its CPU over the
    cores, and at most the CPU over the cores plus the replay of its longest chain at full speed (Graham's bound)."""
    link = Link(latency, 1e8)
    stages = [[Replica(0.01, link)] * r] * n
    w = workload(n, 2 * r, 2 * r * per, schedule, boundary, gradient)
    host = SharedHost(cores, overhead, other, per_byte)
    shared = shared_host_step_seconds(stages, w, host)
    alone = shared_host_step_seconds(stages, w, SharedHost(100, overhead, 0.0, per_byte))
    cpu = cpu_seconds_per_step(stages, w, host)
    assert shared >= max(alone, cpu / cores) * (1 - 1e-9)
    assert shared <= (cpu / cores + alone) * (1 + 1e-9) + 1e-9
    if overhead == per_byte == 0:
        assert alone == pytest.approx(step_time(stages, w).seconds)  # on free cores, the replay itself


def test_the_exchange_costs_cpu_per_byte_each_replica_sends_and_receives() -> None:
    """Two replicas of one stage exchange 2 (R - 1) / R of its gradient each, as much again received."""
    stages, w = [[Replica(0.01, FREE)] * 2], workload(1, 2, 2, gradient=1e6)
    plain = cpu_seconds_per_step(stages, w, SharedHost(2))
    assert cpu_seconds_per_step(stages, w, SharedHost(2, exchange_cpu_per_byte=1e-9)) == pytest.approx(
        plain + 2 * (2 * 1e6 * 1e-9))
    # Every 4th step only: a quarter of it per step on average.
    every = replace(w, sync_every=4)
    assert cpu_seconds_per_step(stages, every, SharedHost(2, exchange_cpu_per_byte=1e-9)) == pytest.approx(
        plain + 2 * (2 * 1e6 * 1e-9) / 4)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: Workload(4, 2, (), (0.0,)), "micro_batches <= batch_size"),
        (lambda: Workload(2, 2, (1.0,), (0.0,)), "one entry per boundary"),
        (lambda: Workload(2, 2, (), (0.0,), schedule="zigzag"), "unknown pipeline schedule"),
        (lambda: Workload(2, 2, (), (0.0,), sync_every=0), "sync_every must be an integer >= 1"),
        (lambda: Link(-1.0, 1e6), "latency_s >= 0"),
        (lambda: Replica(0.0, FREE), "seconds_per_sample must be > 0"),
        (lambda: step_time([[Replica(1.0, FREE)]], Workload(2, 2, (0.0,), (0.0, 0.0))), "1 stages"),
        (lambda: replica_gain([[Replica(1.0, FREE)] * 2], workload(1, 2, 2), 0, Replica(1.0, FREE)), "already has 2"),
        (lambda: SharedHost(0), "cores > 0"),
        (lambda: SharedHost(2, replica_overhead_s=-1.0), "overheads >= 0"),
        (lambda: SharedHost(2, exchange_cpu_per_byte=-1.0), "overheads >= 0"),
    ],
)
def test_nonsense_is_refused(call: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()
