"""Samples/s of a ≈5M-parameter GPT in 2 pipeline stages: Arceus agents over gRPC vs
`torch.distributed.pipelining` (gloo) vs one process, measured side by side.

    .venv/bin/python bench/pipeline_vs_torch.py [--steps 20] [--rounds 3] [--schedule 1f1b]

Every setup trains the same model (d_model 256, 6 blocks, 8 heads, block 128, character vocabulary of the
bundled text) on the same batches (16 windows, M = 4 micro-batches) with Adam, from the same seeded
weights, split after block 3 (embedding + 3 blocks | 3 blocks + head). Pipeline stages are separate
processes with one torch thread each, with one difference, said in the table: the Arceus agents share
this machine and lend each other its cores (`--solo-threads`, every core) in the actions no other stage
computes alongside (the pipeline's fill and drain, arceus.pipeline.solo); torch pipelining has no such
thing, so it also runs with every core per stage (oversubscribed) for comparison. The one-process
baseline uses every core. Every process, the torch workers' too, runs with the agent's process settings:
the OpenMP spin cap (nodeagent.openmp) and freed blocks kept in the heap (nodeagent.heap). Rounds
alternate the setups so machine noise hits them alike. Prints a table, writes docs/BENCHMARKS.md, and ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.openmp import cap_openmp_spin  # noqa: E402

# Before torch loads libgomp, here and (inherited) in every worker this spawns, as `python -m nodeagent`
# does for the agents.
cap_openmp_spin()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.batches import epoch_batches  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.data.loader import load_dataset  # noqa: E402
from arceus.data.text_config import text_vocabulary  # noqa: E402
from arceus.model.build import build_full_model, build_layers  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import StageEndpoint, TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import free_ports, spawn_static_agents, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, pipeline_assignments  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402

DATASET = validate_dataset_config({"name": "text", "batch_size": 16, "val_batch_size": 64, "block_size": 128})
MODEL: dict[str, Any] = {
    "type": "transformer", "n_layer": 6, "n_head": 8, "d_model": 256, "block_size": 128,
    "vocab_size": len(text_vocabulary(DATASET)),
}
SPLIT = 4  # layers [0, 4) = embedding + blocks 1-3; [4, 8) = blocks 4-6 + head
LR, SEED, MICRO_BATCHES, WARMUP = 3e-4, 0, 4, 2
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y, _, _ = load_dataset(DATASET)
    return [(x[i], y[i]) for i in epoch_batches(len(x), DATASET["batch_size"], SEED, 1)[:steps]]


def step_rate(times: list[float]) -> float:
    """Samples/s between the end of the last warm-up step and the end of the last step."""
    measured = times[WARMUP - 1 :]
    return (len(measured) - 1) * DATASET["batch_size"] / (measured[-1] - measured[0])


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


# --- one process ---------------------------------------------------------------------------------------
def _single_worker(steps: int, threads: int, out: Any) -> None:
    retain_freed_blocks()  # as an agent does
    torch.set_num_threads(threads)
    model = build_full_model(model_spec_from_config(MODEL), SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    times = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        gpt_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter())
    out.put(step_rate(times))


def run_single(steps: int, threads: int) -> float:
    """In a fresh process, like the torch pipelining stages: run in this process, which holds the driver's
    gRPC threads, 2 torch threads measured slower than 1 (8.8 vs 13.0 samples/s)."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    worker = ctx.Process(target=_single_worker, args=(steps, threads, out))
    worker.start()
    worker.join()
    if worker.exitcode:
        raise RuntimeError(f"the one-process run exited with {worker.exitcode}")
    return out.get()


# --- torch.distributed.pipelining ------------------------------------------------------------------------
def _torch_stage_worker(rank: int, port: int, schedule: str, steps: int, threads: int, out: Any) -> None:
    retain_freed_blocks()  # as an agent does
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        spec = model_spec_from_config(MODEL)
        start, end = (0, SPLIT) if rank == 0 else (SPLIT, spec.num_layers)
        module = build_layers(spec, start, end, SEED)
        micro = DATASET["batch_size"] // MICRO_BATCHES
        example = (
            torch.zeros(micro, MODEL["block_size"], dtype=torch.int64)
            if rank == 0
            else torch.zeros(micro, MODEL["block_size"], MODEL["d_model"])
        )
        stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(example,))
        runner = TORCH_SCHEDULES[schedule](stage, n_microbatches=MICRO_BATCHES, loss_fn=gpt_loss)
        optimizer = torch.optim.Adam(module.parameters(), lr=LR)
        times = []
        for x, y in batches(steps):
            optimizer.zero_grad()
            if rank == 0:
                runner.step(x)
            else:
                runner.step(target=y)
            optimizer.step()
            times.append(time.perf_counter())
        if rank == 1:
            out.put(step_rate(times))
    finally:
        dist.destroy_process_group()


