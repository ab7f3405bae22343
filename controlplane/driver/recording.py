"""Recording running jobs' progress in bulk: many jobs' reports (steps, the stages' counters billed to the ledger,
their time per step, the node speeds they give) in one transaction and a fixed number of queries, whatever the
number of jobs; one report costs the same queries. `job_record_steps` (controlplane/driver/progress.py) is a batch
of one.

A batch records exactly what its reports recorded one at a time, in order: the rows, the ledger's entries and their
amounts (priced in memory from one read of the jobs' ledgers, `LedgerBook`), and the node speeds a report measures,
seen by the reports after it. What a report leaves unchanged (a stage row's counters and times) is not rewritten.

The training drivers of one process record through one `ProgressRecorder` (`PROGRESS`): the reports their threads
flush at once are written as one batch (a group commit), however many drivers the process runs.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import F, Q
from django.utils import timezone

from arceus.contracts.counters import StageCounters
from arceus.contracts.status import JobStatus
from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config
from arceus.training.plan import StageTiming
from controlplane.common.db import rows_update
from controlplane.jobs.leases import renewed
from controlplane.jobs.models import Job, LossPoint, Stage, StageContribution
from controlplane.jobs.step_grant import GrantWindow, step_grant, step_seconds_of
from controlplane.market.services import MICROS_PER_DOLLAR, LedgerBook, job_budget_micros, ledger_book
from controlplane.nodes.models import Node

# The work a stage's agent counts, as stage rows, contributions and ledger entries store it.
COUNTER_FIELDS = ("samples", "micro_batches", "compute_seconds", "bytes_sent", "bytes_received")
TIMING_FIELDS = ("step_compute_seconds", "step_wait_seconds", "step_micro_batches", "step_samples_per_second")
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "last_loss", "samples_per_second")
# What recording needs of a job's row (and no more: its configuration's other fields are large).
JOB_FIELDS = (
    "id",
    "driver_lease_owner",
    "generation",
    "requirements",
    "model_config",
    "dataset_config",
    "handover_requested",
    "step_grant",
    *PROGRESS_FIELDS,
)
# What pricing and measuring need of a hosting node's row.
NODE_FIELDS = ("node__id", "node__flops_fp32", "node__flops_measured", "node__memory_bytes", "node__flagged_at")


@dataclass(frozen=True)
class StepPoint:
    epoch: int
    step: int
    total_steps: int
    loss: float
    samples_per_second: float


@dataclass(frozen=True)
class ProgressReport:
    """One running job's progress since its previous report, by the holder of its driver lease: its new steps (the
    newest becomes the job's progress), its stages' latest counters (cumulative within the generation) and their
    time per step."""

    job_id: Any
    lease_owner: str
    points: Sequence[StepPoint] = ()
    stages: Sequence[StageCounters] = ()
    timings: Sequence[StageTiming] = ()


@dataclass(frozen=True)
class Recorded:
    """A report written by the holder of its job's lease: the job's step grant as extended by it (its driver reports
    again before its steps reach it, controlplane/driver/sink.py)."""

    step_grant: int | None


@transaction.atomic
def jobs_record_progress(*, reports: Sequence[ProgressReport], now: datetime) -> list[Recorded | None]:
    """Record each report (at most one per job) as `job_record_steps` describes, all in one transaction, and renew
    the leases; for each report, its job's new grant, or None where its caller did not hold the job's lease (a report
    without it records nothing)."""
    keys = [Job._meta.pk.to_python(r.job_id) for r in reports]  # as the rows' ids, whatever form the callers use
    if len(set(keys)) != len(reports):
        raise ValueError("a batch holds at most one report per job")
    jobs = {
        job.pk: job
        for job in Job.objects.filter(pk__in=keys, status=JobStatus.RUNNING)
        .select_for_update(of=("self",))
        .only(*JOB_FIELDS)
        .order_by("pk")  # one lock order for every batch
    }
    held = [
        (r, job)
        for r, key in zip(reports, keys, strict=True)
        if (job := jobs.get(key)) is not None and job.driver_lease_owner == r.lease_owner
    ]
    if not held:
        return [None] * len(reports)
    recorder = _Recorder.of([job for _, job in held], now)
    for report, job in held:
        if report.points:
            last = report.points[-1]
            job.step, job.total_steps, job.epoch = last.step, last.total_steps, last.epoch
            job.last_loss, job.samples_per_second = finite(last.loss), finite(last.samples_per_second)
        recorder.losses(job, report.points)
        recorder.counters(job, report.stages)
        recorder.timings(job, report.timings)
    for _, job in held:
        job.driver_lease_expires_at = renewed(now)["driver_lease_expires_at"]
        job.step_grant = recorder.step_grant(job)
    rows_update(Job, [job for _, job in held], ["driver_lease_expires_at", "step_grant", *PROGRESS_FIELDS])
    recorder.save()
    recorded = {id(report): Recorded(job.step_grant) for report, job in held}
    return [recorded.get(id(r)) for r in reports]


class ProgressRecorder:
    """Writes the reports that threads of one process hand it together as one `jobs_record_progress` (a group
    commit). A caller blocks until its report is written and learns what a batch of one would tell it: its job's
    grant, None if it did not hold the lease, or the error. No thread of its own: the first caller to find no batch
    being written writes one of everything queued (one report per job; a job's later report waits for the next
    batch), then hands the writing to the first caller still queued. So a batch takes what arrived while the one
    before it was written, and one caller alone writes at once, as `job_record_steps` would.

    A database error (a lost connection, a deadlock) reaches every caller of its batch, each of which retries as
    it would its own write (the driver: `reconnecting`). Any other error may be one report's (a malformed one): the
    batch's reports are then written one at a time, so only the callers whose own report fails see it."""

    def __init__(self, write: Callable[..., list[Recorded | None]] = jobs_record_progress) -> None:
        self._write = write  # `jobs_record_progress` or a function of its signature
        self._lock = threading.Lock()
        self._queued: list[_Call] = []
        self._writing = False  # a caller writes a batch; while none does, nothing is queued

    def record(self, report: ProgressReport) -> Recorded | None:
        """Write `report` (with those of other threads that come meanwhile); None if its caller did not hold the
        lease."""
        call = _Call(report, Job._meta.pk.to_python(report.job_id))
        with self._lock:
            self._queued.append(call)
            call.leads = not self._writing
            self._writing = True
        if not call.leads:
            call.woken.wait()  # written, or handed the writing
        if call.leads:
            self._write_batch()
        if call.error is not None:
            raise call.error
        return call.recorded

    def _write_batch(self) -> None:
        with self._lock:
            batch, jobs, later = [], set(), []
            for queued in self._queued:  # the writer's own call is first: it queued when nothing else was
                (later if queued.job in jobs else batch).append(queued)
                jobs.add(queued.job)
            self._queued = later
        try:
            self._answer(batch)
        except BaseException as exc:  # interrupted (the worker stopping): nobody waits for a batch never written
            for c in batch:
                if not c.written and c.error is None:
                    c.error = exc
                c.woken.set()
            raise
        finally:
            with self._lock:
                if self._queued:  # the next batch is the first waiting caller's to write
                    self._queued[0].leads = True
                    self._queued[0].woken.set()
                else:
                    self._writing = False

    def _answer(self, batch: list[_Call]) -> None:
        try:
            held = self._write(reports=[c.report for c in batch], now=timezone.now())
        except (OperationalError, InterfaceError) as exc:
            for c in batch:
                c.error = exc
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
            else:
                for c in batch:
                    self._answer([c])
        else:
            for c, recorded in zip(batch, held, strict=True):
                c.written, c.recorded = True, recorded
        for c in batch:
            if not c.leads:
                c.woken.set()


