"""The training steps the control plane granted this agent's jobs: a RunStep of a train step beyond its job's grant
waits, until its call's deadline, for a heartbeat reply to extend it, then is refused (arceus/contracts/step_grant.py),
so a driver that is stale or keeps going after a cancel or a cap makes this agent train at most to a step the control
plane wrote down (controlplane/jobs/step_grant.py).

An agent without a control plane (static assignments) has no grants and bounds nothing; one with a control plane
bounds every job from its first heartbeat reply on. A job's grant never goes down here (a lower one is a reply that
was overtaken by a newer one); a reply that leaves the job out ends it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from arceus.contracts.step_grant import NOT_GRANTED, not_granted_message

POLL_SECONDS = 0.25  # how often a waiting step looks at its call's abort


class StepNotGranted(Exception):
    """A train step beyond its job's grant, after the wait."""


class StepGrants:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._granted: dict[str, int] = {}
        self._governed = False  # a control plane grants steps (its first reply arrived)
        self._beat: Callable[[], None] = lambda: None

    def ask_heartbeats_with(self, beat: Callable[[], None]) -> None:
        """How a waiting step asks for a heartbeat now (the heartbeat loop's)."""
        self._beat = beat

    def update(self, grants: Mapping[str, int]) -> None:
        """A heartbeat reply's grants (job id → the last step its agents may run: every running job this node
        hosts). A job the reply leaves out (cancelled, ended, no longer hosted here) has
        no grant from now on: a job queued again later starts from its new run's."""
        with self._changed:
            self._governed = True
            self._granted = {job_id: max(step, self._granted.get(job_id, -1)) for job_id, step in grants.items()}
            self._changed.notify_all()

    def granted(self, job_id: str) -> int | None:
        with self._changed:
            return self._granted.get(job_id)

    def require(self, job_id: str, step: int, *, deadline: float, abort: threading.Event) -> None:
        """Return once train step `step` (1, 2, ...) of the job is granted; StepNotGranted if it is not by `deadline`
        (a time.monotonic(): the call's, so that a control plane away for a while, its heartbeats failing, only delays
        the step) or `abort`."""
        with self._changed:
            if not self._governed or self._granted.get(job_id, -1) >= step > 0:
                return
            if step <= 0:
                raise StepNotGranted(f"{NOT_GRANTED} a train step of job {job_id} names no training step "
                                     "(train_step), and this agent's control plane grants them")
        self._beat()
        started = time.monotonic()
        with self._changed:
            while not self._granted.get(job_id, -1) >= step > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or abort.is_set():
                    raise StepNotGranted(not_granted_message(
                        job_id=job_id, step=step, grant=self._granted.get(job_id),
                        waited_seconds=time.monotonic() - started,
                    ))
                self._changed.wait(min(remaining, POLL_SECONDS))
