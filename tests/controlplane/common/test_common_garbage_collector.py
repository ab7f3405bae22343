"""The collector of a long-running control-plane process: what it held when tuned is never scanned again, and young
collections are rare. Each case runs in a fresh interpreter, since the collector's state is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from controlplane.common.garbage_collector import YOUNG_THRESHOLD

# A process that holds a large heap (as a worker holds Django and 10,000 nodes' views), then makes 400,000 objects
# in reference cycles, a third of them kept: how often its collections ran meanwhile, and of which generation.
WORKLOAD = """
import gc, json
held = [[{"i": i}] for i in range(300_000)]
{tune}
runs = []
def timed(phase, info):
    if phase == "stop":
        runs.append(info["generation"])
gc.callbacks.append(timed)
kept = []
for i in range(200_000):
    a, b = {}, {}
    a["b"], b["a"] = b, a
    if i % 3 == 0:
        kept.append(a)
gc.callbacks.remove(timed)
print(json.dumps({"runs": len(runs), "full": runs.count(2),
                  "frozen": gc.get_freeze_count()}))
"""


def _run(tune: str) -> dict[str, int]:
    code = WORKLOAD.replace("{tune}", tune)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_a_tuned_process_never_scans_what_it_held_and_collects_young_objects_rarely() -> None:
    default = _run("")
    tuned = _run("from controlplane.common.garbage_collector import garbage_collector_tuned; garbage_collector_tuned()")
    assert tuned["frozen"] >= 300_000 > default["frozen"]
    assert default["full"] >= 1 and tuned["full"] == 0  # the default scanned the whole held heap at least once
    assert tuned["runs"] * 20 <= default["runs"]


@pytest.mark.parametrize("signal", ["worker_process_init", "worker_init"])  # a pool process; a worker of threads
def test_celery_workers_tune_their_collector_when_they_start(signal: str) -> None:
    code = textwrap.dedent(f"""
        import gc, json
        from celery import signals
        import controlplane.celery
        before = gc.get_freeze_count()
        signals.{signal}.send(sender=None)
        print(json.dumps({{"before": before, "after": gc.get_freeze_count(), "threshold": gc.get_threshold()}}))
    """)
    env = {**os.environ, "ARCEUS_SECRET_KEY": "a-secret-so-that-a-worker-starts"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env)
    state = json.loads(out.stdout)
    assert state["before"] == 0 < state["after"]
    assert state["threshold"][0] == YOUNG_THRESHOLD
