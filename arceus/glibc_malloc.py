"""glibc's malloc tuned from inside a process (mallopt(3)) by the processes that know how they allocate: the agent
keeps tensor-sized blocks in its heap (nodeagent/heap.py), the training worker caps its arenas (tasks/training.py).
Speed and memory only, never correctness: where an operator tuned malloc by environment, and elsewhere than glibc on
Linux (macOS, musl), the allocator keeps its settings."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

# mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
# How an operator tunes glibc's malloc; any of them set, the process leaves the allocator alone.
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def tune_malloc(settings: Sequence[tuple[int, int]], *, process: str) -> bool:
    """Set each (mallopt parameter, value) of `settings`; True if every one took effect. `process` names the caller
    in the log line that says an operator's settings were kept."""
    chosen = [name for name in OPERATOR_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        log.info("malloc tuned by %s; the %s keeps those settings", ", ".join(chosen), process)
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here; the allocator keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings)


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, found once: find_library runs ldconfig in a subprocess (~0.1 s), and the agent trims its
    heap at every change of its stages. OSError where there is none to load."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
