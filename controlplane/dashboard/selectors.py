"""What the dashboard's live views show, composed from the apps' own selectors and serializers (no business
rule of its own): a job as the API details it plus its pipeline's bubble, speed, ETA and timeline; a
contributor's nodes with their status and earnings; the market's prices and their history."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from arceus.contracts.status import TERMINAL_STATUSES, JobStatus
from arceus.errors import SpecError
from arceus.model.registry import architecture_of, model_spec_from_config
from controlplane.jobs.models import Job, StageContribution
from controlplane.jobs.selectors import job_list_for_user, job_stages, stage_activity, stage_shares
from controlplane.jobs_api.serializers import JobDetailOutput, JobListOutput
from controlplane.market.models import PriceChange, SpotCheck
from controlplane.market.selectors import job_cost, node_earnings, prices_current
from controlplane.market.serializers import EarningsOutput, JobCostOutput, PriceOutput
from controlplane.nodes.labels import node_label
from controlplane.nodes.models import Node
from controlplane.nodes.selectors import node_list_for_user, node_status
from controlplane.nodes.serializers import NodeOutput

MAX_JOBS_LISTED = 200
MAX_EVENTS = 200
PRICE_HISTORY_DAYS = 7
MAX_PRICE_POINTS = 2000


def dashboard_jobs(*, user: AbstractBaseUser) -> list[dict[str, Any]]:
    """The user's newest jobs with their progress and cost so far (the API's list, plus the cost)."""
    jobs = list(job_list_for_user(user=user)[:MAX_JOBS_LISTED])
    rows = JobListOutput(jobs, many=True).data
    for row, job in zip(rows, jobs, strict=True):
        row["cost"] = JobCostOutput(job_cost(job=job)).data
    return rows


def dashboard_job(*, job: Job) -> dict[str, Any]:
    """The job as GET /api/jobs/<id> details it, with what the live view adds: tokens/s and perplexity for a
    text model, the time left, each stage's compute and wait per step against the schedule's ideal bubble,
    and the job's timeline."""
    detail = JobDetailOutput(job).data
    writes_text, positions = _text_positions(job)
    speed = job.samples_per_second
    detail["cancellable"] = job.status not in TERMINAL_STATUSES
    detail["writes_text"] = writes_text
    detail["tokens_per_second"] = speed * positions if writes_text and speed else None
    detail["perplexity"] = math.exp(job.val_loss) if writes_text and job.val_loss is not None else None
    detail["eta_seconds"] = detail["cost"]["remaining_seconds"]
    detail["pipeline"] = _pipeline(job)
    detail["events"] = job_events(job=job)
    return detail


def _text_positions(job: Job) -> tuple[bool, int]:
    """Whether the job's model writes text, and the tokens (loss terms) per sample."""
    try:
        spec = model_spec_from_config(job.model_config)
    except SpecError:
        return False, 1
    return architecture_of(spec).writes_text, math.prod(spec.label_layout().shape)


def _pipeline(job: Job) -> dict[str, Any]:
    """Stage by stage (a replicated stage replica by replica: its id, what it does (joining, fenced, training, leaving),
    its share of the step's micro-batches and its measured speed, the micro-batches it processed): layers, node,
    device, whether it is reached through a relay, time computing and waiting per step (measured by the agents),
    bytes sent; each stage's replica count; with the schedule's ideal bubble (p-1)/(m+p-1) for p stages and m
    micro-batches."""
    rows = list(job_stages(job=job).filter(active=True) or job_stages(job=job))
    p, m = len({r.index for r in rows}), job.micro_batches
    running = job.status == JobStatus.RUNNING
    shares = stage_shares(rows)
    stages = []
    for r in rows:
        compute, wait = r.step_compute_seconds, r.step_wait_seconds
        busy = (compute or 0.0) + (wait or 0.0)
        stages.append({
            "stage_index": r.index,
            "rank": r.rank,
            "replica": r.replica if job.replicated else None,
            "joining": r.joining,
            "activity": stage_activity(r, running=running),
            "fenced_until_step": r.fenced_until_step,
            "fences": r.fences,
            "share": shares[r.pk],
            "samples_per_second": r.step_samples_per_second,
            "micro_batches": r.micro_batches,
            "layer_start": r.layer_start,
            "layer_end": r.layer_end,
            "node_name": _label(r.node, job) if r.node else None,
            "device": f"{r.node.device_type} {r.node.device_name}".strip() if r.node else None,
            "relayed": r.node is not None and r.node.relayed,  # its links run through a relay
            "state": r.observed_state,
            "generation": r.generation,
            "step_compute_seconds": compute,
            "step_wait_seconds": wait,
            "bubble": wait / busy if wait is not None and busy > 0 else None,
            "bytes_sent": r.bytes_sent,
        })
    replicas = [sum(1 for r in rows if r.index == i and r.rank == 0) for i in sorted({r.index for r in rows})]
    return {
        "schedule": job.schedule,
        "micro_batches": m,
        "ideal_bubble": (p - 1) / (m + p - 1) if p else None,
        "transfer": job.transfer,
        "replicas": {"min": job.replicas_min, "max": job.replicas_max, "per_stage": replicas,
                     "training": sum(1 for s in stages if s["activity"] == "training" and s["rank"] == 0)},
        "stages": stages,
    }


