"""`job_estimate`: before submitting, what a job would get now: its placement, speed, time and price."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from arceus.data import load_dataset
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import PlacementError, solve
from controlplane.common.conditions import TRUE
from controlplane.controller.placement import requirements, tensor_parallel_split, workload
from controlplane.controller.rules import stage_bounds
from controlplane.controller.snapshot import node_views, registered_nodes
from controlplane.jobs.models import Stage
from controlplane.jobs.services import job_validate


def job_estimate(
    *,
    model_config: dict[str, Any],
    dataset_config: dict[str, Any],
    epochs: int,
    micro_batches: int,
    stages: int | None,
    requirements_config: dict[str, Any],
    now: datetime,
    tensor_parallel: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan the job on the free Ready nodes as the reconciler would, and price it at the posted prices.
    A job that cannot be placed now is answered with `feasible: false` and the reason."""
    tensor_parallel = tensor_parallel or {}
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
    ]
    names = {n.id: n.name for n in candidates}
    answer: dict[str, Any] = {"feasible": False, "reason": None, "candidates": len(candidates), "stages": []}
    try:
        placement = solve(
            layer_profiles(spec),
            [n.device() for n in candidates],
            workload(dataset, micro_batches),
            min_stages=fewest,
            max_stages=most,
            max_price_per_hour=req.max_price_per_hour,
            tensor_parallel=split.size,
            split_stages=split.stages,
        )
    except PlacementError as exc:
        answer["reason"] = str(exc)
        return answer
    train_samples = len(load_dataset(dataset)[0])
    hours = epochs * train_samples / placement.samples_per_second / 3600
    total = Decimal(str(round(placement.price_per_hour * hours, 6)))
    deadline = requirements_config.get("deadline")
    answer.update(
        feasible=True,
        stages=[
            {
                "stage_index": i,
                "rank": rank,
                "node_id": node_id,
                "node_name": names[node_id],
                "layer_start": s.layer_start,
                "layer_end": s.layer_end,
                "seconds_per_micro_batch": s.seconds_per_micro_batch,
            }
            for i, s in enumerate(placement.stages)
            for rank, node_id in enumerate(s.device_ids)
        ],
        samples_per_second=placement.samples_per_second,
        hours=hours,
        price_per_hour=placement.price_per_hour,
        total_usd=total,
        within_budget=None if "max_total_usd" not in requirements_config
        else float(total) <= requirements_config["max_total_usd"],
        meets_deadline=None if deadline is None
        else now.timestamp() + hours * 3600 <= datetime.fromisoformat(deadline).timestamp(),
    )
    return answer
