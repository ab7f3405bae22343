"""Samples/s of the 3-agent MLP pipeline over gRPC vs the same model trained in one process.

    .venv/bin/python bench/pipeline_vs_single.py [--steps 200] [--rounds 3]

Both sides train the digits MLP [64, 128, 64, 10] with the same batches, seed and SGD settings;
rounds alternate pipeline and single process so that machine noise hits both alike. The pipeline's
three agents are separate processes (static assignments, no control plane) on loopback; the driver
runs in this process. Per-step overhead: a step's wall time (from the end of the step before to its own, as the
driver sees them) minus the busiest stage's compute (as the agents measure it), the median over the timed steps.
Prints a table, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from arceus.model.build import build_full_model  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import free_ports, spawn_static_agents, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, pipeline_assignments  # noqa: E402

MODEL = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32, "val_batch_size": 360})
LR, MOMENTUM, SEED, MICRO_BATCHES, WARMUP = 0.05, 0.9, 0, 4, 10


def _rate(times: list[float], steps: int) -> float:
    """Samples/s over the steps after warm-up (every step here is a full batch of 32)."""
    measured = times[WARMUP:steps]
    return (len(measured) - 1) * DATASET["batch_size"] / (measured[-1] - measured[0])


class OverheadClock(Clock):
    """Each step's end and its overhead: the time since the step before ended beyond the busiest stage's compute."""

    def __init__(self) -> None:
        super().__init__()
        self.overheads: list[float] = []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        if len(self.times) > 1:
            self.overheads.append(self.times[-1] - self.times[-2] - max(t.compute_seconds for t in p.timings))


def run_pipeline(addresses: list[str], steps: int, job_id: str) -> tuple[float, float]:
    """(samples/s, median per-step overhead in seconds) after warm-up."""
    plan = TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1),
        stages=tuple(StageEndpoint(i, a, f"agent-{i}", i, i + 1,
            certificate=identity_for(a).certificate) for i, a in enumerate(addresses)),
        dataset=DATASET, epochs=1, learning_rate=LR, micro_batches=MICRO_BATCHES, seed=SEED, max_steps=steps,
    )
    clock = OverheadClock()
    train(plan, clock)
    return _rate(clock.times, steps), statistics.median(clock.overheads[WARMUP - 1 : steps - 1])


def run_single(steps: int) -> float:
    torch.set_num_threads(1)  # like each agent
    model = build_full_model(model_spec_from_config(MODEL), SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y, _, _ = load_dataset(DATASET)
    times = []
    for idx in epoch_batches(len(x), DATASET["batch_size"], SEED, 1)[:steps]:
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
        times.append(time.perf_counter())
    return _rate(times, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=44, help="steps per round (one digits epoch is 45)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")

    addresses = [f"127.0.0.1:{p}" for p in free_ports(3)]
    pipeline, single, overheads = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        # One agent process per stage; each round is its own job, so every round starts from the seed.
        jobs = [f"bench-{r}" for r in range(args.rounds)]
        rounds_assignments = []
        for job_id in jobs:
            rounds_assignments.append(pipeline_assignments(
                job_id=job_id, model_config=MODEL, boundaries=[0, 1, 2, 3], addresses=addresses,
                optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0}, seed=SEED,
                micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            ))
        per_agent = [[r[i] for r in rounds_assignments] for i in range(3)]
        agents = spawn_static_agents(per_agent, addresses, Path(workdir))
        try:
            for job_id in jobs:
                rate, overhead = run_pipeline(addresses, args.steps, job_id)
                pipeline.append(rate)
                overheads.append(overhead * 1000)
                single.append(run_single(args.steps))
        finally:
            stop_agents(agents)

    figures = {
        "pipeline_samples_per_s": round(statistics.median(pipeline), 1),
        "single_process_samples_per_s": round(statistics.median(single), 1),
        "pipeline_step_overhead_ms": round(statistics.median(overheads), 2),
        "rounds": args.rounds, "steps_per_round": args.steps, "micro_batches": MICRO_BATCHES,
        "batch_size": DATASET["batch_size"], "stages": 3,
    }
    figures["ratio_pipeline_to_single"] = round(
        figures["pipeline_samples_per_s"] / figures["single_process_samples_per_s"], 3
    )
    table = (
        "| setup | samples/s (median) | per round |\n| --- | --- | --- |\n"
        f"| 3 agents over gRPC, GPipe M={MICRO_BATCHES} | {figures['pipeline_samples_per_s']} | "
        f"{', '.join(f'{v:.0f}' for v in pipeline)} |\n"
        f"| one process | {figures['single_process_samples_per_s']} | {', '.join(f'{v:.0f}' for v in single)} |\n"
        f"\nRatio pipeline / one process: **{figures['ratio_pipeline_to_single']}**; per-step overhead of the "
        "pipeline (step wall time minus the busiest stage's compute, median): "
        f"**{figures['pipeline_step_overhead_ms']} ms** (per round: {', '.join(f'{v:.2f}' for v in overheads)})\n"
    )
    write_section("pipeline_vs_single", (
        "## MLP pipeline vs one process (`bench/pipeline_vs_single.py`)\n\n"
        f"{machine_line()}. Digits MLP [64, 128, 64, 10], batch {DATASET['batch_size']}, "
        f"{args.rounds} alternating rounds of {args.steps} steps ({WARMUP} warm-up steps not timed), "
        "one torch thread per process.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
