"""retain_freed_blocks: a tensor-sized buffer comes from the heap and its memory stays there once freed,
for the next buffer to reuse, instead of being mapped fresh and unmapped again. Each case runs in a fresh
interpreter: the allocator's settings are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

# mallinfo2(3): hblks counts blocks allocated with their own mapping; arena is the heap's size.
PROBE = """
import ctypes, sys
import torch
from nodeagent.heap import retain_freed_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
took = retain_freed_blocks() if sys.argv[1] == "retain" else None
before = mallinfo2()
buffer = torch.empty(1 << 20).fill_(1.0)  # 4 MiB, written through as a decoded push is
during = mallinfo2()
del buffer
after = mallinfo2()
print(took, during.hblks - before.hblks, (after.arena - before.arena) >> 20)
"""


def probe(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt(3) is glibc's")
def test_a_freed_tensor_sized_block_stays_in_the_heap() -> None:
    took, mapped, kept_mib = probe("retain")
    assert took == "True"
    assert mapped == "0" and int(kept_mib) >= 4  # from the heap, which keeps it after the free
    _, mapped, kept_mib = probe("default")
    assert mapped == "1" and kept_mib == "0"  # glibc's defaults: a mapping of its own, unmapped on free
