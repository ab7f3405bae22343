"""retain_freed_blocks: a tensor-sized block comes from the heap and its memory stays there once freed, for
the next buffer to reuse, instead of being mapped fresh and unmapped again; an operator's own malloc
settings are left alone. Each case runs in a fresh interpreter (the allocator's settings are process-wide)
that allocates with malloc itself, so nothing but the setting decides where the block goes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

# mallinfo2(3): hblks counts blocks with a mapping of their own; arena is the main heap's size.
PROBE = """
import ctypes, sys
from nodeagent.heap import retain_freed_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
took = retain_freed_blocks() if sys.argv[1] == "retain" else None
before = libc.mallinfo2()
block = libc.malloc(4 << 20)  # 4 MiB, written through as a decoded push is
ctypes.memset(block, 1, 4 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(took, during.hblks - before.hblks, (after.arena - before.arena) >> 20, (during.arena - after.arena) >> 20)
"""


def has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc 2.33+
    except OSError:
        return False


def probe(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True,
        env=clean | env,
    )
    return out.stdout.split()


pytestmark = pytest.mark.skipif(not has_mallinfo2(), reason="mallopt(3) and mallinfo2(3) are glibc 2.33+'s")


def test_a_freed_tensor_sized_block_stays_in_the_heap() -> None:
    took, mapped, _, shrunk_mib = probe("retain")
    assert took == "True"
    # From the heap (which may have had some of it free already), which keeps it after the free.
    assert mapped == "0" and shrunk_mib == "0"
    _, mapped, kept_mib, _ = probe("default")
    assert mapped == "1" and kept_mib == "0"  # glibc's defaults: a mapping of its own, unmapped on free


@pytest.mark.parametrize(
    "env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}]
)
def test_an_operators_malloc_settings_are_kept(env: dict[str, str]) -> None:
    took, mapped, _, _ = probe("retain", **env)
    assert took == "False" and mapped == "1"
