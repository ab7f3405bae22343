"""`NeighbourLinks`: a daemon thread that measures this agent's links to its pipeline neighbours (the
prev/next addresses of the stages it hosts) after the stages change and every `interval` seconds, and
keeps the figures for the next heartbeat. It never touches a stage: training does not wait for it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from nodeagent.link_probe import LinkFigures, measure_neighbour

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_SECONDS = 300.0  # links change (Wi-Fi, VPNs, traffic); a probe costs a few MB
BUSY_RETRY_SECONDS = 2.0
# A failed probe is tried again after 2, 4 and 8 s before the link is reported unknown: a neighbour placed at the
# same time as this agent's stage may still be building its own, and accepts no credential of this job until then.
PROBE_RETRY_SECONDS = (2.0, 4.0, 8.0)


class Neighbour(NamedTuple):
    token: str  # the one its stage accepts from ours
    certificate: str  # its agent's registered TLS certificate


class NeighbourLinks:
    def __init__(
        self,
        neighbours: Callable[[], dict[str, Neighbour]],
        stepping: Callable[[], bool],
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        measure: Callable[[str, str, str], LinkFigures | None] = measure_neighbour,
        busy_retry: float = BUSY_RETRY_SECONDS,
        probe_retries: Sequence[float] = PROBE_RETRY_SECONDS,
    ) -> None:
        """`neighbours`: each neighbour's address, the token to present to it and its certificate."""
        self._neighbours = neighbours
        self._stepping = stepping
        self._interval = interval
        self._measure = measure
        self._busy_retry = busy_retry
        self._probe_retries = tuple(probe_retries)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: dict[str, LinkFigures | None] = {}
        self._thread = threading.Thread(target=self._run, name="neighbour-links", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wake(self) -> None:
        """Measure now (the stages, hence the neighbours, changed)."""
        self._wake.set()

    def take(self) -> list[dict[str, Any]]:
        """The figures measured since the last call, one entry per neighbour address; null figures: the
        probe failed (unknown)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return [
            {
                "address": address,
                "rtt_seconds": figures.rtt_seconds if figures else None,
                "bandwidth_bytes_per_second": figures.bandwidth_bytes_per_second if figures else None,
            }
            for address, figures in sorted(pending.items())
        ]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self._wait_for_a_pause()
            for address, neighbour in sorted(self._neighbours().items()):
                if self._stop.is_set():
                    return
                figures = self._measure_with_retries(address, neighbour)
                with self._lock:
                    self._pending[address] = figures

    def _measure_with_retries(self, address: str, neighbour: Neighbour) -> LinkFigures | None:
        for delay in (*self._probe_retries, None):
            try:
                figures = self._measure(address, neighbour.token, neighbour.certificate)
            except Exception:  # a probe bug must not end the thread: report the link as unknown
                log.exception("measuring the link to %s failed unexpectedly", address)
                return None
            if figures is not None or delay is None or self._stop.wait(delay):
                return figures
        return None

    def _wait_for_a_pause(self) -> None:
        """Probe between steps, so the filler bytes do not compete with activations; but if the pipeline
        never pauses for a whole interval, probe anyway: figures are worth more than a slightly slower step."""
        deadline = time.monotonic() + self._interval
        while self._stepping() and time.monotonic() < deadline and not self._stop.wait(self._busy_retry):
            pass
