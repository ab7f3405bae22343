"""An estimate's computation, on a Celery worker (the task `arceus.estimate`): the job planned on the free Ready
nodes as the reconciler would plan it, priced at the posted prices. The request and the owner's read are
`controlplane/jobs/estimate.py`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.utils import timezone

from arceus.contracts.replica_sync import replica_sync_from_json
from arceus.data.sizes import train_samples_estimate
from arceus.errors import SpecError
from arceus.model.expected_state import optimizer_kind
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import Budget, Placement, PlacementError, solve
from arceus.swarm.model import Workload as SwarmWorkload
from arceus.swarm.model import samples_per_second
from controlplane.common.conditions import TRUE
from controlplane.common.errors import ApplicationError
from controlplane.controller.actions import PlannedStage
from controlplane.controller.calibration import Calibration, calibration
from controlplane.controller.diversity import diverse_placement
from controlplane.controller.placement import requirements, tensor_parallel_split, workload
from controlplane.controller.rules import (
    replica_share,
    replicas_grown,
    replicas_placed,
    share_note,
    swarm_workload,
)
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.controller.views import JobView, NodeView, PlacedStage, stage_bounds
from controlplane.jobs.models import EstimateStatus, JobEstimate, Stage
from controlplane.jobs.services import job_validate
from controlplane.nodes.labels import OTHERS_NODE
from controlplane.nodes.models import Node

log = logging.getLogger(__name__)


def estimate_run(*, estimate_id: str) -> None:
    """Compute a pending estimate and store its answer; one already answered is left as it is."""
    estimate = JobEstimate.objects.filter(pk=estimate_id, status=EstimateStatus.PENDING).first()
    if estimate is None:
        return
    now = timezone.now()
    try:
        result, error = job_estimate(**estimate.request, owner_id=estimate.owner_id, now=now), ""
    except (ApplicationError, SpecError) as exc:  # the world changed since the request was checked
        result, error = None, str(exc)
    except Exception:
        log.exception("estimate %s failed", estimate_id)
        result, error = None, f"the estimate failed on the server; ask again, or report estimate {estimate_id}"
    JobEstimate.objects.filter(pk=estimate.pk, status=EstimateStatus.PENDING).update(
        status=EstimateStatus.FAILED if error else EstimateStatus.DONE,
        result=result,
        error=error,
        finished_at=timezone.now(),
    )


def job_estimate(
    *,
    model_config: dict[str, Any],
    dataset_config: dict[str, Any],
    epochs: int,
    micro_batches: int,
    schedule: str,
    stages: int | None,
    requirements_config: dict[str, Any],
    owner_id: int,
    now: datetime,
    optimizer: str,
    momentum: float,
    precision: str,
    activation_checkpointing: bool,
    tensor_parallel: dict[str, Any] | None = None,
    replicas: dict[str, int] | None = None,
    replica_sync: dict[str, Any] | None = None,
    staleness: int = 0,
) -> dict[str, Any]:
    """Plan the job on the free Ready nodes as the reconciler would, and price it at the posted prices.
    A job that cannot be placed now is answered with `feasible: false` and the reason. Only the owner's own
    nodes are named in the stages; another contributor's node is `OTHERS_NODE`, without its id. A replicated
    job is planned with `replicas.min` replicas of each stage (one copy of the pipeline within its share of the price
    cap, the others within the rest), its speed from the swarm model (arceus.swarm.model, the exchange every
    `replica_sync.every_steps` steps) and its price every replica's node's; `grown`: with `replicas.max` above its
    min, what the reconciler would grow it to on the nodes left free (`replicas_grown`), or None."""
    tensor_parallel = tensor_parallel or {}
    count, top = (replicas or {"min": 1, "max": 1})["min"], (replicas or {"min": 1, "max": 1})["max"]
    sync_every = replica_sync_from_json(replica_sync).every_steps
    spec, _, dataset = job_validate(
        model_config=model_config,
        dataset_config=dataset_config,
        stages=stages,
        requirements=requirements_config,
        tensor_parallel=tensor_parallel,
    )
    req = requirements(requirements_config)
    split = tensor_parallel_split(tensor_parallel)
    fewest, most = stage_bounds(stages, req, split)
    busy = {str(node_id) for node_id in Stage.objects.filter(active=True).values_list("node_id", flat=True)}
    candidates = [
        n
        for n in node_views(registered_nodes(), now)
        if n.ready_status == TRUE and not n.paused and n.id not in busy and req.allows(n)
        and (n.exchange_reachable or top == 1)  # as the reconciler places replicas (rules._takes)
    ]
    own = {str(i) for i in Node.objects.filter(owner_id=owner_id).values_list("id", flat=True)}
    named = {n.id: (n.id, n.name) if n.id in own else (None, OTHERS_NODE) for n in candidates}
    answer: dict[str, Any] = {
        "feasible": False, "reason": None, "candidates": len(candidates), "stages": [], "cut_short": False,
        "replicas": count, "grown": None,
    }
    candidates.sort(key=lambda n: (-n.flops, n.price_per_hour, n.id))  # the reconciler's order
    layers = layer_profiles(spec)
    steps = workload(  # the memory the job's stages would train with, as the reconciler plans it (snapshot._job_view)
        dataset, micro_batches, schedule, optimizer=optimizer_kind(optimizer, momentum),
        activation_checkpointing=activation_checkpointing, precision=precision, staleness=staleness,
    )

    def solve_on(nodes: Sequence[NodeView], least: int) -> Placement:
        return solve(
            layers,
            [n.device() for n in nodes],
            steps,
            min_stages=least,
            max_stages=most,
            max_price_per_hour=replica_share(req, count),
            tensor_parallel=split.size,
            split_stages=split.stages,
            budget=Budget(settings.ARCEUS_SOLVER_SECONDS),
        )

    try:
        # As the reconciler places it: unless it opts out, no single owner holds every stage.
        placement = (diverse_placement(candidates, fewest, most, solve_on) if req.owner_diversity
                     else solve_on(candidates, fewest))
    except PlacementError as exc:
        answer["reason"] = str(exc) + share_note(req, count)
        return answer
    rows = tuple(
        PlannedStage(index=i, layer_start=s.layer_start, layer_end=s.layer_end, node_id=node_id, rank=rank)
        for i, s in enumerate(placement.stages)
        for rank, node_id in enumerate(s.device_ids)
    )
    seconds = {(i, rank, 0): s.seconds_per_micro_batch for i, s in enumerate(placement.stages)
               for rank in range(len(s.device_ids))}
    speed, price = placement.samples_per_second, placement.price_per_hour
    by_id = {n.id: n for n in candidates}
    bounds = [(s.layer_start, s.layer_end) for s in placement.stages]
    swarm_steps = swarm_workload([layers[start:end] for start, end in bounds], steps, sync_every)

    def running(placed: Sequence[PlannedStage]) -> JobView:
        """The job as the reconciler would see it running on `placed`."""
        return JobView(
            id="estimate", status="running", generation=1, stages_requested=len(bounds), layers=tuple(layers),
            workload=steps, requirements=req, replicas_min=count, replicas_max=top, next_replica=count,
            replica_sync_every=sync_every,
            stages=tuple(PlacedStage(r.index, r.layer_start, r.layer_end, r.node_id, 1, replica=r.replica)
                         for r in placed),
        )

    if count > 1:
        replicated = replicas_placed(rows, candidates, layers=layers, workload=steps, requirements=req, count=count)
        if isinstance(replicated, str):
            answer["reason"] = replicated
            return answer
        rows, view = replicated, running(replicated)
        # the nodes' speeds as the reconciler sees them for the job (none timed yet: their market figures)
        speeds = calibration(view, by_id)
        speed = _swarm_speed(view, speeds, by_id, swarm_steps)
        price = sum(by_id[r.node_id].price_per_hour for r in rows)
        seconds = {(r.index, r.rank, r.replica): speeds.replica(by_id[r.node_id], r.index,
                                                                 layers[r.layer_start : r.layer_end])
                   .seconds_per_sample * steps.micro_batch_size for r in rows}
    train_samples = train_samples_estimate(dataset)
    if top > count:
        used = {r.node_id for r in rows}
        grown = replicas_grown(running(rows), by_id, [n for n in candidates if n.id not in used], now)
        if len(grown.stages) > len(rows):
            grown_speed = _swarm_speed(grown, calibration(grown, by_id), by_id, swarm_steps)
            grown_price = sum(by_id[r.node_id].price_per_hour for r in grown.stages)
            grown_hours = epochs * train_samples / grown_speed / 3600
            answer["grown"] = {
                "replicas": [sum(1 for r in grown.stages if r.index == i) for i in range(len(bounds))],
                "samples_per_second": grown_speed,
                "price_per_hour": grown_price,
                "hours": grown_hours,
                "total_usd": Decimal(str(round(grown_price * grown_hours, 6))),
            }
    hours = epochs * train_samples / speed / 3600
    total = Decimal(str(round(price * hours, 6)))
    deadline = requirements_config.get("deadline")
    answer.update(
        feasible=True,
        cut_short=placement.cut_short,
        stages=[
            {
                "stage_index": r.index,
                "rank": r.rank,
                "replica": r.replica,
                "node_id": named[r.node_id][0],
                "node_name": named[r.node_id][1],
                "layer_start": r.layer_start,
                "layer_end": r.layer_end,
                "seconds_per_micro_batch": seconds[(r.index, r.rank, r.replica)],
            }
            for r in rows
        ],
        samples_per_second=speed,
        hours=hours,
        price_per_hour=price,
        total_usd=total,
        within_budget=None if "max_total_usd" not in requirements_config
        else float(total) <= requirements_config["max_total_usd"],
        meets_deadline=None if deadline is None
        else now.timestamp() + hours * 3600 <= datetime.fromisoformat(deadline).timestamp(),
    )
    return answer


def _swarm_speed(
    job: JobView, speeds: Calibration, by_id: dict[str, NodeView], swarm_steps: SwarmWorkload
) -> float:
    """Samples/s of the job's replicated stages on their rows' nodes, each at its speed for the job, by the swarm
    model."""
    stages = sorted({s.index for s in job.stages})
    swarm = [[speeds.replica(by_id[s.node_id], i, job.layers[s.layer_start : s.layer_end])
              for s in job.stages if s.index == i and s.node_id is not None] for i in stages]
    return samples_per_second(swarm, swarm_steps)
