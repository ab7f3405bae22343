"""Two reconcile passes racing: planned from the same moment, their actions interleaved at random.

Pass A sees the snapshot as it is; pass B sees a stale variant of it (some nodes missing, jobs in
another order), so the two often decide differently about the same jobs and nodes: one moves a stage
whose node it cannot see while the other starts the driver, or both move it to different nodes. Whatever the
interleaving, the optimistic checks must leave a consistent placement: no stage placed twice, no job
with stages from two decisions, no node hosting two stages or more memory than it has.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from arceus.model.registry import model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import stage_memory
from controlplane.agents.services import node_heartbeat, node_register
from controlplane.controller.executor import execute, reconcile_once
from controlplane.controller.placement import workload
from controlplane.controller.rules import plan
from controlplane.controller.snapshot import load_snapshot
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.liveness import lease_renew
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for

pytestmark = pytest.mark.django_db

nodes_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "flops": st.sampled_from([1e9, 2e9, 4e9]),
            "memory": st.sampled_from([200_000, 600_000, 4_000_000]),
            "silent": st.sampled_from([1, 1, 1, 30]),  # some stopped heartbeating
            "dies": st.sampled_from([False, False, True]),  # stops after the early placement
        }
    ),
    min_size=0,
    max_size=6,
)
jobs_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "hidden": st.lists(st.sampled_from([16, 64, 256]), min_size=1, max_size=4),
            "stages": st.one_of(st.none(), st.integers(1, 3)),
            "placed_early": st.booleans(),  # placed (and reported ready) before the race
            "driver": st.sampled_from(["none", "live", "dead"]),  # if placed early: running, and its driver
        }
    ),
    min_size=1,
    max_size=4,
)


# Two passes plan at most one action per node and one per job each: 2 × (6 nodes + 4 jobs).
MAX_ACTIONS = 20


def build(user, nodes: list[dict], jobs: list[dict], now) -> None:
    """Nodes, then jobs placed and reported ready 2 s ago (some then running, with a live or dead driver),
    then queued jobs; nodes marked `dies` stop heartbeating after the early placement."""
    created = []
    for i, spec in enumerate(nodes):
        node, _ = node_create(owner=user, name=f"n{i}")
        seen = now - timedelta(seconds=spec["silent"])
        node_register(
            node=node,
            grpc_address=f"10.0.0.{i + 1}:5000", tls_certificate=identity_for(f"10.0.0.{i + 1}:5000").certificate,
            device_type="cpu",
            device_name="cpu",
            memory_bytes=spec["memory"],
            flops_fp32=spec["flops"],
            now=seen,
        )
        node_heartbeat(node=node, observed=[], now=seen)
        created.append(node)
    for early in (True, False):
        for spec in (j for j in jobs if j["placed_early"] == early):
            stages = min(spec["stages"], len(spec["hidden"]) + 1) if spec["stages"] else None
            job = job_submit(
                owner=user,
                model_config={"layer_sizes": [64, *spec["hidden"], 10]},
                dataset_config={"name": "digits"},
                stages=stages,
            )
            job_start(job=job)
            spec["id"] = job.id
        if early:
            reconcile_once(now=now - timedelta(seconds=2))
            for stage in Stage.objects.filter(active=True):
                Stage.objects.filter(pk=stage.pk).update(observed_generation=stage.generation, observed_state="ready")
            for spec in (j for j in jobs if j["placed_early"] and j["driver"] != "none"):
                expires = now + timedelta(seconds=5 if spec["driver"] == "live" else -5)
                Job.objects.filter(pk=spec["id"], status="placing").update(
                    status="running", driver_lease_owner="driver", driver_lease_expires_at=expires
                )
            for node, spec in zip(created, nodes, strict=True):
                if spec["dies"]:
                    lease_renew(node_id=node.pk, now=now - timedelta(seconds=30))


# Its own time limit, above the suite's (pyproject.toml), which also counts fixtures' setup: 80 examples take minutes
# on two busy cores, and the first database test on a pytest-xdist worker also creates that worker's test database.
# pytest-timeout's alarm raises inside whatever query runs; Hypothesis takes it for that example's failure and replays
# on a connection whose transaction state it left inconsistent, so an overrun reads as a TransactionManagementError
# and a FlakyStrategyDefinition, not as a timeout.
@pytest.mark.timeout(900)
@settings(
    max_examples=80,  # a fresh draw each run: the runs together cover more than one long run did
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(nodes=nodes_strategy, jobs=jobs_strategy, data=st.data())
def test_interleaved_passes_keep_the_placement_consistent(user, nodes, jobs, data) -> None:
    # The examples share the test's one transaction: each runs in a savepoint rolled back at its end, so each starts
    # from the same empty tables (cheaper than deleting the last one's rows).
    with transaction.atomic():
        _race(user, nodes, jobs, data)
        transaction.set_rollback(True)


def _race(user, nodes: list[dict], jobs: list[dict], data: st.DataObject) -> None:
    now = timezone.now()
    build(user, nodes, jobs, now)

    desired, observed = load_snapshot()
    hidden = data.draw(st.sets(st.sampled_from([n.id for n in observed.nodes])) if observed.nodes else st.just(set()))
    stale_observed = replace(observed, nodes=tuple(n for n in observed.nodes if n.id not in hidden))
    stale_desired = replace(desired, jobs=tuple(reversed(desired.jobs)))
    passes = [plan(desired, observed, now), plan(stale_desired, stale_observed, now)]
    for action in passes[0] + passes[1]:
        event(type(action).__name__)  # --hypothesis-show-statistics: which decisions raced
    # Which pass applies its next action, drawn as a fixed number of coin flips (a pass that has run out
    # yields to the other): the draws do not depend on how many actions the passes planned, which differs
    # between replays of an example, since nodes tie-break on their ids and those are new each time.
    turns = data.draw(st.lists(st.integers(0, 1), min_size=MAX_ACTIONS, max_size=MAX_ACTIONS))
    for turn in turns:
        which = turn if passes[turn] else 1 - turn
        if not passes[which]:
            break
        execute([passes[which].pop(0)], now=now)
    assert not passes[0] and not passes[1]

    assert_consistent()


def assert_consistent() -> None:
    per_node: dict = {}
    for job in Job.objects.prefetch_related("stages__node"):
        stages = sorted((s for s in job.stages.all() if s.active), key=lambda s: s.index)
        if job.status in ("queued", "created"):
            assert stages == [], job
            continue
        assert job.status in ("placing", "pending", "running"), job
        spec = model_spec_from_config(job.model_config)
        layers, load = layer_profiles(spec), workload(job.dataset_config, job.micro_batches, job.schedule)
        # One decision's stages: indices 0..k-1, one generation (the job's), contiguous cover.
        assert [s.index for s in stages] == list(range(len(stages)))
        assert {s.generation for s in stages} == {job.generation}
        assert stages[0].layer_start == 0 and stages[-1].layer_end == spec.num_layers
        assert all(a.layer_end == b.layer_start for a, b in zip(stages, stages[1:], strict=False))
        if job.stages_requested:
            assert len(stages) == job.stages_requested
        # Only a pending job has stages without a node (lost, waiting for a node with room).
        assert all(s.node is not None for s in stages) or job.status == "pending", job
        for s in (s for s in stages if s.node is not None):
            held = load.in_flight(s.index, len(stages))
            assert stage_memory(layers[s.layer_start : s.layer_end], load, in_flight=held) <= s.node.memory_bytes
            per_node.setdefault(s.node_id, []).append(s.stage_id)
    assert all(len(ids) == 1 for ids in per_node.values()), per_node
