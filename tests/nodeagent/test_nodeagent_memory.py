"""An agent holds its stage and no more: rebuilding a stage (a rewind) drops the old one before building
the new and hands the freed memory back, so ten rebuilds do not add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_rebuilding_a_stage_ten_times_does_not_grow_the_agent() -> None:
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("rebuild_worker.py"))],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=240, check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    state, rss = report["state_bytes"], report["rss"]
    assert len(rss) == 10 and state > 100 * 2**20
    assert rss[-1] - rss[0] < state, f"RSS grew by {(rss[-1] - rss[0]) / 2**20:.0f} MiB over 10 rebuilds"
    settled = rss[2:]  # after the first rebuild, nothing more accumulates
    assert max(settled) - min(settled) < state // 4, [f"{r / 2**20:.0f} MiB" for r in rss]
