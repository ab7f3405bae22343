"""The training driver's ProgressSink, backed by the jobs services.

Every write goes through `_db`: a database restart costs the driver a reconnect, not the job.
Step records and the stages' work counters are batched (written at most every `flush_seconds`, at each
epoch end, and whenever the steps come near the job's step grant) so fast steps do not turn into one transaction
each, and written with the other drivers' of the process that flush at the same time (`PROGRESS`,
controlplane/driver/recording.py); each write also renews the driver lease. Frequent counter writes bound what a
crash takes from the accounting to about `flush_seconds` of work. A write that finds the
lease gone (job cancelled, or another driver took over) makes `should_stop` true.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from arceus.contracts.counters import StageCounters
from arceus.contracts.spot_check import SpotCheckResult
from arceus.training.plan import EpochResult, StageEndpoint, StageStateFile, StageTiming, StepProgress, UploadTarget
from controlplane.common import metrics
from controlplane.common.db import reconnecting
from controlplane.common.errors import ApplicationError
from controlplane.driver.progress import StepPoint, job_record_epoch, stage_timings_mean
from controlplane.driver.recording import PROGRESS, ProgressReport
from controlplane.jobs.checkpoints import checkpoint_save, checkpoint_uploads_open
from controlplane.jobs.leases import job_driver_handover, job_handover_requested
from controlplane.jobs.step_grant import GrantWindow
from controlplane.market.verification import spot_checks_record

log = logging.getLogger(__name__)
R = TypeVar("R")


def _db(what: str, call: Callable[[], R]) -> R:
    """A write of the driver's, through a database restart: retried on a fresh connection while its lease
    could still be held; after that the lease is gone anyway."""
    return reconnecting(call, what=what, for_seconds=settings.ARCEUS_DRIVER_LEASE_SECONDS)


class DbProgressSink:
    def __init__(self, *, job_id: str, lease_owner: str, generation: int, flush_seconds: float = 0.5) -> None:
        self.job_id = job_id
        self.lease_owner = lease_owner
        self.generation = generation
        self.flush_seconds = flush_seconds
        self._pending: list[StepPoint] = []
        # Each agent's newest counters not yet written, by (stage, node): a replica that left since its last step
        # (lost, or let go) is written with the others, its measured work billed though no later step names it.
        self._counters: dict[tuple[int, str], StageCounters] = {}
        self._spot_checks: list[SpotCheckResult] = []
        self._timings: list[list[StageTiming]] = []  # per pending step
        self._last_flush = time.monotonic()
        # The job's step grant as the last report extended it; unknown until a report is written. The agents refuse
        # a step past it, and while the driver waits for one it reports nothing: so it reports before it gets there.
        self._granted: int | None = None
        self._grant_known = False
        self._lost_lease = False
        self._handover = False

    def on_step(self, p: StepProgress) -> None:
        metrics.DRIVER_STEP_SECONDS.observe(p.seconds)
        self._pending.append(StepPoint(p.epoch, p.step, p.total_steps, p.loss, p.samples_per_second))
        self._counters.update(((c.index, c.node_id), c) for c in p.stages)
        self._timings.append(p.timings)
        self._spot_checks += [replace(c, train_step=p.step) for c in p.spot_checks]
        # A failed check is written at once: the node must stop getting credit and work now.
        if (
            time.monotonic() - self._last_flush >= self.flush_seconds
            or not all(c.passed for c in p.spot_checks)
            or self._near_grant(p.step)
        ):
            self.flush()

    def _near_grant(self, step: int) -> bool:
        """Whether `step` is within the grant's margin of its end (or the grant is not known yet): fast steps run
        a window out in less than `flush_seconds` (a job's first eight, or after a slow step measured a short one),
        and the next step past it would wait for an extension that only this driver's report brings."""
        if not self._grant_known:
            return True
        return self._granted is not None and step + GrantWindow.margin_steps >= self._granted

    def on_epoch(self, r: EpochResult) -> None:
        self.flush()
        if not self._lost_lease:
            self._lost_lease = not _db("recording an epoch", lambda: job_record_epoch(
                job_id=self.job_id,
                lease_owner=self.lease_owner,
                epoch=r.epoch,
                val_loss=r.val_loss,
                val_accuracy=r.val_accuracy,
                stages=r.stages,
                now=timezone.now(),
            ))

    def checkpoint_uploads(self, step: int, stages: list[StageEndpoint]) -> dict[int, UploadTarget]:
        """An upload for every unsplit stage: its agent sends its state to the control plane itself (a
        tensor-parallel stage's ranks are streamed to the driver, which puts them together)."""
        if self._lost_lease:
            return {}
        uploads = _db("opening checkpoint uploads", lambda: checkpoint_uploads_open(
            job_id=self.job_id, lease_owner=self.lease_owner, generation=self.generation, step=step,
            stages=[s for s in stages if not s.tensor_parallel_ranks],
        ))
        if uploads is None:
            self._lost_lease = True
            return {}
        return {
            index: UploadTarget(str(u.pk), reverse("agent-checkpoint-upload", kwargs={"upload_id": u.pk}))
            for index, u in uploads.items()
        }

    def on_checkpoint(self, step: int, epoch: int, stages: list[StageStateFile]) -> None:
        self.flush()
        if self._lost_lease:
            return
        saved = _db("saving a checkpoint", lambda: checkpoint_save(
            job_id=self.job_id,
            lease_owner=self.lease_owner,
            generation=self.generation,
            step=step,
            epoch=epoch,
            stages=stages,
        ))
        self._lost_lease = saved is None
        if self._handover and not self._lost_lease:
            _db("handing the driver over", lambda: job_driver_handover(
                job_id=self.job_id, owner=self.lease_owner, step=step, now=timezone.now()
            ))
            self._lost_lease = True  # handed over: stop

    def lose_lease(self) -> None:
        """The lease renewer found the lease gone: stop at the next step."""
        self._lost_lease = True

    def wants_checkpoint(self) -> bool:
        return self._handover and not self._lost_lease

    def should_stop(self) -> bool:
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()  # also renews the lease while steps are slow
        return self._lost_lease

    def flush(self) -> None:
        points, self._pending = self._pending, []
        counters, self._counters = list(self._counters.values()), {}
        checks, self._spot_checks = self._spot_checks, []
        timings, self._timings = stage_timings_mean(self._timings), []
        self._last_flush = time.monotonic()
        if not self._lost_lease:
            report = ProgressReport(job_id=self.job_id, lease_owner=self.lease_owner, points=points,
                                    stages=counters, timings=timings)
            recorded = _db("recording steps", lambda: PROGRESS.record(report))
            self._lost_lease = recorded is None
            if recorded is not None:
                self._granted, self._grant_known = recorded.step_grant, True
        if checks and not self._lost_lease:
            try:
                _db("recording spot checks", lambda: spot_checks_record(
                    job_id=self.job_id, lease_owner=self.lease_owner, generation=self.generation, checks=checks,
                    now=timezone.now(),
                ))
            except ApplicationError as exc:  # evidence that does not hold up is dropped, never stored
                log.error("job %s: spot checks not recorded: %s", self.job_id, exc.message)
        if not self._lost_lease and not self._handover:
            self._handover = _db("reading a handover request", lambda: job_handover_requested(job_id=self.job_id))

    @property
    def lost_lease(self) -> bool:
        return self._lost_lease

