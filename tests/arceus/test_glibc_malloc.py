"""tune_malloc: capping glibc's arenas (the training worker's setting) after a process started holds its threads to
them. Each case runs in a fresh interpreter (the allocator's settings are process-wide) whose threads allocate with
malloc itself, all at once; malloc_stats(3) lists the arenas on stderr."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from controlplane.common.worker_pool import TRAINING_WORKER_MALLOC_ARENAS

PROBE = """
import ctypes, sys, threading
from arceus.glibc_malloc import M_ARENA_MAX, tune_malloc

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
threads_started = threading.Barrier(9)
if sys.argv[1] != "default":
    assert tune_malloc(((M_ARENA_MAX, int(sys.argv[1])),), process="probe")

def allocate() -> None:
    libc.malloc(1000)  # this thread's first block: from its own arena where the cap allows
    threads_started.wait()  # every thread holds its arena at once
    threads_started.wait()

threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
threads_started.wait()
libc.malloc_stats()
threads_started.wait()
"""


def arenas(cap: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, cap], capture_output=True, text=True, timeout=60,
                         check=True, env=clean)
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def is_glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "malloc_stats")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not is_glibc(), reason="mallopt(3) and malloc_stats(3) are glibc's")


def test_threads_allocating_at_once_share_the_capped_arenas() -> None:
    assert arenas("default") > TRAINING_WORKER_MALLOC_ARENAS  # glibc's default: an arena per thread, 8 per core
    assert arenas(str(TRAINING_WORKER_MALLOC_ARENAS)) == TRAINING_WORKER_MALLOC_ARENAS
