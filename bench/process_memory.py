"""What a control-plane process holds after start-up, and whether it loaded torch or gRPC: the web server (gunicorn
with the deployed configuration, one worker) and a control-queue Celery worker (`--pool solo`: the one process that
runs its tasks), each started for real from this checkout.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/process_memory.py [--runs 3] [--no-write]

Each process is measured once it serves: the web worker after it answered GET /healthz (whatever its status), the
Celery worker after it logged "ready". Its resident memory is VmRSS from /proc/PID/status; "torch" / "grpc" say
whether a libtorch or gRPC extension (.so) is mapped in /proc/PID/maps. Medians of `--runs` fresh starts, one
process at a time. Prints a table, writes docs/BENCHMARKS.md's process-memory section, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import report  # noqa: E402

START_SECONDS = 120.0


def loaded(pid: int) -> dict[str, Any]:
    """{"rss_mib", "torch", "grpc", "numpy", "tokenizers"} of a running process: its RSS, and whether it mapped each
    library's extension."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {"rss_mib": round(rss_kib / 1024, 1), "torch": "libtorch" in maps,
            "grpc": bool(re.search(r"grpc[^/\n]*\.so", maps)), "numpy": "_multiarray_umath" in maps,
            "tokenizers": "tokenizers.abi3" in maps}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def web_server(env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "controlplane.asgi", "-c", "python:controlplane.gunicorn_conf",
             "--bind", f"127.0.0.1:{port}", "--workers", "1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + START_SECONDS
            while True:
                try:  # any answer, a 503 without a migrated database too: Django is loaded and serving
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).close()
                    break
                except urllib.error.HTTPError:
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"the web server did not answer: {log.read()[-2000:].decode()}") from None
                    time.sleep(0.5)
            (worker,) = children(server.pid)
            return loaded(worker)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)


def control_worker(env: dict[str, str]) -> dict[str, Any]:
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane.celery", "worker", "-Q", "control", "--pool", "solo",
         "-n", f"bench-memory-{os.getpid()}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle",
         "--loglevel", "INFO"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        # Raw reads of the pipe: select() sees only what is still in the pipe, so lines a buffered readline()
        # had already pulled into Python (the banner and "ready." in one chunk with the warning) would never wake it.
        deadline = time.monotonic() + START_SECONDS
        output = b""
        while time.monotonic() < deadline:
            if not select.select([worker.stdout], [], [], 1.0)[0]:
                continue
            chunk = os.read(worker.stdout.fileno(), 65536)
            output += chunk
            if b" ready." in output:
                return loaded(worker.pid)
            if not chunk:
                break
        raise RuntimeError(f"the control worker did not start: {output[-2000:].decode(errors='replace')}")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARCEUS_DEBUG": os.environ.get("ARCEUS_DEBUG", "1")}
    rows, result = [], {}
    for name, start in (("web server (gunicorn, one worker)", web_server), ("control worker (Celery)", control_worker)):
        runs = [start(env) for _ in range(args.runs)]
        rss = statistics.median(r["rss_mib"] for r in runs)
        torch, grpc = any(r["torch"] for r in runs), any(r["grpc"] for r in runs)
        rows.append(f"| {name} | {rss} | {'yes' if torch else 'no'} | {'yes' if grpc else 'no'} |")
        result[name.split(" (")[0].replace(" ", "_")] = {"rss_mib": rss, "torch": torch, "grpc": grpc}
    body = (f"Each process started {args.runs} times from this checkout, measured once it serves (median RSS).\n\n"
            "| process | RSS MiB | torch loaded | gRPC loaded |\n| --- | --- | --- | --- |\n" + "\n".join(rows))
    report("process-memory", "A control-plane process after start-up (`bench/process_memory.py`)", body, result,
           write=args.write)


if __name__ == "__main__":
    main()