def run_torch_pipelining(steps: int, schedule: str, threads: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_ports(1)[0]
    workers = [
        ctx.Process(target=_torch_stage_worker, args=(r, port, schedule, steps, threads, out)) for r in range(2)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if any(w.exitcode for w in workers):
        raise RuntimeError(f"torch pipelining workers exited with {[w.exitcode for w in workers]}")
    return out.get()


# --- Arceus agents over gRPC -------------------------------------------------------------------------------
def run_arceus(addresses: list[str], steps: int, job_id: str, schedule: str) -> float:
    end = model_spec_from_config(MODEL).num_layers
    plan = TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1),
        stages=(
            StageEndpoint(0, addresses[0], "agent-0", 0, SPLIT, certificate=identity_for(addresses[0]).certificate),
            StageEndpoint(1, addresses[1], "agent-1", SPLIT, end, certificate=identity_for(addresses[1]).certificate),
        ),
        dataset=DATASET, epochs=1, learning_rate=LR, micro_batches=MICRO_BATCHES, seed=SEED, max_steps=steps,
        schedule=schedule,
    )
    clock = Clock()
    train(plan, clock)
    return step_rate(clock.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", choices=sorted(TORCH_SCHEDULES), default="1f1b")
    args = parser.parse_args()
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")

    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    results: dict[str, list[float]] = {
        "arceus": [], "torch_pp": [], "torch_pp_all_cores": [], "single": [], "single_1_thread": []
    }
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    end = model_spec_from_config(MODEL).num_layers
    with tempfile.TemporaryDirectory() as workdir:
        jobs = [f"bench-gpt-{r}" for r in range(args.rounds)]
        per_round = [
            pipeline_assignments(
                job_id=job_id, model_config=MODEL, boundaries=[0, SPLIT, end], addresses=addresses,
                optimizer={"name": "adam", "lr": LR}, seed=SEED, micro_batches=MICRO_BATCHES,
                max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            )
            for job_id in jobs
        ]
        agents = spawn_static_agents(
            [[r[i] for r in per_round] for i in range(2)], addresses, Path(workdir), threads=1, solo_threads=cores
        )
        try:
            for job_id in jobs:
                results["arceus"].append(run_arceus(addresses, args.steps, job_id, args.schedule))
                results["torch_pp"].append(run_torch_pipelining(args.steps, args.schedule, 1))
                results["torch_pp_all_cores"].append(run_torch_pipelining(args.steps, args.schedule, cores))
                results["single"].append(run_single(args.steps, cores))
                results["single_1_thread"].append(run_single(args.steps, 1))
        finally:
            stop_agents(agents)

    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in results.items()}
    figures = {
        "arceus_samples_per_s": round(med["arceus"], 2),
        "torch_pp_samples_per_s": round(med["torch_pp"], 2),
        "torch_pp_all_cores_samples_per_s": round(med["torch_pp_all_cores"], 2),
        "single_process_samples_per_s": round(med["single"], 2),
        "single_process_1_thread_samples_per_s": round(med["single_1_thread"], 2),
        "schedule": args.schedule, "stages": 2, "micro_batches": MICRO_BATCHES,
        "batch_size": DATASET["batch_size"], "rounds": args.rounds, "steps_per_round": args.steps,
        "ratio_arceus_to_torch_pp": round(med["arceus"] / med["torch_pp"], 3),
        "ratio_arceus_to_single": round(med["arceus"] / med["single"], 3),
        "ratio_torch_pp_to_single": round(med["torch_pp"] / med["single"], 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    labels = {
        "arceus": f"Arceus, 2 agents over gRPC, {args.schedule}: 1 thread each, {cores} in solo actions",
        "torch_pp": f"torch.distributed.pipelining (gloo), {args.schedule}: 1 thread per stage",
        "torch_pp_all_cores": f"torch.distributed.pipelining (gloo), {args.schedule}: {cores} threads per stage",
        "single": f"one process, {cores} threads",
        "single_1_thread": "one process, 1 thread",
    }
    table = "| setup | samples/s (median) | per round |\n| --- | --- | --- |\n" + "".join(
        f"| {labels[k]} | {med[k]:.2f} | {', '.join(f'{v:.2f}' for v in results[k])} |\n" for k in results
    ) + (
        f"\nArceus / torch pipelining: **{figures['ratio_arceus_to_torch_pp']}**; "
        f"Arceus / one process: **{figures['ratio_arceus_to_single']}**; "
        f"torch pipelining / one process: **{figures['ratio_torch_pp_to_single']}**\n"
    )
    params = sum(model_spec_from_config(MODEL).layer_params())
    write_section(f"pipeline_vs_torch_{args.schedule}", (
        f"## GPT pipeline vs torch pipelining vs one process, {args.schedule} (`bench/pipeline_vs_torch.py`)\n\n"
        f"{machine_line()}. GPT d_model 256, 6 blocks, 8 heads, block 128, vocab {MODEL['vocab_size']} "
        f"({params / 1e6:.2f}M parameters), batch {DATASET['batch_size']}, M={MICRO_BATCHES}, Adam; 2 stages "
        f"split at layer {SPLIT}, one torch thread per stage process (Arceus agents: {cores} in the actions no "
        f"other stage computes alongside, lent by the idle one); every process with the agent's OpenMP spin "
        f"cap ({os.environ.get('GOMP_SPINCOUNT', 'not set: an operator choice')}) and heap setting; "
        f"{args.rounds} alternating rounds of "
        f"{args.steps} steps ({WARMUP} warm-up steps not timed). `python bench/pipeline_vs_torch.py "
        f"--steps {args.steps} --rounds {args.rounds} --schedule {args.schedule}`; load average (1, 5, 15 min) "
        f"{figures['load_average_before']} before, {figures['load_average_after']} after.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
