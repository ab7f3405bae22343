"""A job's step grant as the control plane keeps it (controlplane/jobs/step_grant.py): set when the job starts
running, extended as its progress is recorded, frozen by a hand-over asked, a flagged node, a spent budget and a
cancel; and, end to end with a real agent heartbeating to the control plane, a driver that keeps going after a cancel
trains the agent exactly to the grant the cancel froze."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from arceus.training.driver import train
from arceus.training.plan import StepProgress
from arceus.training.recording import RecordingSink
from controlplane.agents.services import node_register
from controlplane.controller.executor import reconcile_once
from controlplane.driver.driving import train_plan
from controlplane.driver.progress import job_record_steps
from controlplane.driver.recording import StepPoint
from controlplane.driver.sink import DbProgressSink
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.owner_transitions import job_cancel
from controlplane.jobs.services import job_start
from controlplane.jobs.step_grant import GrantWindow, step_grant
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_create
from nodeagent.agent import Agent
from nodeagent.control_plane import ControlPlaneClient, HeartbeatLoop
from tests.nodeagent.test_nodeagent_control_plane import wait_for

pytestmark = pytest.mark.django_db

DRIVER = "d"
BATCH = 32  # the digits job's batch size (tests/controlplane/conftest.py)
WINDOW = GrantWindow(heartbeat_seconds=settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS)


@pytest.fixture
def running(ready_node, queued_job) -> Job:  # noqa: ANN001
    """A job started by the reconciler (its stages reported ready), then claimed by DRIVER."""
    for i in range(3):
        ready_node(f"n{i}", port=50051 + i)
    job = queued_job()
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "placing" and job.step_grant is None  # nothing granted before it runs
    Stage.objects.filter(job=job).update(observed_generation=job.generation, observed_state="ready")
    reconcile_once()
    job.refresh_from_db()
    assert job.status == "running"
    Job.objects.filter(pk=job.pk).update(
        driver_lease_owner=DRIVER, driver_lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    return job


def record(job: Job, step: int, samples_per_second: float = 320.0) -> int | None:
    """Record one step of the job's driver; the job's grant after it."""
    assert job_record_steps(job_id=job.id, lease_owner=DRIVER, points=[StepPoint(1, step, 90, 1.0, samples_per_second)],
                            now=timezone.now())
    job.refresh_from_db()
    return job.step_grant


def test_a_start_grants_the_first_window_and_progress_extends_it(running: Job) -> None:
    assert running.step_grant == WINDOW.initial_steps  # no step measured yet
    # Each recorded step extends it: the window at the measured step time (32 samples at 320/s: 0.1 s a step).
    expected = step_grant(current=WINDOW.initial_steps, recorded=3, total_steps=90, step_seconds=BATCH / 320.0,
                          window=WINDOW)
    assert record(running, 3) == expected > WINDOW.initial_steps
    assert record(running, 85) == 90  # never past the total steps
    # A slower step does not take back what was granted.
    assert record(running, 86, samples_per_second=1.0) == 90


def test_a_hand_over_a_flagged_node_and_a_spent_budget_freeze_it(running: Job) -> None:
    granted = record(running, 2)
    Job.objects.filter(pk=running.pk).update(handover_requested=True)  # a paused node drains
    assert record(running, 4) == granted
    Job.objects.filter(pk=running.pk).update(handover_requested=False)
    Node.objects.filter(pk=Stage.objects.filter(job=running).first().node_id).update(flagged_at=timezone.now())
    assert record(running, 5) == granted  # a check failed on one of its nodes
    Node.objects.update(flagged_at=None)
    Job.objects.filter(pk=running.pk).update(requirements={"max_total_usd": 0.0})
    assert record(running, 6) == granted  # nothing left to pay for a step more
    Job.objects.filter(pk=running.pk).update(requirements={"deadline": (timezone.now() - timedelta(seconds=1))
                                                            .isoformat()})
    assert record(running, 7) == granted  # past its deadline
    Job.objects.filter(pk=running.pk).update(requirements={})
    assert record(running, 8) > granted  # nothing holds it back any more


def test_a_cancel_freezes_it_at_a_known_step(running: Job) -> None:
    granted = record(running, 2)
    cancelled = job_cancel(job=running, now=timezone.now())
    assert cancelled.step_grant == granted
    # The driver's later reports record nothing, and the grant stays where the cancel found it.
    assert not job_record_steps(job_id=running.id, lease_owner=DRIVER, points=[StepPoint(1, 3, 90, 1.0, 320.0)],
                                now=timezone.now())
    assert Job.objects.get(pk=running.pk).step_grant == granted
    # Started again, it trains from scratch: nothing granted until it runs.
    assert job_start(job=Job.objects.get(pk=running.pk)).step_grant is None


def test_a_restarted_driver_is_granted_from_where_the_job_is(running: Job) -> None:
    """A driver restarted in place (its lease expired) starts with a window past the recorded step at the measured
    speed, never below what was granted."""
    granted = record(running, 40)
    Job.objects.filter(pk=running.pk).update(driver_lease_expires_at=timezone.now() - timedelta(seconds=1),
                                             driver_lease_owner="")
    Job.objects.filter(pk=running.pk).update(step=F("step") + 10)  # as if it recorded more before it died
    reconcile_once()  # never claimed: StartDriver again
    job = Job.objects.get(pk=running.pk)
    assert job.step_grant == step_grant(current=granted, recorded=50, total_steps=90, step_seconds=BATCH / 320.0,
                                        window=WINDOW)


def test_a_driver_whose_steps_outrun_its_flush_interval_reports_before_they_reach_the_grant(running: Job) -> None:
    """Steps faster than the sink's flush interval (the first window's eight took under half a second end to end)
    must not run the grant out unreported: the agents refuse the step after it until a report extends it, and the
    driver, waiting for that step, reports nothing (the e2e database-restart test stalled so at step 9)."""
    sink = DbProgressSink(job_id=str(running.id), lease_owner=DRIVER, generation=running.generation,
                          flush_seconds=3600.0)
    grant = running.step_grant
    for step in range(1, 41):
        assert step <= grant, f"step {step} beyond the grant {grant}: the driver would wait for it forever"
        # As slow as a warming-up first step would measure (a short window), however fast they really come.
        sink.on_step(StepProgress(epoch=1, step=step, total_steps=90, loss=1.0, samples_per_second=BATCH / 2.0,
                                  seconds=2.0))
        grant = Job.objects.get(pk=running.pk).step_grant
    assert grant > 40


class StaleDriverSink(RecordingSink):
    """A driver's sink that records its steps under its lease until step `cancel_at`, where the job is cancelled
    (after the agent heard the grant that step's record gave, and stopped hearing the control plane), and then goes
    on as if nothing happened: a driver that keeps going after a cancel, before its agents drop the stages."""

    def __init__(self, job: Job, agent: Agent, loop: HeartbeatLoop, cancel_at: int) -> None:
        super().__init__()
        self.job, self.agent, self.loop, self.cancel_at = job, agent, loop, cancel_at
        self.frozen: int | None = None  # the grant the cancel found

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        if p.step > self.cancel_at:
            return
        # A step of 1 s as the control plane measures it: a window of a few steps, well short of the total.
        point = StepPoint(p.epoch, p.step, p.total_steps, p.loss, float(BATCH))
        assert job_record_steps(job_id=self.job.id, lease_owner=DRIVER, points=[point], now=timezone.now())
        if p.step == self.cancel_at:
            granted = Job.objects.get(pk=self.job.pk).step_grant
            wait_for(lambda: self.agent.registry.grants.granted(str(self.job.id)) == granted)
            self.loop.stop()  # the agent hears no more: the cancel below does not reach it
            self.frozen = job_cancel(job=self.job, now=timezone.now()).step_grant


@pytest.mark.django_db(transaction=True)
def test_a_cancel_stops_the_agents_at_the_grant_it_froze(live_server, user, agent: Agent, queued_job,  # noqa: ANN001
                                                        settings) -> None:  # noqa: ANN001
    settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS = 0.5
    settings.ARCEUS_RPC_TIMEOUT_SECONDS = 5.0  # the refused step answers by its call's deadline
    node, token = node_create(owner=user, name="granted")
    node_register(node=node, grpc_address=agent.advertise_address, tls_certificate=agent.identity.certificate,
                  device_type="cpu", device_name="test cpu", memory_bytes=2**30, flops_fp32=1e9, now=timezone.now())
    loop = HeartbeatLoop(ControlPlaneClient(live_server.url, token), agent, interval=0.5, on_fatal=print)
    loop.start()
    try:
        wait_for(lambda: Node.objects.get(pk=node.pk).ready_status == "True")
        job = queued_job(stages=1)
        reconcile_once()  # placed on the agent's node, which builds its stage and reports it ready
        wait_for(lambda: Stage.objects.filter(job=job, observed_state="ready").exists())
        reconcile_once()  # running: granted its first window
        job.refresh_from_db()
        assert job.status == "running" and job.step_grant == WINDOW.initial_steps
        claimed = job_driver_claim(job_id=job.id, owner=DRIVER, now=timezone.now())
        assert claimed is not None
        sink = StaleDriverSink(job, agent, loop, cancel_at=12)
        result = train(train_plan(claimed), sink)
    finally:
        loop.stop()
    # It trained on past the cancel up to the grant the cancel froze, and its agent refused the step after it.
    assert sink.frozen is not None and sink.frozen > 12 + WINDOW.margin_steps
    assert result.stopped and result.steps == sink.frozen
    assert f"train step {sink.frozen + 1} of job {job.id}" in result.stop_reason
    assert f"the step grant is {sink.frozen}" in result.stop_reason
    [stage] = agent.registry.stages()
    assert stage.runtime.counters.samples == sink.frozen * BATCH  # not a sample of a step beyond it
    assert Job.objects.get(pk=job.pk).step_grant == sink.frozen
