"""How busy the contributor's machine is with everything but this agent: what "work only while I am
not using it" is judged on."""

from __future__ import annotations

import psutil


class HostLoad:
    """Each call returns the CPU share (0..1 of all cores) that other processes used since the last call."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        psutil.cpu_percent(interval=None)  # the first reading of each only starts the interval
        self._me.cpu_percent(interval=None)

    def others_busy_fraction(self) -> float:
        total = psutil.cpu_percent(interval=None) / 100  # of all cores
        mine = self._me.cpu_percent(interval=None) / 100 / self._cores  # of one core, summed over threads
        return min(1.0, max(0.0, total - mine))
