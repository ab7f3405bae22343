"""What `replica_sync` does to the bench GPT: replicas that sum their gradients every step (exact, H=1) beside
replicas that sync every H steps (DiLoCo: their own optimizer steps between syncs, the mean weight delta through
an outer Nesterov SGD at each), on the same data, seed and steps.

    .venv/bin/python bench/replica_sync.py [--every 1 4 16] [--steps 48] [--outer-lr 0.7] [--no-write]

The GPT of bench/pipeline_vs_torch.py in 3 stages (layer boundaries [0, 3, 5, 8]) with 2 replicas each (6 static
agents, each hosting one replica of every run's stages), batch 24 × 128 tokens in 4 micro-batches, Adam, GPipe.
Per H: the training loss (mean of the last 8 steps; with H > 1 each replica's share computed on its own weights),
the validation loss after the last step (a sync step for every H dividing --steps: the replicas are then equal),
and the tensor bytes the replicas pushed to their siblings per step (`StepProgress.exchange_bytes`: gradients every
step, or weight deltas and Adam's two moments every H steps). Writes docs/BENCHMARKS.md, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.contracts.replica_sync import replica_sync_from_json  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.errors import SpecError  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import TrainPlan  # noqa: E402
from arceus.training.recording import RecordingSink  # noqa: E402
from bench.pipeline_vs_torch import LR, MODEL, SEED  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.launch import spawn_static_agents_on_free_ports, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, replica_endpoints, replicated_pipeline_assignments  # noqa: E402

DATASET = validate_dataset_config({"name": "text", "batch_size": 24, "val_batch_size": 64, "block_size": 128})
MICRO_BATCHES, BOUNDS, REPLICAS, LAST = 4, [0, 3, 5, 8], 2, 8


def sync_setting(every: int, outer_lr: float) -> dict[str, Any]:
    return {"every_steps": 1} if every == 1 else {"every_steps": every, "outer_lr": outer_lr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16], help="H values (1: exact), 1 first")
    parser.add_argument("--steps", type=int, default=48, help="training steps per run")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's learning rate")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md")
    args = parser.parse_args()
    if args.every[0] != 1 or args.steps < LAST:
        parser.error(f"--every must start with 1 (the exact baseline) and --steps be at least {LAST}")
    for every in args.every:  # a clear error before any agent starts
        try:
            replica_sync_from_json(sync_setting(every, args.outer_lr), field="replica_sync")
        except SpecError as exc:
            parser.error(f"--every {every} --outer-lr {args.outer_lr}: {exc.field}: {exc.message}")

    n = len(BOUNDS) - 1
    jobs = {every: f"replica-sync-h{every}" for every in args.every}

    def layout(flat: list[str]) -> list[list[str]]:
        return [flat[i * REPLICAS:(i + 1) * REPLICAS] for i in range(n)]

    def hosted(flat: list[str]) -> list[list[dict[str, Any]]]:
        """Agent i * REPLICAS + r hosts replica r of stage i of every run."""
        per_agent: list[list[dict[str, Any]]] = [[] for _ in flat]
        for every, job_id in jobs.items():
            stages = replicated_pipeline_assignments(
                job_id=job_id, model_config=MODEL, boundaries=BOUNDS, addresses=layout(flat),
                optimizer={"name": "adam", "lr": LR}, seed=SEED, micro_batches=MICRO_BATCHES,
                max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES), schedule="gpipe",
                replica_sync=sync_setting(every, args.outer_lr),
            )
            for i, stage in enumerate(stages):
                for r, assignment in enumerate(stage):
                    per_agent[i * REPLICAS + r].append(assignment)
        return per_agent

    rows: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        agents, flat = spawn_static_agents_on_free_ports(n * REPLICAS, hosted, Path(workdir), ready_timeout=240.0)
        try:
            for every, job_id in jobs.items():
                stages, replicas = replica_endpoints(layout(flat), BOUNDS)
                plan = TrainPlan(
                    job_id=job_id, generation=1, credential=driver_token(job_id, 1), stages=stages,
                    replicas=replicas, dataset=DATASET, epochs=1, learning_rate=LR, micro_batches=MICRO_BATCHES,
                    seed=SEED, rpc_timeout_seconds=120.0, max_steps=args.steps, schedule="gpipe",
                )
                sink, started = RecordingSink(), time.perf_counter()
                result = train(plan, sink)
                losses = [p.loss for p in sink.steps]
                sent = [p.exchange_bytes for p in sink.steps]
                rows[every] = {
                    "every_steps": every,
                    "loss_first": losses[0],
                    "loss_last8": statistics.fmean(losses[-LAST:]),
                    "val_loss": result.val_loss,
                    "exchange_bytes_per_step": statistics.fmean(sent),
                    "steps_exchanging": sum(1 for b in sent if b),
                    "seconds_per_step": (time.perf_counter() - started) / len(losses),
                }
                print(f"H={every}: {rows[every]}", file=sys.stderr, flush=True)
        finally:
            stop_agents(agents)

    params = sum(model_spec_from_config(MODEL).layer_params())
    exact = rows[1]
    lines = [
        f"GPT d_model {MODEL['d_model']}, {MODEL['n_layer']} blocks ({params / 1e6:.2f}M parameters), 3 stages "
        f"{BOUNDS} × {REPLICAS} replicas (6 agents on this host), batch {DATASET['batch_size']} × "
        f"{DATASET['block_size']} tokens in {MICRO_BATCHES} micro-batches, Adam lr {LR}, GPipe, {args.steps} steps, "
        f"seed {SEED}; H > 1: outer Nesterov SGD lr {args.outer_lr}, momentum 0.9.",
        "",
        "| replica_sync | equals one process | train loss, step 1 | train loss, last 8 steps | val loss | "
        "exchange MB/step (all replicas) | steps exchanging | vs exact: bytes | vs exact: val loss | s/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for every, row in rows.items():
        lines.append(
            f"| {'every step (exact)' if every == 1 else f'every {every} steps'} | {'yes' if every == 1 else 'no'} | "
            f"{row['loss_first']:.4f} | {row['loss_last8']:.4f} | {row['val_loss']:.4f} | "
            f"{row['exchange_bytes_per_step'] / 1e6:.2f} | {row['steps_exchanging']}/{args.steps} | "
            f"{row['exchange_bytes_per_step'] / exact['exchange_bytes_per_step']:.3f}× | "
            f"{row['val_loss'] - exact['val_loss']:+.4f} | {row['seconds_per_step']:.2f} |"
        )
    lines += [
        "",
        "A sync every H steps carries each stage's weight deltas and Adam's two moments (3 vectors of its "
        "parameters, beside the exact exchange's 1), so it costs 3/H of the exact exchange's bytes per step; "
        "the loss column says what that saves costs in training on this short run.",
    ]
    report("replica_sync", "Replica sync: every step vs every H steps (`bench/replica_sync.py`)", "\n".join(lines),
           {"bench": "replica_sync", "steps": args.steps, "runs": list(rows.values())}, write=not args.no_write)


if __name__ == "__main__":
    main()
