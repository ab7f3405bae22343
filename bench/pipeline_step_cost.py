"""Where a pipeline step's time goes on a shared machine: the CPU each step costs, by micro-batch count, beside
one process training the same model. A fast, smaller stand-in for bench/large_model.py's step time.

    .venv/bin/python bench/pipeline_step_cost.py [--n-layer 8] [--steps 5] [--micro-batches 8 4 2]

The model has bench/large_model.py's widths (GPT, d_model 1024, 16 heads, block 128, batch 8, Adam) with fewer
layers, split evenly over four static agents (no control plane; the driver runs in this process) of one torch
thread each (two while their stage computes alone: --solo-threads 2), as in that benchmark. For each micro-batch
count it trains `--steps` steps and reads every agent's and the driver's CPU seconds (/proc) at each step; then one
process (2 threads) trains the same steps. The agents' CPU seconds per step depend little on what else the
machine runs, and the four agents keep both cores busy (at least two of them, or one lending threads, can always
compute), so on a quiet machine of two cores the CPU ratio bounds the step-time ratio. On a loaded one the one
process's CPU rises (its two OpenMP threads spin while either waits for a core) and the ratio reads low. Prints
a table, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.batches import epoch_batches  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.data.loader import load_dataset  # noqa: E402
from arceus.data.text_config import BUNDLED_TEXT  # noqa: E402
from arceus.model.build import build_full_model  # noqa: E402
from arceus.model.optimizers import make_optimizer  # noqa: E402
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import free_ports, spawn_static_agents, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, pipeline_assignments, stage_endpoints  # noqa: E402

BATCH, STAGES, LR = 8, 4, 1e-4


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of every thread of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuClock(Clock):
    """Each step's end time and the CPU seconds of `pids` at it."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__()
        self.pids = pids
        self.cpu = [[cpu_seconds(p) for p in pids]]

    def on_step(self, p) -> None:  # noqa: ANN001 (arceus.training.plan.StepProgress)
        super().on_step(p)
        self.cpu.append([cpu_seconds(q) for q in self.pids])


def job_config(n_layer: int, steps: int, workdir: Path) -> tuple[dict, dict]:
    """(model config, dataset config) of a text cut to `steps` + 2 batches."""
    source = workdir / "text.txt"
    chars = int(((steps + 2) * BATCH * 128 + 2) / 0.9) + 1
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    dataset = validate_dataset_config(
        {"name": "text", "source": str(source), "batch_size": BATCH, "val_batch_size": BATCH}
    )
    _, model, dataset = fit_model_to_dataset(
        {"type": "transformer", "n_layer": n_layer, "n_head": 16, "d_model": 1024, "block_size": 128}, dataset
    )
    return model, dataset


def one_process(model_config: dict, dataset: dict, steps: int) -> None:
    """(In a child process.) Print the seconds and CPU seconds of each step of one process, 2 threads."""
    torch.set_num_threads(2)
    model = build_full_model(model_spec_from_config(model_config), 0)
    optimizer = make_optimizer(model.parameters(), "adam", LR)
    x, y, _, _ = load_dataset(dataset)
    seconds, cpu = [], []
    for indices in epoch_batches(len(x), dataset["batch_size"], 0, 1)[:steps]:
        started, cpu_before = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(x[indices]).flatten(0, 1), y[indices].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_before)
    print(json.dumps({"seconds": seconds, "cpu": cpu}))


