"""Keep the agent's freed tensor-sized blocks in its heap instead of handing them back to the kernel.

Every micro-batch moves megabytes through fresh buffers: gRPC's message buffers, decoded tensors,
activations and their gradients. glibc serves blocks above its mmap threshold (128 KiB at first; it
adapts, but trims the heap again) with fresh pages, which the kernel zero-fills on first touch, several
times slower than reused memory. The price: each malloc arena (the main one, and one per thread that
allocates concurrently, up to 8 per core) stays near its high-water mark, since a thread arena's heap
(64 MiB at most) never reaches the trim threshold; so the arenas are capped at ARENA_MAX. Measurements:
docs/BENCHMARKS.md ("Figures moved from code comments").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
ARENA_MAX = 2  # the main heap and one more: the threads that move tensors share them
# Blocks above this still get a mapping of their own, returned on free: a large stage's weights, gradients and
# optimizer moments (a 1024-wide GPT's are 12-16 MiB each), which kept in the heap left it fragmented near its
# high-water mark.
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 64 << 20  # free memory at the top of the main heap before it shrinks
# How an operator tunes glibc's malloc; any of them set, the agent leaves the allocator alone.
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def retain_freed_blocks() -> bool:
    """Tune glibc's malloc so freed blocks up to MMAP_THRESHOLD are reused; True if it took effect.
    Left as it is where the operator tuned it, and elsewhere than glibc on Linux (macOS, musl): this is
    speed only, never correctness."""
    chosen = [name for name in OPERATOR_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        log.info("malloc tuned by %s; the agent keeps those settings", ", ".join(chosen))
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here; the allocator keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX))
    return all(mallopt(param, value) == 1 for param, value in settings)


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the kernel (glibc's malloc_trim); True if some was. The agent
    calls it when its stages change: a dropped stage's weights, gradients and optimizer state would
    otherwise stay in the heap (up to the trim threshold, and in holes below it), and a rebuilt stage's
    memory would add to them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return malloc_trim(0) == 1


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, found once: find_library runs ldconfig in a subprocess (~0.1 s), and the agent trims its
    heap at every change of its stages. OSError where there is none to load."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
