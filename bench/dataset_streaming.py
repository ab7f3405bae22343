"""Uploaded datasets: the training driver's peak memory against the dataset's size, and a 200 MB upload over the
real API interrupted and resumed.

    .venv/bin/python bench/dataset_streaming.py [--sizes-mb 25 100 200] [--steps 150] [--upload-mb 200]

1. Driver memory: for each size, a safetensors file of float32 samples (1 KiB each) trains an MLP [256, 64, 10]
   over two agents (in this process, gRPC on loopback) for `--steps` steps and a validation pass over the last
   tenth; the driver runs in a fresh process of its own opening the file as the control plane's storage hands it
   over (`TrainPlan.open_dataset`), and reports its peak RSS (VmHWM) and the bytes it read of the file. The stages
   read their rows themselves (nodeagent/step_samples.py) by byte range, here from the file directly (in a
   deployment through the control plane's `dataset-reads`): the driver reads the file's header only.
2. Upload: a local control plane (devtools.cluster, gunicorn + Celery; DATABASE_URL and REDIS_URL from the
   environment where set) takes a `--upload-mb` file through `ArceusClient.upload_dataset` in 16 MiB pieces;
   the first attempt is cut off after 40% (the client raises from its progress callback), the second resumes
   from the control plane's offset; the completion joins, hashes and checks the file.

Prints tables, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import Assignment, max_micro_batch_size  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.data.formats import inspect_file  # noqa: E402
from arceus.data.upload_rows import ranges_checked  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import free_ports  # noqa: E402
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity  # noqa: E402
from nodeagent.agent import Agent  # noqa: E402

FEATURES, CLASSES, BATCH, MICRO_BATCHES, SEED, LR = 256, 10, 64, 2, 0, 0.05
MODEL = {"type": "mlp", "layer_sizes": [FEATURES, 64, CLASSES]}
DATASET_ID = "00000000-0000-4000-8000-00000000da7a"


def write_dataset(path: Path, megabytes: int) -> dict:
    """A safetensors file of `megabytes` MB of samples, written in slices (this process never holds it whole)."""
    n = megabytes * 1_000_000 // (FEATURES * 4)
    g = torch.Generator().manual_seed(SEED)
    centres = torch.randn(CLASSES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + 0.5 * torch.randn(n, FEATURES, generator=g)
    save_file({"x": x, "y": y}, str(path))
    del x
    with path.open("rb") as handle:
        return inspect_file(handle, path.stat().st_size, "safetensors")


def dataset_config(facts: dict) -> dict:
    return validate_dataset_config({"name": "uploaded", "dataset_id": DATASET_ID, "batch_size": BATCH,
                                    "val_batch_size": 256, "format": "safetensors", **facts})


def drive(path: str, facts_json: str, peers_json: str, steps: int, job_id: str) -> None:
    """The driver process: train, then print its peak RSS in bytes. `peers_json`: the agents' TLS certificates
    by address, in stage order, and the driver's token (both made in the parent process)."""
    peers = json.loads(peers_json)
    from arceus.training.driver import train
    from arceus.training.plan import StageEndpoint, TrainPlan
    from arceus.training.recording import RecordingSink

    plan = TrainPlan(
        job_id=job_id, generation=1, credential=peers["token"],
        stages=tuple(StageEndpoint(i, a, f"agent-{i}", i, i + 1, certificate=c)
                     for i, (a, c) in enumerate(peers["certificates"].items())),
        dataset=dataset_config(json.loads(facts_json)), epochs=1, learning_rate=LR, micro_batches=MICRO_BATCHES,
        seed=SEED, max_steps=steps, open_dataset=lambda _: _Counted(open(path, "rb")),  # noqa: SIM115
    )
    result = train(plan, RecordingSink())
    peak = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_bytes": peak, "steps": result.steps, "val_accuracy": result.val_accuracy,
                      "driver_read_bytes": _Counted.total}))


class _Counted:
    """A file whose reads are counted (in `total`, over every file opened so)."""

    total = 0

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def read(self, n: int = -1) -> bytes:
        data = self._handle.read(n)
        _Counted.total += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *_: object) -> None:
        self._handle.close()


