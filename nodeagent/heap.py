"""Keep the agent's freed tensor-sized blocks in its heap instead of handing them back to the kernel.

Every micro-batch moves megabytes through fresh buffers: gRPC's message buffers, decoded tensors,
activations and their gradients. glibc serves blocks above its mmap threshold (128 KiB at first; it
adapts, but trims the heap again) with fresh pages, which the kernel zero-fills on first touch, several
times slower than reused memory. The price: each malloc arena (the main one, and one per thread that
allocates concurrently, up to 8 per core) stays near its high-water mark, since a thread arena's heap
(64 MiB at most) never reaches the trim threshold; so the arenas are capped at ARENA_MAX. One: a stage's
micro-batches run on whichever gRPC thread takes the call, and with a second arena the heap kept more free memory
after every step, so that an agent's peak kept rising with the steps it had trained. Measurements:
docs/BENCHMARKS.md ("Figures moved from code comments"; "Why resumed stages peaked above seed-built ones").
"""

from __future__ import annotations

import ctypes
import sys

from arceus.glibc_malloc import M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, libc, tune_malloc

ARENA_MAX = 1  # the main heap alone: every thread reuses what any other freed
# Blocks above this still get a mapping of their own, returned on free: a large stage's weights, gradients and
# optimizer moments (a 1024-wide GPT's are 12-16 MiB each), which kept in the heap left it fragmented near its
# high-water mark.
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 64 << 20  # free memory at the top of the main heap before it shrinks


def retain_freed_blocks() -> bool:
    """Tune glibc's malloc so freed blocks up to MMAP_THRESHOLD are reused; True if it took effect.
    Left as it is where the operator tuned it, and elsewhere than glibc on Linux (macOS, musl): this is
    speed only, never correctness."""
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX))
    return tune_malloc(settings, process="agent")


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the kernel (glibc's malloc_trim); True if some was. The agent
    calls it when its stages change: a dropped stage's weights, gradients and optimizer state would
    otherwise stay in the heap (up to the trim threshold, and in holes below it), and a rebuilt stage's
    memory would add to them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = libc().malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return malloc_trim(0) == 1