@dataclass(eq=False)
class _Call:
    report: ProgressReport
    job: Any  # the report's job id, as the rows' ids
    leads: bool = False  # this caller writes the batch its report is in
    woken: threading.Event = field(default_factory=threading.Event)
    written: bool = False
    recorded: Recorded | None = None  # None: written, but its caller did not hold the lease
    error: BaseException | None = None


PROGRESS = ProgressRecorder()  # the process's: every training driver's sink records through it


def jobs_record_counters(*, jobs: Sequence[Job], stages: Sequence[Sequence[StageCounters]], now: datetime) -> None:
    """Store each job's stages' counters as a report does (stage rows, contributions, priced ledger entries); the
    caller holds the jobs' leases (an epoch's and the end's counters)."""
    recorder = _Recorder.of(jobs, now)
    for job, counters in zip(jobs, stages, strict=True):
        recorder.counters(job, counters)
    recorder.save()


@dataclass
class _Recorder:
    """The rows a batch reads (its jobs' active stages, their nodes, their ledgers) and the writes it collects."""

    now: datetime
    rows: dict[str, list[Stage]]  # job → its active stage rows, ordered as Stage's Meta orders them
    nodes: dict[Any, Node]  # one instance per node: a speed measured is seen by the reports after it
    book: LedgerBook
    points: list[LossPoint] = field(default_factory=list)
    changed: dict[tuple[str, ...], dict[Any, Stage]] = field(  # stage rows with new counters, with new times
        default_factory=lambda: {COUNTER_FIELDS: {}, TIMING_FIELDS: {}}
    )
    contributions: list[StageContribution] = field(default_factory=list)
    released: list[tuple[StageContribution, StageCounters]] = field(default_factory=list)
    measured: dict[Any, Node] = field(default_factory=dict)
    flops: dict[str, tuple[list[int], frozenset[int]] | None] = field(default_factory=dict)  # job → layer costs

    @classmethod
    def of(cls, jobs: Sequence[Job], now: datetime) -> _Recorder:
        by_id = {str(job.pk): job for job in jobs}
        rows: dict[str, list[Stage]] = {job_id: [] for job_id in by_id}
        nodes: dict[Any, Node] = {}
        for stage in (
            Stage.objects.filter(job_id__in=list(by_id), active=True)
            .select_related("node")
            .only(*(f.name for f in Stage._meta.concrete_fields), *NODE_FIELDS)
        ):
            stage.job = by_id[str(stage.job_id)]
            if stage.node is not None:
                stage.node = nodes.setdefault(stage.node.pk, stage.node)
            rows[str(stage.job_id)].append(stage)
        return cls(now=now, rows=rows, nodes=nodes, book=ledger_book(job_ids=list(by_id)))

    def losses(self, job: Job, points: Sequence[StepPoint]) -> None:
        self.points += [
            LossPoint(
                job_id=job.pk,
                step=p.step,
                epoch=p.epoch,
                loss=finite(p.loss),
                samples_per_second=finite(p.samples_per_second),
            )
            for p in points
        ]

    def counters(self, job: Job, stages: Sequence[StageCounters]) -> None:
        """The stages' counters on their stage rows, on each node's contribution row for this generation, and as
        priced ledger entries (the devices' time held until now). A replica dropped since (`contributions_release`)
        is billed on its contribution for the time it held its node until it was dropped; a fenced one for the time
        until its fence."""
        if not stages:
            return
        rows = self.rows[str(job.pk)]
        placed = {(s.index, str(s.node_id)): s for s in rows} | {(s.index, ""): s for s in rows if s.rank == 0}
        ranks = _group_ranks(rows)
        released = self._released(job, [s for s in stages if s.node_id and (s.index, s.node_id) not in placed])
        for s in stages:
            counters = {name: getattr(s, name) for name in COUNTER_FIELDS}
            stage = placed.get((s.index, s.node_id))
            if stage is None and (s.index, s.node_id) in released:
                contribution, sibling = released[(s.index, s.node_id)]
                self.released.append((contribution, s))
                self.book.record_work(
                    job_id=job.pk,
                    generation=contribution.generation,
                    node=contribution.node,
                    counters=s,
                    flops_per_sample=self._flops_per_sample(sibling, ranks[(sibling.index, sibling.replica)]),
                    step=job.step,
                    held_since=contribution.held_since,
                    now=min(self.now, contribution.released_at),
                    budget_micros=job_budget_micros(job.requirements),
                )
                continue
            if stage is None or stage.node is None:
                continue
            self._set(stage, COUNTER_FIELDS, counters)
            self.contributions.append(
                StageContribution(
                    job_id=job.pk, stage_index=s.index, generation=stage.generation, node_id=stage.node_id, **counters
                )
            )
            self.book.record_work(
                job_id=job.pk,
                generation=stage.generation,
                node=stage.node,
                counters=s,
                flops_per_sample=self._flops_per_sample(stage, ranks[(stage.index, stage.replica)]),
                step=job.step,  # already the newest recorded step: a rewind refunds what lies past its checkpoint
                held_since=stage.held_since,
                # a fenced replica's node is paid until its fence (`stage_record_fenced`), again from its rejoin
                now=self.now if stage.fenced_at is None else min(self.now, stage.fenced_at),
                budget_micros=job_budget_micros(job.requirements),
            )

    def timings(self, job: Job, timings: Sequence[StageTiming]) -> None:
        """Each stage's time per step (a replica's on its own row, by its node; a stage's on its rank 0's), and
        the speed of each hosting node as the driver measured it (`_measure_nodes`)."""
        rows = self.rows[str(job.pk)]
        for t in timings:
            values = {
                "step_compute_seconds": finite(t.compute_seconds),
                "step_wait_seconds": finite(t.wait_seconds),
                "step_micro_batches": finite(t.micro_batches) if t.micro_batches > 0 else None,
                "step_samples_per_second": (
                    finite(t.samples / t.compute_seconds) if t.samples > 0 and t.compute_seconds > 0 else None
                ),
            }
            for stage in rows:
                if stage.index == t.index and (str(stage.node_id) == t.node_id if t.node_id else stage.rank == 0):
                    self._set(stage, TIMING_FIELDS, values)
        self._measure_nodes(rows, timings)

    def _measure_nodes(self, rows: Sequence[Stage], timings: Sequence[StageTiming]) -> None:
        """Each hosting node's speed as the driver measured it (what the market prices and places it by): the FLOPs
        of the samples it ran in the step (a replica's own share, as the driver routed them; an unreplicated
        stage's, the batch) over the step's wall time on the driver's clock, the longest of the stages' calls. No
        node can shorten that time: a step ends only when every stage's forward and backward are done, so the
        figure is at most the node's real speed (its share of the pipeline's bubble counts against it), whatever
        the node reports."""
        wall = max((t.wall_seconds for t in timings if math.isfinite(t.wall_seconds)), default=0.0)
        if wall <= 0:
            return
        hosted = [s for s in rows if s.node is not None]
        ranks = _group_ranks(hosted)
        for t in timings:
            # a replica's timing is its own node's; a stage's (node_id ""), every rank's of its tensor-parallel group
            for stage in (s for s in hosted if s.index == t.index and t.node_id in ("", str(s.node_id))):
                samples = t.samples if t.samples > 0 else _batch_size(stage.job)
                per_step = 3.0 * samples * self._flops_per_sample(stage, ranks[(stage.index, stage.replica)])
                if per_step > 0:
                    stage.node.flops_measured, stage.node.flops_measured_at = per_step / wall, self.now
                    self.measured[stage.node.pk] = stage.node

    def step_grant(self, job: Job) -> int | None:
        """The job's grant extended past its progress as recorded now (controlplane/jobs/step_grant.py): frozen while
        a hand-over is asked or a node of it is flagged; cut to what its budget leaves at its devices' prices (the
        charges priced in this batch included) and to its deadline."""
        rows = [s for s in self.rows[str(job.pk)] if s.node is not None]
        budget = job_budget_micros(job.requirements)
        deadline = job.requirements.get("deadline")
        paid = [s.node for s in rows if s.fenced_at is None] if budget is not None else []
        per_hour = sum(self.book.price_per_hour(node) for node in paid)
        return step_grant(
            current=job.step_grant,
            recorded=job.step,
            total_steps=job.total_steps,
            step_seconds=step_seconds_of(batch_size=_batch_size(job), samples_per_second=job.samples_per_second),
            window=GrantWindow(heartbeat_seconds=settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS),
            frozen=job.handover_requested or any(s.node.flagged_at is not None for s in rows),
            budget_left_micros=None if budget is None else budget - self.book.charged_micros(job.pk),
            micros_per_second=per_hour / 3600 * MICROS_PER_DOLLAR,
            seconds_left=None if deadline is None else (datetime.fromisoformat(deadline) - self.now).total_seconds(),
        )

    def _set(self, stage: Stage, fields: tuple[str, ...], values: dict[str, Any]) -> None:
        """New values of a stage row's `fields`, written only if they differ from the row's."""
        if any(getattr(stage, name) != value for name, value in values.items()):
            for name, value in values.items():
                setattr(stage, name, value)
            self.changed[fields][stage.pk] = stage

    def _released(
        self, job: Job, stages: Sequence[StageCounters]
    ) -> dict[tuple[int, str], tuple[StageContribution, Stage]]:
        """Of `stages` (counters without a placed row), those of replicas dropped at the job's generation: each with
        its contribution and a live sibling row (its stage's layers; a stage without one has rewound)."""
        if not stages:
            return {}
        siblings = {s.index: s for s in self.rows[str(job.pk)]}
        wanted = Q()
        for s in stages:
            wanted |= Q(stage_index=s.index, node_id=s.node_id)
        found = StageContribution.objects.filter(
            wanted, job_id=job.pk, generation=F("job__generation"), released_at__isnull=False
        ).select_related("node")
        out = {}
        for c in found:
            if c.stage_index in siblings:
                c.node = self.nodes.setdefault(c.node.pk, c.node)
                out[(c.stage_index, str(c.node_id))] = (c, siblings[c.stage_index])
        return out

    def _flops_per_sample(self, stage: Stage, ranks: int) -> float:
        """The forward FLOPs per sample the stage's node does: a tensor-parallel rank does its share of each
        transformer block (embedding and head are whole on every rank)."""
        job_id = str(stage.job_id)
        if job_id not in self.flops:
            try:
                spec = model_spec_from_config(stage.job.model_config)
                self.flops[job_id] = (spec.layer_flops_per_sample(), spec.split_layers())
            except SpecError:
                self.flops[job_id] = None  # validated at submit; a model the library no longer accepts is not billed
        if (layers := self.flops[job_id]) is None:
            return 0.0
        costs, split = layers
        return float(sum(costs[i] / (ranks if i in split else 1) for i in range(stage.layer_start, stage.layer_end)))

    def save(self) -> None:
        # Upsert: a restarted driver replays steps it recorded before.
        LossPoint.objects.bulk_create(
            self.points,
            update_conflicts=True,
            unique_fields=["job", "step"],
            update_fields=["epoch", "loss", "samples_per_second"],
        )
        for fields, stages in self.changed.items():
            rows_update(Stage, list(stages.values()), fields)
        StageContribution.objects.bulk_create(
            self.contributions,
            update_conflicts=True,
            unique_fields=["job", "stage_index", "generation", "node"],
            update_fields=[*COUNTER_FIELDS, "updated_at"],
        )
        for contribution, s in self.released:
            StageContribution.objects.filter(pk=contribution.pk).update(
                **{name: getattr(s, name) for name in COUNTER_FIELDS}, updated_at=self.now
            )
        self.book.save()
        rows_update(Node, list(self.measured.values()), ["flops_measured", "flops_measured_at"])


def _group_ranks(rows: Sequence[Stage]) -> Counter[tuple[int, int]]:
    """The ranks of each (stage, replica): a tensor-parallel group's size; a replica holds its whole stage."""
    return Counter((s.index, s.replica) for s in rows)


def _batch_size(job: Job) -> int:
    return int((job.dataset_config or {}).get("batch_size") or 0)


def finite(value: float | None) -> float | None:
    """NaN and infinities are not JSON; the API shows them as null."""
    return float(value) if value is not None and math.isfinite(value) else None
