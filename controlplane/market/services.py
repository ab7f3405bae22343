"""Pricing and the ledger: repricing from demand and supply, recording priced work, hourly rollups."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Max, Q, Sum
from django.db.models.functions import TruncHour

from arceus.contracts.counters import StageCounters
from arceus.contracts.status import ACTIVE_STATUSES, JobStatus
from controlplane.jobs.models import Job
from controlplane.market.models import LedgerEntry, LedgerHourly, PriceChange
from controlplane.market.pricing import PricingPolicy, base_price, next_price
from controlplane.nodes.device_class import device_class, market_flops, node_device_class
from controlplane.nodes.models import Node, ReadyStatus

MICROS_PER_DOLLAR = 1_000_000
# How far back each rollup pass looks: the hour that just ended is always rebuilt once it is complete.
ROLLUP_WINDOW = timedelta(hours=2)


def pricing_policy() -> PricingPolicy:
    return PricingPolicy(baseline_per_hour=settings.ARCEUS_BASELINE_PRICE_PER_HOUR)


def price_in_force(device_class_name: str) -> float:
    """The newest posted price of the class, else its base price (nothing posted yet)."""
    latest = PriceChange.objects.filter(device_class=device_class_name).order_by("-created_at").first()
    return latest.price_per_hour if latest else base_price(device_class_name, pricing_policy())


def job_budget_micros(requirements: dict[str, Any]) -> int | None:
    """A job's `max_total_usd` in whole micro-dollars (rounded down: never charged past it); None: no cap."""
    cap = requirements.get("max_total_usd")
    return None if cap is None else math.floor(cap * MICROS_PER_DOLLAR)


def market_demand_and_supply() -> tuple[float, float]:
    """Demand: devices that queued and active jobs want (their requested stages, else one). Supply:
    registered Ready nodes whose owners have not paused them."""
    jobs = Job.objects.filter(status__in=(JobStatus.QUEUED, *ACTIVE_STATUSES)).annotate(
        placed=Count("stages", filter=Q(stages__active=True))
    )
    # Two numbers per job, not model instances: a thousand running jobs' rows cost the control worker a second.
    demand = sum(requested or placed or 1 for requested, placed in jobs.values_list("stages_requested", "placed"))
    supply = Node.objects.filter(
        registered_at__isnull=False, ready_status=ReadyStatus.TRUE, paused=False
    ).count()
    return float(demand), float(supply)


@transaction.atomic
def prices_reprice() -> list[PriceChange]:
    """Post a new price for every class of registered device whose price moves (every change is kept)."""
    policy = pricing_policy()
    demand, supply = market_demand_and_supply()
    # Each distinct (declared, measured, memory) once, not 10,000 node instances (the control worker's, every 30 s).
    classes = {
        device_class(market_flops(declared, measured), memory or 0)
        for declared, measured, memory in Node.objects.filter(registered_at__isnull=False)
        .values_list("flops_fp32", "flops_measured", "memory_bytes").distinct()
    }
    classes |= set(PriceChange.objects.values_list("device_class", flat=True).distinct())
    changes = []
    for name in sorted(classes):
        previous = PriceChange.objects.filter(device_class=name).order_by("-created_at").first()
        price = next_price(name, demand, supply, previous.price_per_hour if previous else None, policy)
        if previous is None or not math.isclose(price, previous.price_per_hour, rel_tol=1e-9):
            changes.append(PriceChange(device_class=name, price_per_hour=price, demand=demand, supply=supply))
    return PriceChange.objects.bulk_create(changes)


def ledger_record_work(
    *, job_id: Any, generation: int, node: Node, counters: StageCounters, flops_per_sample: float, step: int,
    held_since: datetime, now: datetime, budget_micros: int | None = None,
) -> LedgerEntry | None:
    """Append what the node did since its previous entry for this stage generation (`LedgerBook.record_work`, on
    the job's ledger read now), and save it. Call inside the recording transaction."""
    book = ledger_book(job_ids=[job_id])
    entry = book.record_work(
        job_id=job_id, generation=generation, node=node, counters=counters, flops_per_sample=flops_per_sample,
        step=step, held_since=held_since, now=now, budget_micros=budget_micros,
    )
    book.save()
    return entry


# The sums of a stage generation's entries on one node (not its reversals) that pricing the next entry needs.
_DONE_FIELDS = ("samples", "micro_batches", "compute_seconds", "bytes_sent", "bytes_received", "charge_micros",
                "fee_micros")


@dataclass
class _Done:
    dollar_seconds_per_hour: float = 0.0
    samples: int = 0
    micro_batches: int = 0
    compute_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    charge_micros: int = 0
    fee_micros: int = 0


