"""Training under churn, simulated over hours: R replicas per stage (a lost replica is repaired around and a
spare joins from a peer) against one device per stage (today: any loss rewinds everyone to the checkpoint).

Devices leave at random (a Poisson process per device) and an equal device arrives in each one's place at
once, as a spare, so the population stays the same. Step times come from the step model
(arceus.swarm.model); the simulation is deterministic for a seed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from arceus.swarm.model import Replica, Workload, step_time


@dataclass(frozen=True)
class Churn:
    """leaves_per_hour: each device's departure rate (0.1: a tenth of the devices leave per hour);
    detection_s: until a loss is noticed; recovery_s: until the step resumes after a repair; rewind_s: until
    training runs again after a stage was left empty (a new placement loads every stage's checkpoint);
    join_s: until a spare joins a stage as a replica (state copied from a peer); checkpoint_interval_steps:
    a rewind goes back to the last multiple of it."""

    leaves_per_hour: float
    detection_s: float
    recovery_s: float
    rewind_s: float
    join_s: float
    checkpoint_interval_steps: int
    hours: float
    seed: int = 0

    def __post_init__(self) -> None:
        times = (self.detection_s, self.recovery_s, self.rewind_s, self.join_s)
        if min(self.leaves_per_hour, *times) < 0 or self.hours <= 0:
            raise ValueError(f"rates and times must be >= 0 and hours > 0, got {self}")
        if self.checkpoint_interval_steps < 1:
            raise ValueError(f"checkpoint_interval_steps must be >= 1, got {self.checkpoint_interval_steps}")


@dataclass(frozen=True)
class ChurnResult:
    """samples_per_second: the step counter's progress over the whole run, in samples (replayed steps
    count once); steps_replayed: steps lost to rewinds; repairs: losses a stage survived; joins: spares that
    joined a stage from a peer (not the restart's placements after a rewind)."""

    samples_per_second: float
    steps: int
    steps_replayed: int
    rewinds: int
    repairs: int
    joins: int


def simulate_churn(
    devices: Sequence[Replica], num_stages: int, replicas: int, workload: Workload, churn: Churn
) -> ChurnResult:
    """Train `workload` for `churn.hours` on `replicas` devices per stage drawn from `devices` (fastest first,
    dealt to the stages in turn; stages of equal cost), the rest spares. A loss mid-step in a stage that
    keeps a replica delays that step by detection and recovery and at most one step's recompute (it is
    counted as a whole step at the reduced membership), and a spare (the fastest) joins join_s after the
    loss was noticed, at a step boundary. A stage losing its last replica rewinds: the steps since the
    checkpoint are lost and the restart (rewind_s) fills every stage from the spares."""
    if not 1 <= replicas <= workload.micro_batches:
        raise ValueError(f"replicas must be in [1, micro_batches = {workload.micro_batches}], got {replicas}")
    if len(devices) < num_stages * replicas:
        raise ValueError(f"{len(devices)} devices cannot fill {num_stages} stages x {replicas} replicas")
    rng = random.Random(churn.seed)
    horizon, rate = churn.hours * 3600, churn.leaves_per_hour / 3600
    by_speed = sorted(range(len(devices)), key=lambda d: (devices[d].seconds_per_sample, d))
    members: list[set[int]] = [set(by_speed[i : num_stages * replicas : num_stages]) for i in range(num_stages)]
    spares = set(by_speed[num_stages * replicas :])
    leaves = [(rng.expovariate(rate), d) for d in range(len(devices))] if rate > 0 else []
    heapq.heapify(leaves)
    joining: list[tuple[float, int]] = []  # (ready at, stage)
    t, steps, checkpoint = 0.0, 0, 0
    replayed = rewinds = repairs = joins = 0

    def seconds() -> float:
        return step_time([[devices[d] for d in sorted(s)] for s in members], workload).seconds

    def fill(stage: int) -> None:
        newcomer = min(spares, key=lambda d: (devices[d].seconds_per_sample, d))
        spares.remove(newcomer)
        members[stage].add(newcomer)

    def commit(at: float) -> bool:
        """The step ending at `at` counts if it ends within the run."""
        nonlocal t, steps, checkpoint, joins
        if at > horizon:
            return False
        t, steps = at, steps + 1
        if steps % churn.checkpoint_interval_steps == 0:
            checkpoint = steps
        for ready, stage in [j for j in joining if j[0] <= t]:
            joining.remove((ready, stage))
            if len(members[stage]) < replicas:
                fill(stage)
                joins += 1
        return True

    step = seconds()
    while True:
        leave_at, device = leaves[0] if leaves else (float("inf"), -1)
        if t + step <= leave_at:
            if not commit(t + step):
                break
            step = seconds()
            continue
        if leave_at > horizon:
            break
        heapq.heapreplace(leaves, (leave_at + rng.expovariate(rate), device))
        stage = next((i for i, s in enumerate(members) if device in s), None)
        if stage is None:
            continue  # a spare left; its successor is a spare too
        members[stage].remove(device)
        spares.add(device)  # the equal device arriving in its place
        if members[stage]:
            repairs += 1
            joining.append((leave_at + churn.detection_s + churn.join_s, stage))
            if t <= leave_at:  # mid-step: the step completes once repaired
                if not commit(leave_at + churn.detection_s + churn.recovery_s + seconds()):
                    break
            else:  # the pipeline was already waiting on an earlier loss
                t = max(t, leave_at + churn.detection_s + churn.recovery_s)
        else:
            rewinds += 1
            replayed += steps - checkpoint
            steps = checkpoint
            t = max(t, leave_at) + churn.detection_s + churn.rewind_s
            joining.clear()
            for i in range(num_stages):
                while len(members[i]) < replicas:
                    fill(i)
        step = seconds()
    return ChurnResult(steps * workload.batch_size / horizon, steps, replayed, rewinds, repairs, joins)