def job_events(*, job: Job) -> list[dict[str, Any]]:
    """The job's timeline, newest first, from what the models record: its conditions' transitions (placed,
    training, failed...), each stage's node per generation (so a stage that moved), checkpoints and resumes,
    and spot checks passed and failed."""
    events: list[dict[str, Any]] = []
    for c in job.conditions:
        events.append({"at": c["last_transition_time"], "kind": "condition",
                       "text": f"{c['type']} {c['status']}: {c['reason']} {c.get('message', '')}".strip()})
    hosts: dict[int, str] = {}
    generation_began: dict[int, datetime] = {}
    for row in StageContribution.objects.filter(job=job).select_related("node").order_by("generation", "created_at"):
        generation_began.setdefault(row.generation, row.created_at)
        before = hosts.get(row.stage_index)
        host = _label(row.node, job)
        # (a replicated stage's nodes are its replicas, whose comings and goings its Replicas condition tells)
        if before is not None and before != host and job.replicas_max == 1:
            events.append({"at": row.created_at, "kind": "moved",
                           "text": f"stage {row.stage_index} moved from {before} to {host} "
                                   f"(generation {row.generation})"})
        hosts[row.stage_index] = host
    for cp in job.checkpoints.order_by("-step")[:MAX_EVENTS]:
        events.append({"at": cp.created_at, "kind": "checkpoint", "text": f"checkpoint at step {cp.step}"})
    if job.resume_checkpoint is not None:  # the current generation's: when its first work was recorded
        events.append({"at": generation_began.get(job.generation, job.started_at), "kind": "resumed",
                       "text": f"resumed from the checkpoint of step {job.resume_checkpoint.step}"})
    for check in SpotCheck.objects.filter(job=job).select_related("node").order_by("-created_at")[:MAX_EVENTS]:
        events.append({"at": check.created_at, "kind": "spot_check_passed" if check.passed else "spot_check_failed",
                       "text": f"spot check of stage {check.stage_index} on {_label(check.node, job)} at step "
                               f"{check.train_step}: {'passed' if check.passed else 'FAILED'}"})
    events = [e for e in events if e["at"] is not None]
    events.sort(key=lambda e: _when(e["at"]), reverse=True)
    return [{**e, "at": _when(e["at"]).isoformat()} for e in events[:MAX_EVENTS]]


def _label(node: Node, job: Job) -> str:
    return node_label(node_id=node.id, name=node.name, owner_id=node.owner_id, viewer_id=job.owner_id)


def _when(value: datetime | str) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


def dashboard_nodes(*, user: AbstractBaseUser) -> list[dict[str, Any]]:
    """The user's nodes as the API shows them, each with its status word, its measured links to pipeline
    neighbours and its earnings (per day and per job)."""
    nodes = list(node_list_for_user(user=user).prefetch_related("links_out__to_node"))
    rows = NodeOutput(nodes, many=True).data
    now = timezone.now()
    for row, node in zip(rows, nodes, strict=True):
        row["status"] = node_status(node, now)
        row["neighbour_links"] = [
            {"to": link.to_node.name, "rtt_seconds": link.rtt_seconds,
             "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second}
            for link in node.links_out.all()
        ]
        row["earnings"] = EarningsOutput(node_earnings(node=node)).data
    return rows


def dashboard_market() -> dict[str, Any]:
    """The prices in force per device class and each class's posted prices over the last days."""
    since = timezone.now() - timedelta(days=PRICE_HISTORY_DAYS)
    changes = PriceChange.objects.filter(created_at__gte=since).order_by("-created_at")[:MAX_PRICE_POINTS]
    history: dict[str, list[dict[str, Any]]] = {}
    for change in reversed(list(changes)):
        history.setdefault(change.device_class, []).append(
            {"at": change.created_at.isoformat(), "price_per_hour": change.price_per_hour}
        )
    return {"prices": PriceOutput(prices_current(), many=True).data, "history": history}