@dataclass
class LedgerBook:
    """Some jobs' ledgers as far as pricing their next entries needs (`ledger_book`: one query for all of them),
    kept current in memory as entries are priced, so that many reports are priced in one transaction exactly as
    one at a time would be; `save` writes the new entries in one INSERT. Prices are read once per device class."""

    done: dict[tuple[UUID, int, int, UUID], _Done]  # (job, stage, generation, node) → its entries' sums
    billed_until: dict[tuple[UUID, UUID], datetime]  # (job, node) → the end of its latest entry's held time
    charged: dict[UUID, int]  # job → its charges, reversals included
    prices: dict[str, float] = field(default_factory=dict)
    entries: list[LedgerEntry] = field(default_factory=list)

    def record_work(
        self, *, job_id: Any, generation: int, node: Node, counters: StageCounters, flops_per_sample: float,
        step: int, held_since: datetime, now: datetime, budget_micros: int | None = None,
    ) -> LedgerEntry | None:
        """Price what the node did since its previous entry for this stage generation, up to training step
        `step` (the job's), as a new entry (saved by `save`). The job pays for every second it held the device,
        from the later of `held_since` (when its stage was placed on the node) and the end of the node's previous
        entry on the job, until `now`, at the price in force of the class the node measured (`node_device_class`:
        a device slower than it claimed is paid as what it delivered); the node's owner earns that less the
        platform fee. Reports that add no samples (retries, late duplicates, a restarted driver's replay within one
        generation) add nothing: their time is billed with the next entry. A job's charges never pass
        `budget_micros` (its `max_total_usd`): an entry that would is cut to what is left.

        Money is whole micro-dollars, but one report's work may be worth a fraction of one: each entry charges
        the rounded running total of the exact value minus what earlier entries charged, and the fee of the
        running total minus earlier fees, so rounding never drifts however small and frequent the reports."""
        job, node_key = UUID(str(job_id)), UUID(str(node.pk))
        done = self.done.setdefault((job, counters.index, generation, node_key), _Done())
        samples = counters.samples - done.samples
        if samples <= 0:
            return None
        billed_until = self.billed_until.get((job, node_key))
        held_from = max(held_since, billed_until) if billed_until is not None else held_since
        held = max(0.0, (now - held_from).total_seconds())
        klass = node_device_class(node)
        price = self.price_per_hour(node)
        exact_total = (done.dollar_seconds_per_hour + held * price) / 3600 * MICROS_PER_DOLLAR
        charge_total = round(exact_total)
        charge = charge_total - done.charge_micros
        if budget_micros is not None:
            charge = min(charge, max(0, budget_micros - self.charged.get(job, 0)))
        # Never more fee than this entry's charge (no negative credit); a shortfall is made up by later entries.
        fee = min(charge, round(charge_total * settings.ARCEUS_PLATFORM_FEE) - done.fee_micros)
        entry = LedgerEntry(
            job_id=job_id, stage_index=counters.index, generation=generation, node=node,
            samples_total=counters.samples, step=step, samples=samples,
            micro_batches=counters.micro_batches - done.micro_batches,
            compute_seconds=max(0.0, counters.compute_seconds - done.compute_seconds),
            held_seconds=held, held_until=max(now, held_from),
            # Forward plus a backward of about twice its cost.
            flops=3.0 * samples * flops_per_sample,
            bytes_sent=counters.bytes_sent - done.bytes_sent,
            bytes_received=counters.bytes_received - done.bytes_received,
            device_class=klass, price_per_hour=price, charge_micros=charge, fee_micros=fee,
            credit_micros=charge - fee,
            # A flagged node's work is unverified: recorded and charged, but its credit is not paid out.
            withheld=node.flagged_at is not None,
        )
        self.entries.append(entry)
        done.dollar_seconds_per_hour += held * price
        for name in _DONE_FIELDS:
            setattr(done, name, getattr(done, name) + getattr(entry, name))
        self.billed_until[(job, node_key)] = entry.held_until
        self.charged[job] = self.charged.get(job, 0) + charge
        return entry

    def price_per_hour(self, node: Node) -> float:
        """The price in force of the class the node measured (read once per class)."""
        klass = node_device_class(node)
        if klass not in self.prices:
            self.prices[klass] = price_in_force(klass)
        return self.prices[klass]

    def charged_micros(self, job_id: Any) -> int:
        """What the job was charged, the entries priced in this book included."""
        return self.charged.get(UUID(str(job_id)), 0)

    def save(self) -> None:
        LedgerEntry.objects.bulk_create(self.entries)
        self.entries = []


