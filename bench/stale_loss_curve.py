"""What staleness 1 (PipeDream-2BW) does to the loss curve of the GPT of bench/shaped_pipeline.py.

    .venv/bin/python bench/stale_loss_curve.py [--steps 40]

Trains the GPT of bench/pipeline_vs_torch.py (same model, text batches, Adam, learning rate, seed) in one process
(`devtools.reference.reference_run`) synchronously and with staleness 1: each step's gradient taken at the weights
before the previous step's update. A pipeline with `"staleness": 1` equals this one-process run with the same rule
(tests/arceus/training/test_stale_steps.py), as a synchronous one equals the synchronous run, so these are the
pipeline's training losses without its network. Writes docs/BENCHMARKS.md and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline_vs_torch import DATASET, LR, MODEL, SEED  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.reference import reference_run  # noqa: E402

TAIL = 5  # the last steps averaged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    args = parser.parse_args()
    if args.steps <= TAIL:
        parser.error(f"--steps must exceed {TAIL}")
    job = {"model_config": MODEL, "dataset_config": DATASET, "epochs": 1, "learning_rate": LR, "optimizer": "adam",
           "seed": SEED}
    synchronous, stale = (reference_run({**job, "staleness": s}, max_steps=args.steps).losses for s in (0, 1))
    tail = [statistics.mean(losses[-TAIL:]) for losses in (synchronous, stale)]
    figures = {
        "steps": args.steps, "synchronous_last": round(synchronous[-1], 4), "stale_last": round(stale[-1], 4),
        f"synchronous_mean_last_{TAIL}": round(tail[0], 4), f"stale_mean_last_{TAIL}": round(tail[1], 4),
    }
    rows = "".join(
        f"| {step} | {a:.4f} | {b:.4f} | {b - a:+.4f} |\n"
        for step, (a, b) in enumerate(zip(synchronous, stale, strict=True), 1)
        if step <= 3 or step % 5 == 0 or step == args.steps
    )
    table = (
        "| step | synchronous | staleness 1 | difference |\n| --- | --- | --- | --- |\n" + rows
        + f"\nMean of the last {TAIL} steps: synchronous {tail[0]:.4f}, staleness 1 {tail[1]:.4f} "
        f"({tail[1] - tail[0]:+.4f}).\n"
    )
    write_section("stale_loss_curve", (
        f"## Staleness 1 vs synchronous: the bench GPT's training loss (`bench/stale_loss_curve.py --steps "
        f"{args.steps}`)\n\n{machine_line()}. The GPT of `bench/shaped_pipeline.py` (batch {DATASET['batch_size']} × "
        f"{DATASET['block_size']} tokens, Adam, lr {LR}, seed {SEED}) trained in one process, the same batches from "
        "the same weights; a pipeline with `staleness: 1` equals the staleness-1 run (tests/arceus/training/"
        "test_stale_steps.py). Training loss of each step (step 1 uses the same weights either way).\n\n"
        + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
