"""Placement takes the agents' measured links into account: a slow link makes cutting the model there
cost more than the compute it spreads (the service-level twin of the solver's
test_a_slow_link_makes_fewer_stages_faster)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import reconcile_once
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.jobs.models import Stage
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for

pytestmark = pytest.mark.django_db


def linked_node(user, name: str, bandwidth: float, rtt: float = 0.001) -> None:  # noqa: ANN001
    node, _ = node_create(owner=user, name=name)
    now = timezone.now()
    node_register(node=node, grpc_address=f"10.0.0.{len(name)}:5005",
                  tls_certificate=identity_for(f"10.0.0.{len(name)}:5005/{name}").certificate,  # a key each
                  device_type="cpu", device_name="cpu",
                  memory_bytes=2**30, flops_fp32=1e9, now=now,
                  link={"rtt_seconds": rtt, "bandwidth_bytes_per_second": bandwidth})
    node_heartbeat(node=node, observed=[], now=now)


@pytest.mark.parametrize(("bandwidth", "rtt", "stages"), [(1e9, 0.0, 2), (1e3, 0.001, 1)])
def test_measured_links_decide_how_many_stages_pay_off(
    user, queued_job, bandwidth: float, rtt: float, stages: int  # noqa: ANN001
) -> None:
    for i in range(3):
        linked_node(user, f"node-{i}", bandwidth, rtt)
    # 1 KB of activations per micro-batch: µs over 1 GB/s, 1 s over 1 KB/s. The compute (~100 µs) is
    # mostly layer 0's, so two stages are as fast as three.
    job = queued_job(stages=None)  # as many stages as pay off
    reconcile_once()
    assert Stage.objects.filter(job=job, active=True).count() == stages


def test_an_unmeasured_link_counts_as_unlimited_and_rtt_as_twice_the_latency(user) -> None:  # noqa: ANN001
    linked_node(user, "measured", 2e6, rtt=0.04)
    node, _ = node_create(owner=user, name="old-agent")
    node_register(node=node, grpc_address="10.0.0.9:5005",
                  tls_certificate=identity_for("10.0.0.9:5005").certificate,
                  device_type="cpu", device_name="cpu",
                  memory_bytes=2**30, flops_fp32=1e9, now=timezone.now())
    views = {v.name: v.device() for v in node_views(registered_nodes())}
    assert (views["measured"].bandwidth_bytes_per_s, views["measured"].latency_s) == (2e6, 0.02)
    assert views["old-agent"].bandwidth_bytes_per_s == float("inf") and views["old-agent"].latency_s == 0.0
