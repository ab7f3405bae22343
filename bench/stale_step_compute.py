"""One stage's compute for a train step, synchronous vs staleness 1 (PipeDream-2BW), in one process.

    .venv/bin/python bench/stale_step_compute.py [--steps 8] [--rounds 2]

The middle stage of bench/shaped_pipeline.py's 3-stage GPT (layers [3, 5), Adam, one torch thread) runs the same 4
micro-batches (random activations and output gradients, batch 16 × 128 tokens) each step, three ways: synchronous;
staleness 1 alone (`stale_begin`, forwards, backwards, `stale_gradients`, update: what a step that is not chained
runs); and staleness 1 overlapped (step n+1's forwards in a second thread beside step n's backwards, as a stage runs
chained steps). Per step: the compute the stage counts (wall seconds, `RuntimeCounters.compute_seconds`) and the
process's CPU seconds (user + system); medians over the steps after the first two, per round, rounds alternating
the modes. Same ops either way (tests/nodeagent/test_nodeagent_stale_compute.py): a gap between wall and CPU is time
the thread waited for a core. Writes docs/BENCHMARKS.md and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import OptimizerConfig  # noqa: E402
from arceus.model.build import build_layers  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from bench.pipeline_vs_torch import LR, MICRO_BATCHES, MODEL, SEED  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402
from nodeagent.runtime import StageRuntime  # noqa: E402

LAYERS = (3, 5)  # bench/shaped_pipeline.py's middle stage
MICRO_BATCH = 4  # samples: batch 16 in 4 micro-batches
WARMUP = 2
MODES = ("synchronous", "stale_alone", "stale_overlapped")


def stage() -> StageRuntime:
    spec = model_spec_from_config(MODEL)
    return StageRuntime(
        build_layers(spec, *LAYERS, SEED), optimizer=OptimizerConfig("adam", LR), is_first=False, is_last=False,
        input_layout=spec.input_layout(LAYERS[0]), max_micro_batch_size=MICRO_BATCH, device=torch.device("cpu"),
    )


def micro_batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    shape = (MICRO_BATCH, MODEL["block_size"], MODEL["d_model"])
    return ([torch.randn(shape, generator=g) for _ in range(MICRO_BATCHES)],
            [torch.randn(shape, generator=g) for _ in range(MICRO_BATCHES)])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_mode(mode: str, steps: int) -> tuple[float, float]:
    """Median (counted compute, process CPU) seconds per step after the warm-up."""
    rt, (xs, grads) = stage(), micro_batches()

    def forwards(step: int) -> None:
        if mode != "synchronous":
            rt.stale_begin(step)
        for m, x in enumerate(xs):
            rt.forward((step, m), x)

    def backwards(step: int) -> None:
        for m, grad in enumerate(grads):
            rt.backward((step, m), grad)

    def finish(step: int) -> None:
        if mode != "synchronous":
            rt.stale_gradients(step)
        rt.optimizer_step()

    def one_step(step: int) -> None:
        if mode != "stale_overlapped":
            forwards(step)
            backwards(step)
        else:  # this step's forwards ran beside the step before's backwards; the next step's run beside its own
            chained = threading.Thread(target=forwards, args=(step + 1,))
            chained.start()
            backwards(step)
            chained.join()
        finish(step)

    if mode == "stale_overlapped":
        forwards(1)
    figures = [measured(rt, lambda s=step: one_step(s)) for step in range(1, steps + 1)]
    kept = figures[WARMUP:]
    return statistics.median(f[0] for f in kept), statistics.median(f[1] for f in kept)


def measured(rt: StageRuntime, step: Callable[[], None]) -> tuple[float, float]:
    counted, cpu = rt.counters.compute_seconds, cpu_seconds()
    step()
    return rt.counters.compute_seconds - counted, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    torch.set_num_threads(1)
    retain_freed_blocks()  # as an agent does
    load = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            started = time.perf_counter()
            results[mode].append(run_mode(mode, args.steps))
            print(f"{mode} round {r}: {results[mode][-1]} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    compute = {mode: statistics.median(f[0] for f in results[mode]) for mode in MODES}
    cpu = {mode: statistics.median(f[1] for f in results[mode]) for mode in MODES}
    figures = {
        **{f"{mode}_compute_s": round(compute[mode], 3) for mode in MODES},
        **{f"{mode}_cpu_s": round(cpu[mode], 3) for mode in MODES},
        "steps": args.steps, "warmup_steps": WARMUP, "rounds": args.rounds, "load_at_start": load,
    }
    rows = "".join(
        f"| {mode} | {compute[mode]:.3f} | {cpu[mode]:.3f} | "
        f"{' / '.join(f'{c:.3f}, {p:.3f}' for c, p in results[mode])} |\n" for mode in MODES
    )
    write_section("stale_step_compute", (
        f"## One stage's train step, synchronous vs staleness 1, in one process (`bench/stale_step_compute.py "
        f"--steps {args.steps} --rounds {args.rounds}`)\n\n"
        f"{machine_line()}; load average {load} at the start. The middle stage of `bench/shaped_pipeline.py`'s "
        f"3-stage GPT (layers [{LAYERS[0]}, {LAYERS[1]}), Adam, one torch thread), the same {MICRO_BATCHES} "
        f"micro-batches of {MICRO_BATCH} × {MODEL['block_size']} tokens each step; medians over steps "
        f"{WARMUP + 1}-{args.steps}, then over rounds. `stale_overlapped`: step n+1's forwards in a second thread "
        "beside step n's backwards, as a stage runs chained steps.\n\n"
        "| mode | compute counted, s/step | process CPU, s/step | per round (counted, CPU) |\n"
        "| --- | --- | --- | --- |\n" + rows
    ))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