def pipeline(model_config: dict, dataset: dict, micro_batches: int, steps: int, workdir: Path) -> dict:
    """Seconds and CPU seconds (agents, driver) of each step after the first through four agents."""
    per_stage = model_config["n_layer"] // STAGES
    boundaries = [0, *(1 + per_stage * i for i in range(1, STAGES)), model_config["n_layer"] + 2]
    addresses = [f"127.0.0.1:{p}" for p in free_ports(STAGES)]
    job_id = f"step-cost-{micro_batches}"
    assignments = pipeline_assignments(
        job_id=job_id, model_config=model_config, boundaries=boundaries, addresses=addresses,
        optimizer={"name": "adam", "lr": LR}, seed=0, micro_batches=micro_batches,
        max_micro_batch_size=max_micro_batch_size(dataset, micro_batches),
    )
    agents = spawn_static_agents([[a] for a in assignments], addresses, workdir / job_id, threads=1, solo_threads=2)
    try:
        clock = CpuClock([a.process.pid for a in agents] + [os.getpid()])
        plan = TrainPlan(
            job_id=job_id, generation=1, credential=driver_token(job_id), stages=stage_endpoints(addresses, boundaries),
            dataset=dataset, epochs=1, learning_rate=LR, micro_batches=micro_batches, seed=0, max_steps=steps,
        )
        train(plan, clock)
    finally:
        stop_agents(agents)
    cpu, times = clock.cpu, clock.times
    per_step = [[b - a for a, b in zip(x, y, strict=True)] for x, y in zip(cpu, cpu[1:], strict=False)]
    return {
        "seconds": [b - a for a, b in zip(times, times[1:], strict=False)],
        "agents_cpu": [sum(step[:-1]) for step in per_step[1:]],
        "driver_cpu": [step[-1] for step in per_step[1:]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8, help="GPT blocks, a multiple of 4")
    parser.add_argument("--steps", type=int, default=5, help="steps per configuration; the first is not counted")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--one-process", help=argparse.SUPPRESS)  # the child's [model, dataset, steps] JSON
    args = parser.parse_args()
    if args.one_process:
        one_process(*json.loads(args.one_process))
        return
    if args.n_layer % STAGES or args.steps < 3:
        parser.error(f"--n-layer must be a multiple of {STAGES} and --steps at least 3")

    with tempfile.TemporaryDirectory(prefix="arceus-step-cost-") as workdir:
        os.environ["ARCEUS_DATA_ROOT"] = workdir  # where the driver may read the text from
        model_config, dataset = job_config(args.n_layer, args.steps, Path(workdir))
        runs, loads = {}, {}
        for m in args.micro_batches:
            loads[m] = os.getloadavg()[0]
            runs[m] = pipeline(model_config, dataset, m, args.steps, Path(workdir))
            print(f"{m} micro-batches: {runs[m]}", file=sys.stderr, flush=True)
        loads["one"] = os.getloadavg()[0]
        child = subprocess.run(
            [sys.executable, __file__, "--one-process", json.dumps([model_config, dataset, args.steps])],
            capture_output=True, text=True, check=True,
        )
        single = json.loads(child.stdout.strip().splitlines()[-1])

    one_cpu, one_seconds = statistics.median(single["cpu"][1:]), statistics.median(single["seconds"][1:])
    figures = {
        "n_layer": args.n_layer, "steps": args.steps,
        "one_process": {"cpu_per_step": round(one_cpu, 2), "seconds_per_step": round(one_seconds, 2),
                        "load_average_1m": round(loads["one"], 1)},
        "pipeline": {
            m: {"micro_batch_size": BATCH // m, "agents_cpu_per_step": round(statistics.median(r["agents_cpu"]), 2),
                "driver_cpu_per_step": round(statistics.median(r["driver_cpu"]), 3),
                "seconds_per_step": round(statistics.median(r["seconds"]), 2),
                "cpu_ratio": round(statistics.median(r["agents_cpu"]) / one_cpu, 2),
                "load_average_1m": round(loads[m], 1)}
            for m, r in runs.items()
        },
    }
    rows = "\n".join(
        f"| 4 agents, {m} micro-batches of {f['micro_batch_size']} | {f['agents_cpu_per_step']} "
        f"(driver {f['driver_cpu_per_step']}) | {f['cpu_ratio']} | {f['seconds_per_step']} | {f['load_average_1m']} |"
        for m, f in figures["pipeline"].items()
    )
    one = figures["one_process"]
    one_row = (f"| one process, 2 threads | {one['cpu_per_step']} | 1.00 | {one['seconds_per_step']} | "
               f"{one['load_average_1m']} |")
    body = f"""## A pipeline step's CPU by micro-batch count (`bench/pipeline_step_cost.py`)

{machine_line()}

GPT of bench/large_model.py's widths with {args.n_layer} blocks (d_model 1024, block 128, batch {BATCH}, Adam),
{args.n_layer // STAGES} blocks per stage on 4 static agents of one torch thread (two while alone), driver in the
benchmark's process; {args.steps} steps per row, the first not counted. CPU seconds per step are what the agents
(or the one process, 2 threads) spent, from /proc; on a quiet machine of two cores their ratio bounds the step-time
ratio. Under load the one process's two threads spin waiting for each other and its CPU rises, and seconds per
step follow the load (the last column: the 1-minute load average).

| setup | CPU s per step | / one process | s per step | load |
| --- | ---: | ---: | ---: | ---: |
{one_row}
{rows}
"""
    print(body)
    write_section("pipeline_step_cost", body)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
