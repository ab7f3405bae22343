"""The supervisor stops its children in waves: a later wave gets SIGTERM only once the earlier ones are gone,
and a child that ignores SIGTERM is killed when its wave's grace runs out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from devtools.supervisor import Supervisor

# Prints READY, then on SIGTERM appends its name to the file in argv[2] and exits (or, with "ignore", stays).
CHILD = """
import signal, sys, time
name, record, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def on_term(*_):
    with open(record, "a") as f:
        f.write(name + "\\n")
    if mode != "ignore":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def start(supervisor: Supervisor, name: str, record: Path, mode: str = "exit") -> None:
    child = supervisor.start(name, [sys.executable, "-c", CHILD, name, str(record), mode], env={})
    supervisor.wait_for_log_line(child, "READY", timeout=30)


def test_each_wave_is_signalled_only_after_the_one_before_has_exited(tmp_path: Path) -> None:
    supervisor, record = Supervisor(tmp_path / "logs"), tmp_path / "terms"
    for name in ("broker", "web", "agent-a", "worker", "agent-b"):
        start(supervisor, name, record)
    supervisor.stop_all(wave=lambda name: 0 if name.startswith("agent-") else 2 if name == "broker" else 1)
    lines = record.read_text().split()
    assert sorted(lines[:2]) == ["agent-a", "agent-b"]
    assert sorted(lines[2:4]) == ["web", "worker"]
    assert lines[4:] == ["broker"]
    assert not any(child.alive() for child in supervisor.children)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    supervisor, record = Supervisor(tmp_path / "logs"), tmp_path / "terms"
    start(supervisor, "stubborn", record, mode="ignore")
    start(supervisor, "last", record)
    began = time.monotonic()
    supervisor.stop_all(grace=0.5, wave=lambda name: 1 if name == "last" else 0)
    assert record.read_text().split() == ["stubborn", "last"]
    assert time.monotonic() - began < 5
    assert not any(child.alive() for child in supervisor.children)


def test_a_wave_may_have_a_grace_of_its_own(tmp_path: Path) -> None:
    supervisor, record = Supervisor(tmp_path / "logs"), tmp_path / "terms"
    start(supervisor, "first", record)
    start(supervisor, "stubborn", record, mode="ignore")
    began = time.monotonic()
    supervisor.stop_all(grace=lambda number: 0.5 if number == 1 else 60.0,
                        wave=lambda name: 1 if name == "stubborn" else 0)
    assert record.read_text().split() == ["first", "stubborn"]
    assert time.monotonic() - began < 30  # the stubborn one's 0.5 s, not the 60 s of the wave before
    assert not any(child.alive() for child in supervisor.children)
