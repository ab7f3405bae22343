"""Training under churn, simulated: no churn is the step model's throughput; one device per stage loses
about half a checkpoint interval per loss; replicas lose nothing until a stage loses every replica."""

from __future__ import annotations

import dataclasses

import pytest

from arceus.swarm.churn import Churn, simulate_churn
from arceus.swarm.model import Link, Replica, Workload, samples_per_second, step_time

LINK = Link(latency_s=0.02, bandwidth_bps=100e6)
DEVICES = [Replica(1.0 + 0.1 * (d % 4), LINK) for d in range(12)]  # four speeds, three of each
WORK = Workload(micro_batches=4, batch_size=16, boundary_bytes_per_sample=(1e5, 1e5), gradient_bytes=(1e6,) * 3)
CHURN = Churn(leaves_per_hour=0.5, detection_s=6, recovery_s=10, rewind_s=10, join_s=30, checkpoint_interval_steps=20,
              hours=20)


def test_without_churn_it_is_the_step_models_throughput() -> None:
    result = simulate_churn(DEVICES, 3, 2, WORK, dataclasses.replace(CHURN, leaves_per_hour=0.0, hours=2))
    fastest = sorted(DEVICES, key=lambda d: d.seconds_per_sample)[:6]
    stages = [sorted(fastest[i::3], key=DEVICES.index) for i in range(3)]
    assert result.steps == int(2 * 3600 / step_time(stages, WORK).seconds)
    assert result.samples_per_second == pytest.approx(samples_per_second(stages, WORK), rel=0.01)
    assert (result.rewinds, result.repairs, result.joins, result.steps_replayed) == (0, 0, 0, 0)


def test_it_is_deterministic_for_a_seed() -> None:
    assert simulate_churn(DEVICES, 3, 2, WORK, CHURN) == simulate_churn(DEVICES, 3, 2, WORK, CHURN)
    assert simulate_churn(DEVICES, 3, 1, WORK, CHURN) != simulate_churn(
        DEVICES, 3, 1, WORK, dataclasses.replace(CHURN, seed=1)
    )


@pytest.mark.parametrize("interval", [10, 40])
def test_one_device_per_stage_loses_half_a_checkpoint_interval_per_loss(interval: int) -> None:
    churn = dataclasses.replace(CHURN, checkpoint_interval_steps=interval, hours=200, leaves_per_hour=1.0)
    result = simulate_churn(DEVICES, 3, 1, WORK, churn)
    assert result.repairs == result.joins == 0 and result.rewinds > 100
    assert 0.35 * interval <= result.steps_replayed / result.rewinds <= 0.65 * interval


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_replicas_lose_no_step_while_each_stage_keeps_one(replicas: int, seed: int) -> None:
    """Spares join at once: every loss is repaired around (no rewind, nothing replayed)."""
    churn = dataclasses.replace(CHURN, seed=seed, join_s=0.0, leaves_per_hour=0.5, hours=10)
    result = simulate_churn(DEVICES, 3, replicas, WORK, churn)
    assert result.repairs > 0 and result.joins > 0
    assert result.rewinds == result.steps_replayed == 0


def test_a_stage_that_loses_every_replica_rewinds() -> None:
    """Spares that never arrive in time: each stage dwindles to nothing, then rewinds like today."""
    churn = dataclasses.replace(CHURN, join_s=10**9, leaves_per_hour=2.0, hours=30)
    result = simulate_churn(DEVICES, 3, 2, WORK, churn)
    assert result.rewinds > 0 and result.steps_replayed > 0 and result.joins == 0


def test_a_rewind_costs_its_restart_and_a_repair_does_not() -> None:
    """rewind_s slows one device per stage; with spares joining at once, replicas never rewind and never pay it."""
    quick, slow = (dataclasses.replace(CHURN, join_s=0.0, hours=50, leaves_per_hour=1.0, rewind_s=s) for s in (1, 300))
    assert simulate_churn(DEVICES, 3, 1, WORK, slow).samples_per_second < simulate_churn(
        DEVICES, 3, 1, WORK, quick).samples_per_second
    assert simulate_churn(DEVICES, 3, 2, WORK, slow) == simulate_churn(DEVICES, 3, 2, WORK, quick)


def test_replicas_keep_more_of_their_throughput_under_churn() -> None:
    calm = dataclasses.replace(CHURN, leaves_per_hour=0.0)
    retained = {
        r: simulate_churn(DEVICES, 3, r, WORK, CHURN).samples_per_second
        / simulate_churn(DEVICES, 3, r, WORK, calm).samples_per_second
        for r in (1, 2)
    }
    assert retained[2] > retained[1]


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot fill 3 stages x 4 replicas"):
        simulate_churn(DEVICES[:11], 3, 4, WORK, CHURN)
    with pytest.raises(ValueError, match="replicas must be in \\[1, micro_batches = 4\\]"):
        simulate_churn(DEVICES, 3, 5, WORK, CHURN)
    with pytest.raises(ValueError, match="checkpoint_interval_steps must be >= 1"):
        dataclasses.replace(CHURN, checkpoint_interval_steps=0)
