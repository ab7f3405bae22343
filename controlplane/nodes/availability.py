"""Whether a contributor's device may work now, by its owner's controls: paused, working hours, and
"only while I am not using it" (the CPU use of the owner's other processes, as its agent reports it).
Pure: the reconciler treats an unavailable node like a paused one and drains it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, time

_WINDOW = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")


def parse_window(text: str) -> tuple[time, time]:
    """ "22:00-07:00" (UTC; may wrap past midnight) → (start, end); ValueError saying the expected form."""
    match = _WINDOW.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a window like 22:00-07:00 (24-hour HH:MM-HH:MM, UTC)")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    if (h1, m1) == (h2, m2):
        raise ValueError(f"{text!r} is empty: start and end are the same time")
    return time(h1, m1), time(h2, m2)


def in_windows(windows: Sequence[str], now: datetime) -> bool:
    """No windows: always. Otherwise inside one of them (start inclusive, end exclusive)."""
    if not windows:
        return True
    t = now.time().replace(tzinfo=None)
    for text in windows:
        start, end = parse_window(text)
        if (start <= t < end) if start < end else (t >= start or t < end):
            return True
    return False


def unavailable_reason(
    *,
    paused: bool,
    flag_reason: str | None = None,
    leaving: bool = False,
    work_windows: Sequence[str],
    idle_only: bool,
    idle_cpu_threshold: float,
    host_busy_fraction: float | None,
    now: datetime,
) -> str | None:
    """Why the node must not work now, or None if it may."""
    if flag_reason is not None:
        return f"flagged: {flag_reason}"
    if paused:
        return "paused by its owner"
    if leaving:
        return "its agent is leaving"
    if not in_windows(work_windows, now):
        return f"outside its owner's working hours ({', '.join(work_windows)} UTC)"
    if idle_only and host_busy_fraction is not None and host_busy_fraction > idle_cpu_threshold:
        return (
            f"its owner is using it (other processes use {host_busy_fraction:.0%} of the CPU, "
            f"above the {idle_cpu_threshold:.0%} allowed)"
        )
    return None