def file_reader(paths: dict[str, Path]) -> Any:
    """What the agents read a job's rows with: byte ranges of its file, bounded as the control plane bounds them."""

    def read(job_id: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        path = paths[job_id]
        ranges_checked(ranges, [(0, path.stat().st_size)])
        with path.open("rb") as handle:
            out = []
            for start, stop in ranges:
                handle.seek(start)
                out.append(handle.read(stop - start))
            return out

    return read


def driver_memory(sizes: list[int], steps: int, workdir: Path) -> list[dict]:
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    files = {}
    for megabytes in sizes:
        path = workdir / f"data-{megabytes}mb.safetensors"
        files[megabytes] = (path, write_dataset(path, megabytes))
    jobs = [f"bench-data-{m}" for m in sizes]
    per_job = [pipeline_assignments(
        job_id=job_id, model_config=MODEL, boundaries=[0, 1, 2], addresses=addresses,
        optimizer={"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0}, seed=SEED,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size({"batch_size": BATCH,
                                                                                 "val_batch_size": 256},
                                                                                MICRO_BATCHES),
    ) for job_id in jobs]
    reader = file_reader({job_id: files[m][0] for job_id, m in zip(jobs, sizes, strict=True)})
    agents = []
    for i, address in enumerate(addresses):
        agents.append(Agent(device=torch.device("cpu"), listen=address, identity=identity_for(address),
                            read_dataset=reader))
        agents[-1].start()
        remember_identity(address, identity_for(address))
        agents[-1].apply_assignments([Assignment.from_json(a[i]) for a in per_job])
    rows = []
    try:
        for megabytes, job_id in zip(sizes, jobs, strict=True):
            path, facts = files[megabytes]
            out = subprocess.run(
                [sys.executable, __file__, "--drive", str(path), json.dumps(facts),
                 json.dumps({"certificates": {a: identity_for(a).certificate for a in addresses},
                             "token": driver_token(job_id, 1)}), str(steps), job_id],
                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())},
            )
            if out.returncode:
                raise RuntimeError(f"the driver of {megabytes} MB failed:\n{out.stderr[-3000:]}")
            out = out.stdout.strip().splitlines()[-1]
            rows.append({"dataset_mb": megabytes, "samples": facts["samples"], **json.loads(out)})
    finally:
        for agent in agents:
            agent.stop(grace=1)
    return rows


def upload(megabytes: int, workdir: Path) -> dict:
    from devtools.cluster import LocalCluster

    path = workdir / "upload.safetensors"
    facts = write_dataset(path, megabytes)
    cluster = LocalCluster(workdir=workdir / "cluster", database_url=os.environ.get("DATABASE_URL"),
                           redis_url=os.environ.get("REDIS_URL"))
    cluster.start()
    try:
        size = path.stat().st_size

        def cut_off(sent: int, total: int) -> None:
            if sent >= 0.4 * total:
                raise _CutOff  # as a developer's Ctrl-C or a dropped connection would

        started = time.perf_counter()
        with contextlib.suppress(_CutOff):
            cluster.client.upload_dataset(path, "safetensors", on_progress=cut_off)
        first = time.perf_counter() - started
        offsets: list[int] = []
        started = time.perf_counter()
        dataset = cluster.client.upload_dataset(path, "safetensors", on_progress=lambda s, _: offsets.append(s))
        second = time.perf_counter() - started
    finally:
        cluster.stop()
    assert dataset["status"] == "ready" and dataset["facts"] == facts, dataset
    resumed_from = offsets[0] - (16 << 20) if offsets else size
    return {"upload_bytes": size, "resumed_from_byte": resumed_from, "first_attempt_s": round(first, 2),
            "resumed_attempt_s": round(second, 2), "resumed_bytes": size - resumed_from}


class _CutOff(Exception):
    pass


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":
        _, _, path, facts, peers, steps, job_id = sys.argv
        drive(path, facts, peers, int(steps), job_id)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[25, 100, 200])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--upload-mb", type=int, default=200, help="0: skip the upload")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="arceus-bench-data-") as directory:
        workdir = Path(directory)
        rows = driver_memory(args.sizes_mb, args.steps, workdir)
        uploaded = upload(args.upload_mb, workdir) if args.upload_mb else None
    growth = rows[-1]["peak_rss_bytes"] - rows[0]["peak_rss_bytes"]
    table = ("| dataset | samples | driver peak RSS | driver read of the file | val accuracy |\n"
             "| --- | --- | --- | --- | --- |\n") + "".join(
        f"| {r['dataset_mb']} MB | {r['samples']:,} | {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
        f"{r['driver_read_bytes']:,} B | {r['val_accuracy']:.3f} |\n" for r in rows
    )
    text = (
        "## Uploaded datasets: driver memory and a resumed upload (`bench/dataset_streaming.py`)\n\n"
        f"{machine_line()}. MLP {MODEL['layer_sizes']} over two agents (in the bench's process), batch {BATCH}, "
        f"{args.steps} steps and a validation pass over the last tenth; each driver in a fresh process; the stages "
        "read their rows by byte range, the driver the file's header.\n\n" + table +
        f"\nPeak RSS grows {growth / 2**20:.0f} MiB from {rows[0]['dataset_mb']} MB to {rows[-1]['dataset_mb']} "
        "MB of data.\n"
    )
    if uploaded:
        text += (
            f"\nUpload of {uploaded['upload_bytes'] / 1e6:.0f} MB through `ArceusClient.upload_dataset` (16 MiB "
            f"pieces): cut off after {uploaded['first_attempt_s']} s, resumed from byte "
            f"{uploaded['resumed_from_byte']:,} and completed (pieces joined, SHA-256 and format checked) in "
            f"{uploaded['resumed_attempt_s']} s.\n"
        )
    write_section("dataset_streaming", text)
    print(text)
    print(json.dumps({"driver": rows, "peak_rss_growth_bytes": growth, "upload": uploaded}))


if __name__ == "__main__":
    main()
