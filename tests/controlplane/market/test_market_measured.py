"""Measured, not declared (controlplane/nodes/device_class.py `market_flops`, controlplane/driver/progress.py): a
device is priced and placed by the speed the training driver measured of it on its own clock; what its agent
declares only bounds that from above, and before any measurement it counts as at most a laptop."""

from __future__ import annotations

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from arceus.model.registry import model_spec_from_config
from arceus.training.plan import StageTiming
from controlplane.controller.executor import reconcile_once
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.driver.progress import StepPoint, job_record_steps
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Job, Stage
from controlplane.nodes.device_class import UNMEASURED_FLOPS, device_class, market_flops, node_device_class
from controlplane.nodes.models import Node

pytestmark = pytest.mark.django_db


def placed_flops() -> dict[str, float]:
    return {view.name: view.device().flops for view in node_views(registered_nodes())}


def test_a_node_declaring_1e15_flops_is_priced_and_placed_by_what_the_driver_measured(ready_node,  # noqa: ANN001
                                                                                       queued_job) -> None:  # noqa: ANN001
    boaster = ready_node("boaster", flops=1e15, memory=2**30)
    for name in ("honest-a", "honest-b"):
        ready_node(name, flops=5e9, memory=2**30)
    # Unmeasured: the claim counts for no more than a laptop, in price class and in placement.
    assert node_device_class(boaster) == device_class(UNMEASURED_FLOPS, 2**30) == "standard-small"
    assert placed_flops() == {"boaster": UNMEASURED_FLOPS, "honest-a": 5e9, "honest-b": 5e9}

    job = queued_job(stages=3)
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    now = timezone.now()
    assert job_driver_claim(job_id=job.id, owner="driver", now=now) is not None
    # The driver timed a step at 0.5 s on its clock, whatever the agents say they computed (here: nothing).
    timings = [StageTiming(i, 0.0, 0.0, wall_seconds=0.5 if i == 2 else 0.2) for i in range(3)]
    assert job_record_steps(job_id=job.id, lease_owner="driver", points=[StepPoint(1, 1, 10, 1.0, 64.0)],
                            timings=timings, now=now)

    stage = Stage.objects.get(job=job, node=boaster, active=True)
    costs = model_spec_from_config(job.model_config).layer_flops_per_sample()
    per_sample = sum(costs[stage.layer_start:stage.layer_end])
    measured = 3 * 32 * per_sample / 0.5  # forward and backward of a 32-sample batch over the step's wall time
    boaster.refresh_from_db()
    assert boaster.flops_measured == pytest.approx(measured) and boaster.flops_measured_at == now
    assert node_device_class(boaster) == device_class(measured, 2**30) == "light-small"
    assert placed_flops()["boaster"] == pytest.approx(measured)
    assert Node.objects.get(name="honest-a").flops_measured < 5e9  # theirs too: measured, and below their claim
    assert placed_flops()["honest-a"] == Node.objects.get(name="honest-a").flops_measured


@given(declared=st.floats(0, 1e16), measured=st.none() | st.floats(0, 1e16))
def test_a_declared_figure_only_lowers_the_measured_one(declared: float, measured: float | None) -> None:
    flops = market_flops(declared, measured)
    assert flops <= declared  # the owner may offer less than the device does ...
    assert flops <= (UNMEASURED_FLOPS if measured is None else measured)  # ... never more than was measured
    assert flops == min(declared, UNMEASURED_FLOPS if measured is None else measured)


def test_each_replica_is_measured_by_its_own_share_of_the_step(ready_node, queued_job) -> None:  # noqa: ANN001
    """A replica ran only the micro-batches the driver routed to it: its node is measured by those samples over the
    step's wall time, not by the whole batch (which would make every replica of a stage look R times faster)."""
    for i in range(3):
        ready_node(f"n{i}", flops=1e12, memory=2**30)
    job = queued_job(stages=1, replicas={"min": 2, "max": 2})
    reconcile_once()
    Job.objects.filter(pk=job.pk).update(status="running")
    now = timezone.now()
    assert job_driver_claim(job_id=job.id, owner="driver", now=now) is not None
    fast, slow = Stage.objects.filter(job=job, active=True).order_by("replica")
    # The driver routed 3 of 4 micro-batches (24 of 32 samples) to the fast replica; the step took 0.5 s.
    timings = [StageTiming(0, 0.3, 0.1, 0.5, node_id=str(fast.node_id), samples=24, micro_batches=3),
               StageTiming(0, 0.3, 0.1, 0.4, node_id=str(slow.node_id), samples=8, micro_batches=1)]
    assert job_record_steps(job_id=job.id, lease_owner="driver", points=[StepPoint(1, 1, 10, 1.0, 64.0)],
                            timings=timings, now=now)

    costs = model_spec_from_config(job.model_config).layer_flops_per_sample()
    per_sample = sum(costs[fast.layer_start:fast.layer_end])
    measured = {name: Node.objects.get(pk=s.node_id).flops_measured for name, s in (("fast", fast), ("slow", slow))}
    assert measured == {
        "fast": pytest.approx(3 * 24 * per_sample / 0.5),
        "slow": pytest.approx(3 * 8 * per_sample / 0.5),
    }
    # Together the replicas did the batch's work in the step: no more than one node doing it all would have.
    assert sum(measured.values()) == pytest.approx(3 * 32 * per_sample / 0.5)