def ledger_book(*, job_ids: Collection[Any]) -> LedgerBook:
    """The jobs' ledgers as pricing their next entries needs them (one query). Call inside the recording
    transaction, holding the jobs' rows."""
    not_reversal = Q(reverses__isnull=True)
    rows = (
        LedgerEntry.objects.filter(job_id__in=list(job_ids))
        .values("job_id", "stage_index", "generation", "node_id")
        .annotate(
            # First: a later alias named like a field would shadow the field in F().
            done_dollar_seconds_per_hour=Sum(F("held_seconds") * F("price_per_hour"), filter=not_reversal),
            **{f"done_{name}": Sum(name, filter=not_reversal) for name in _DONE_FIELDS},
            done_until=Max("held_until", filter=not_reversal),
            all_charge_micros=Sum("charge_micros"),
        )
        .order_by()
    )
    book = LedgerBook(done={}, billed_until={}, charged={})
    for row in rows:
        job, node = row["job_id"], row["node_id"]
        book.done[(job, row["stage_index"], row["generation"], node)] = _Done(
            row["done_dollar_seconds_per_hour"] or 0.0, *(row[f"done_{name}"] or 0 for name in _DONE_FIELDS)
        )
        if (until := row["done_until"]) is not None:
            book.billed_until[(job, node)] = max(until, book.billed_until.get((job, node), until))
        book.charged[job] = book.charged.get(job, 0) + (row["all_charge_micros"] or 0)
    return book


def ledger_roll_back(*, job_id: Any, after_step: int, culprits: Collection[Any]) -> int:
    """The job went back to its checkpoint of step `after_step` (or ended there): its work recorded on later
    steps is lost, and is trained again if the job goes on. The job's owner is never charged twice for a step,
    so each such entry not yet reversed gets a reversal refunding its charge. A node that did the work keeps
    its credit, paid by the platform (the reversal's fee is minus the charge), unless it is one of `culprits`,
    the nodes whose restart or cheat caused the rollback: it loses the credit too. Call inside the rewinding
    transaction. Returns how many entries were reversed."""
    blamed = {str(node_id) for node_id in culprits}
    reversals = []
    for entry in LedgerEntry.objects.filter(
        job_id=job_id, step__gt=after_step, reverses__isnull=True, reversal__isnull=True
    ):
        credit = -entry.credit_micros if str(entry.node_id) in blamed else 0
        reversals.append(
            LedgerEntry(
                job_id=entry.job_id, node_id=entry.node_id, stage_index=entry.stage_index,
                generation=entry.generation, step=entry.step, samples_total=entry.samples_total,
                samples=0, micro_batches=0, compute_seconds=0.0, held_seconds=0.0, flops=0.0, bytes_sent=0,
                bytes_received=0,
                device_class=entry.device_class, price_per_hour=entry.price_per_hour,
                charge_micros=-entry.charge_micros, fee_micros=-entry.charge_micros - credit, credit_micros=credit,
                withheld=entry.withheld, reverses=entry,
            )
        )
    LedgerEntry.objects.bulk_create(reversals)
    return len(reversals)


def ledger_withhold(*, job_id: Any, node: Node) -> int:
    """Withhold the credit of every entry of the node's work on the job (a spot check caught it wrong);
    charges and fees stay, so credits + fees + withheld = charges. Returns the entries changed."""
    return LedgerEntry.objects.filter(job_id=job_id, node=node, withheld=False).update(withheld=True)


@transaction.atomic
def ledger_rollup(*, since: datetime) -> int:
    """Rebuild the hourly sums of every hour from `since` (rounded down to the hour); idempotent.
    Returns how many (job, node, hour) rows were written."""
    start = since.replace(minute=0, second=0, microsecond=0)
    rows = (
        LedgerEntry.objects.filter(created_at__gte=start)
        .annotate(hour=TruncHour("created_at"))
        .values("job_id", "node_id", "hour")
        .annotate(
            samples=Sum("samples"),
            compute_seconds=Sum("compute_seconds"),
            charge_micros=Sum("charge_micros"),
            fee_micros=Sum("fee_micros"),
            paid=Sum("credit_micros", filter=Q(withheld=False), default=0),
            held=Sum("credit_micros", filter=Q(withheld=True), default=0),
        )
    )
    hourly = [
        LedgerHourly(credit_micros=row.pop("paid"), withheld_micros=row.pop("held"), **row) for row in rows
    ]
    LedgerHourly.objects.bulk_create(
        hourly,
        update_conflicts=True,
        unique_fields=["job", "node", "hour"],
        update_fields=["samples", "compute_seconds", "charge_micros", "fee_micros", "credit_micros", "withheld_micros"],
    )
    return len(hourly)
