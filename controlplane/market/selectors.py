"""Reads for the market endpoints: prices in force, a node's earnings, a job's cost."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

from django.db.models import Q, Sum
from django.db.models.functions import TruncDate

from arceus.contracts.status import JobStatus
from controlplane.jobs.models import Job
from controlplane.market.models import LedgerEntry, PriceChange
from controlplane.market.pricing import base_price
from controlplane.market.services import MICROS_PER_DOLLAR, job_budget_micros, price_in_force, pricing_policy
from controlplane.nodes.device_class import node_device_class
from controlplane.nodes.models import Node, ReadyStatus


def dollars(micros: int | None) -> Decimal:
    return Decimal(micros or 0) / MICROS_PER_DOLLAR


def prices_current() -> list[dict[str, Any]]:
    """The price in force for every class that has one posted, or a registered device, and how many of its
    devices could take work now (Ready, not paused, flagged or leaving: what `DistributedTrainer.discover_peers`
    shows a developer, who may not see other owners' nodes one by one)."""
    policy = pricing_policy()
    latest: dict[str, PriceChange] = {}
    for change in PriceChange.objects.order_by("device_class", "-created_at"):
        latest.setdefault(change.device_class, change)
    ready: Counter[str] = Counter()
    classes = set(latest)
    for node in Node.objects.filter(registered_at__isnull=False):
        classes.add(name := node_device_class(node))
        if node.ready_status == ReadyStatus.TRUE and not (node.paused or node.flagged_at or node.leaving_at):
            ready[name] += 1
    rows = []
    for name in sorted(classes):
        change = latest.get(name)
        base = base_price(name, policy)
        rows.append(
            {
                "device_class": name,
                "price_per_hour": change.price_per_hour if change else base,
                "base_price_per_hour": base,
                "demand": change.demand if change else None,
                "supply": change.supply if change else None,
                "ready_nodes": ready[name],
                "updated_at": change.created_at if change else None,
            }
        )
    return rows


def node_earnings(*, node: Node) -> dict[str, Any]:
    """What the node's owner has earned (per second a job held the node, at the price in force), in total, per UTC
    day and per job, with the seconds held; credit withheld because a spot check caught the node's work wrong is not
    earned, and shown apart."""
    entries = LedgerEntry.objects.filter(node=node)
    sums = {
        "credit": Sum("credit_micros", filter=Q(withheld=False)),
        "samples": Sum("samples"),
        "compute_seconds": Sum("compute_seconds"),
        "held_seconds": Sum("held_seconds"),
    }
    total = entries.aggregate(**sums)
    per_day = entries.annotate(day=TruncDate("created_at")).values("day").annotate(**sums).order_by("day")
    per_job = entries.values("job_id", "job__name").annotate(**sums).order_by("job__name")
    return {
        "node_id": node.id,
        "device_class": node_device_class(node),
        "credit_usd": dollars(total["credit"]),
        "withheld_usd": dollars(entries.filter(withheld=True).aggregate(w=Sum("credit_micros"))["w"]),
        "samples": total["samples"] or 0,
        "compute_seconds": total["compute_seconds"] or 0.0,
        "held_seconds": total["held_seconds"] or 0.0,
        "per_day": [{**row, "credit_usd": dollars(row.pop("credit"))} for row in per_day],
        "per_job": [
            {"job_id": row["job_id"], "job_name": row["job__name"], "credit_usd": dollars(row["credit"]),
             "samples": row["samples"], "compute_seconds": row["compute_seconds"], "held_seconds": row["held_seconds"]}
            for row in per_job
        ],
    }


def job_cost(*, job: Job) -> dict[str, Any]:
    """What the job has been charged so far (per second each device was held, at the prices in force), the
    platform's share of it, and what is left of its `max_total_usd`; while it trains, also the time left at its
    current speed (the driver's wall clock per step: how long each step holds every device) and what that time
    costs at the posted prices of the nodes it holds: the basis its charges are on."""
    total = LedgerEntry.objects.filter(job=job).aggregate(
        charge=Sum("charge_micros"), fee=Sum("fee_micros"), withheld=Sum("credit_micros", filter=Q(withheld=True))
    )
    budget = job_budget_micros(job.requirements)
    cost: dict[str, Any] = {
        "charged_usd": dollars(total["charge"]),
        "platform_fee_usd": dollars(total["fee"]),
        "withheld_usd": dollars(total["withheld"]),
        "budget_usd": None if budget is None else dollars(budget),
        "budget_remaining_usd": None if budget is None else dollars(max(0, budget - (total["charge"] or 0))),
        "remaining_seconds": None,
        "estimate_to_finish_usd": None,
    }
    if job.status == JobStatus.RUNNING and job.samples_per_second and job.total_steps:
        samples_left = (job.total_steps - job.step) * job.dataset_config["batch_size"]
        seconds = samples_left / job.samples_per_second
        nodes = Node.objects.filter(stages__job=job, stages__active=True)
        per_hour = sum(price_in_force(node_device_class(node)) for node in nodes)
        cost["remaining_seconds"] = seconds
        cost["estimate_to_finish_usd"] = dollars(round(per_hour * seconds / 3600 * MICROS_PER_DOLLAR))
    return cost


def ledger_totals() -> dict[str, Decimal]:
    """The whole ledger in dollars by kind: charged to jobs' owners, the platform's fees, credit paid to nodes'
    owners, credit withheld (spot checks caught the work wrong). Reversals count negatively."""
    total = LedgerEntry.objects.aggregate(
        charged=Sum("charge_micros"),
        fees=Sum("fee_micros"),
        credited=Sum("credit_micros", filter=Q(withheld=False)),
        withheld=Sum("credit_micros", filter=Q(withheld=True)),
    )
    return {kind: dollars(micros) for kind, micros in total.items()}
