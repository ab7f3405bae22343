"""A replica the driver keeps fencing, through the control plane's database: each fence recorded by the driver's
service (`stage_record_fenced`, counted in its window), the reconcile pass that drops it once fenced
ARCEUS_REPLICA_MAX_FENCES times, the executor's checks of what it saw, and the new replica placed on another node."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from arceus.training.plan import ReplicaFence, ReplicaJoin
from controlplane.agents.services import node_heartbeat
from controlplane.controller.actions import AddReplicas, DropReplicas
from controlplane.controller.executor import execute, reconcile_once
from controlplane.controller.rules import plan
from controlplane.controller.snapshot import load_snapshot
from controlplane.controller.transitions import job_rewind
from controlplane.driver.progress import stage_record_fenced, stage_record_joined
from controlplane.jobs.models import Job, Stage, StageContribution
from controlplane.jobs.services import job_start
from controlplane.nodes.models import Node
from tests.controlplane.conftest import DIGITS_JOB


def running_replicated_job(api, ready_node, now):
    """A job of 3 stages x 2 replicas on six nodes, running, its driver lease held by "d"; and a slower spare."""
    nodes = [ready_node(f"n{i}", port=50051 + i, now=now) for i in range(6)]
    created = api.post("/api/jobs", {**DIGITS_JOB, "replicas": 2}, format="json").json()
    job = job_start(job=Job.objects.get(pk=created["id"]))
    reconcile_once(now=now)
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="d",
                                         driver_lease_expires_at=now + timedelta(seconds=600))
    job.refresh_from_db()
    spare = ready_node("spare", port=50061, flops=5e8, now=now)  # slower than every node of the job
    return job, nodes, spare


def fence(job: Job, replica: tuple[int, int], step: int, now) -> None:
    assert stage_record_fenced(job_id=job.id, lease_owner="d", generation=job.generation,
                               fence=ReplicaFence(*replica, until_step=step + 1, step=step), now=now)


def rejoin(job: Job, replica: tuple[int, int], now) -> None:
    assert stage_record_joined(job_id=job.id, lease_owner="d", generation=job.generation,
                               join=ReplicaJoin(*replica, 0, 10, "a" * 64, "a" * 64), now=now)


def heartbeat(nodes: list[Node], now) -> None:
    for node in nodes:
        node_heartbeat(node=node, observed=[], now=now)


def test_a_replica_fenced_too_often_is_dropped_and_replaced_on_another_node(
    api, ready_node, settings
) -> None:
    settings.ARCEUS_REPLICA_MAX_FENCES, settings.ARCEUS_REPLICA_FENCE_WINDOW_STEPS = 3, 20
    now = timezone.now()
    job, nodes, spare = running_replicated_job(api, ready_node, now)
    flaky = Stage.objects.get(job=job, index=1, replica=1)
    everyone = [*nodes, spare]
    # fenced twice within the window, rejoining between: kept (the driver's backoff may yet see it through)
    for step in (3, 5):
        fence(job, (1, 1), step, now)
        heartbeat(everyone, now)
        assert reconcile_once(now=now).applied == []
        rejoin(job, (1, 1), now)
    flaky.refresh_from_db()
    assert (flaky.fences, flaky.fences_since_step, flaky.fenced_until_step) == (2, 3, None)
    # a fence past the window opens a new one: counted from 1 again
    fence(job, (1, 1), 40, now)
    assert reconcile_once(now=now).applied == []
    rejoin(job, (1, 1), now)
    fence(job, (1, 1), 42, now)
    assert reconcile_once(now=now).applied == []
    rejoin(job, (1, 1), now)
    fence(job, (1, 1), 45, now)  # the third within steps 40-59: dropped while fenced, its sibling training on
    flaky.refresh_from_db()
    assert (flaky.fences, flaky.fences_since_step, flaky.fenced_until_step) == (3, 40, 46)
    [drop] = reconcile_once(now=now).applied
    assert isinstance(drop, DropReplicas) and drop.replicas == ((1, 1),) and drop.fenced == ((1, 1, 3),)
    assert not Stage.objects.filter(job=job, index=1, replica=1).exists()
    assert Stage.objects.filter(job=job, index=1).count() == 1
    released = StageContribution.objects.get(job=job, node_id=flaky.node_id)
    assert (released.released_at, released.fenced_out) == (now, True)
    job.refresh_from_db()
    assert (job.generation, job.status, job.restarts) == (drop.generation, "running", 0)  # no rewind
    replicas = next(c for c in job.conditions if c["type"] == "Replicas")
    assert replicas["reason"] == "ReplicaFencedOut" and "fenced it 3 times" in replicas["message"]

    # the next pass places a new replica on the spare, not on the faster node it left, which heartbeats on
    later = now + timedelta(seconds=2)
    heartbeat(everyone, later)
    [grow] = reconcile_once(now=later).applied
    assert [(s.index, s.replica, s.node_id) for s in grow.stages] == [(1, 2, str(spare.id))]
    # until ARCEUS_REPLICA_FENCED_OUT_SECONDS after the drop, the node takes none of the job's replicas
    Stage.objects.filter(job=job, index=1, replica=2).delete()
    Node.objects.filter(pk=spare.pk).update(paused=True)
    heartbeat(nodes, later)
    assert reconcile_once(now=later).applied == []
    after = now + timedelta(seconds=settings.ARCEUS_REPLICA_FENCED_OUT_SECONDS + 1)
    Job.objects.filter(pk=job.pk).update(driver_lease_expires_at=after + timedelta(seconds=60))
    heartbeat(nodes, after)
    [grow] = [a for a in reconcile_once(now=after).applied if isinstance(a, AddReplicas)]  # the paused spare unknown
    assert [(s.index, s.node_id) for s in grow.stages] == [(1, str(flaky.node_id))]


def test_the_executor_drops_a_fenced_replica_only_as_the_pass_saw_it_and_never_the_last_that_trains(
    api, ready_node, settings
) -> None:
    settings.ARCEUS_REPLICA_MAX_FENCES = 2
    now = timezone.now()
    job, nodes, _ = running_replicated_job(api, ready_node, now)
    for step in (3, 4):
        fence(job, (2, 0), step, now)
    heartbeat(nodes, now)

    def planned(fences: int) -> DropReplicas:
        desired, observed = load_snapshot(now)
        [drop] = plan(desired, observed, now)
        assert isinstance(drop, DropReplicas) and drop.fenced == ((2, 0, fences),)
        return drop

    # it rejoined between the pass's snapshot and its drop: the drop is skipped (the next pass decides again)
    drop = planned(2)
    rejoin(job, (2, 0), now)
    assert execute([drop], now=now).skipped == [drop]
    assert Stage.objects.filter(job=job, index=2).count() == 2
    # its sibling was fenced meanwhile: dropping it would leave its stage no replica that trains; skipped too
    fence(job, (2, 0), 5, now)
    drop = planned(3)
    fence(job, (2, 1), 5, now)
    assert execute([drop], now=now).skipped == [drop]
    assert Stage.objects.filter(job=job, index=2).count() == 2
    # with its sibling training again, the same drop applies
    rejoin(job, (2, 1), now)
    assert execute([drop], now=now).applied == [drop]
    assert list(Stage.objects.filter(job=job, index=2).values_list("replica", flat=True)) == [1]


def test_a_rewind_counts_fences_afresh(api, ready_node) -> None:
    now = timezone.now()
    job, nodes, _ = running_replicated_job(api, ready_node, now)
    fence(job, (0, 1), 7, now)
    assert job_rewind(job_id=job.id, generation=job.generation, reason="DriverLost", message="test", now=now)
    row = Stage.objects.get(job=job, index=0, replica=1)
    assert (row.fences, row.fences_since_step, row.fenced_until_step, row.fenced_at) == (0, None, None, None)
