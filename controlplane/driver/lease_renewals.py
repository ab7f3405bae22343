"""The driver leases of one process's training drivers, renewed together by one thread (`LEASES`).

The training worker's drivers are threads of one process (controlplane/common/worker_pool.py). Each driver's lease is
renewed every third of its duration however long a step takes, as before, but by one thread for all of them, in one
transaction (`jobs_driver_renew`) on one database connection: not a thread and a connection per running job. A
driver whose lease is gone (cancelled, rewound, taken over) learns it once (`on_lost`) and stops at its next step; a
driver that died stops renewing with its process, and the reconciler rewinds its job to the last checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, connection
from django.utils import timezone

from controlplane.jobs.leases import jobs_driver_renew

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class _Lease:
    job_id: str
    owner: str
    on_lost: Callable[[], None]


class LeaseRenewals:
    """Renews every lease `renewing` holds, every `interval()` seconds (a third of the lease by default), from one
    thread started with the first lease; `renew` is `jobs_driver_renew` or a function of its signature."""

    def __init__(
        self,
        renew: Callable[..., set[tuple[str, str]]] = jobs_driver_renew,
        interval: Callable[[], float] = lambda: settings.ARCEUS_DRIVER_LEASE_SECONDS / 3,
    ) -> None:
        self._renew, self._interval = renew, interval
        self._lock = threading.Lock()
        self._leases: set[_Lease] = set()
        self._thread: threading.Thread | None = None

    @contextmanager
    def renewing(self, *, job_id: str, owner: str, on_lost: Callable[[], None]) -> Iterator[None]:
        """While inside, `owner`'s lease of the job is renewed; `on_lost` is called once if it is found gone."""
        lease = _Lease(job_id, owner, on_lost)
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="driver-leases", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._leases.discard(lease)

    def _run(self) -> None:
        stop = threading.Event()  # never set: the thread lasts as long as the process
        while not stop.wait(self._interval()):
            self.renew_round(timezone.now())

    def renew_round(self, now: datetime) -> None:
        """Renew every lease held now in one transaction; each one found gone leaves the set and its driver is told.
        A database error is retried at the next round on a fresh connection (a lease outlasts two missed rounds)."""
        with self._lock:
            leases = list(self._leases)
        if not leases:
            return
        try:
            held = self._renew(leases=[(lease.job_id, lease.owner) for lease in leases], now=now)
        except DatabaseError:
            log.warning("could not renew %d driver leases; retrying", len(leases), exc_info=True)
            connection.close()  # a dead connection stays dead: the next round opens a new one
            return
        for lease in leases:
            if (lease.job_id, lease.owner) not in held:
                with self._lock:
                    if lease not in self._leases:
                        continue  # its driver ended meanwhile
                    self._leases.discard(lease)
                lease.on_lost()


LEASES = LeaseRenewals()  # the process's: every training driver's lease is renewed through it
