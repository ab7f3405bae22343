"""A training stage's peak memory against the memory model, per optimizer, precision and activation checkpointing.

    .venv/bin/python bench/stage_peak_memory.py [--d-model 768] [--blocks 4] [--block-size 128]

Each case runs in a fresh child process that does what an agent does with a stage, without the transport: its
allocator tuned as the agent's (`nodeagent.heap.retain_freed_blocks`), one torch thread, the stage built from
its spec (`nodeagent.runtime.StageRuntime`: a middle stage of `--blocks` GPT blocks, or the first or last stage
with the embedding or head), then `--steps` training steps of its schedule's actions (forwards, backwards, the
optimizer step), its inputs and gradients made as the transport hands them over. The child reads its VmRSS
before the stage (Python, torch, this script: the agent's `runtime_bytes`) and its VmHWM at the end; the stage's
peak is their difference, set beside `arceus.placement.solver.stage_memory` for the same stage and workload.
Prints a table, writes docs/BENCHMARKS.md, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import OptimizerConfig  # noqa: E402
from arceus.model.build import build_layers  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.pipeline.schedule import build_schedule  # noqa: E402
from arceus.placement.profiles import layer_profiles  # noqa: E402
from arceus.placement.solver import Workload, stage_memory  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from nodeagent.device import capabilities  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402
from nodeagent.runtime import StageRuntime  # noqa: E402
from nodeagent.warm_up import warm_up_training  # noqa: E402

MIB = 2**20
VOCAB = 96


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def model_config(case: dict[str, Any]) -> dict[str, Any]:
    return {"type": "transformer", "n_layer": case["blocks"], "n_head": 12 if case["d_model"] % 12 == 0 else 16,
            "d_model": case["d_model"], "block_size": case["block_size"], "vocab_size": VOCAB}


def stage_range(case: dict[str, Any]) -> tuple[int, int]:
    """Layers of the case's stage: the embedding and the blocks (first), the blocks (middle), the blocks and head
    (last)."""
    n = case["blocks"] + 2
    return {"first": (0, n - 1), "middle": (1, n - 1), "last": (1, n)}[case["position"]]


def predicted(case: dict[str, Any]) -> int:
    spec = model_spec_from_config(model_config(case))
    start, end = stage_range(case)
    workload = Workload(case["micro_batch_size"], case["micro_batches"], case["schedule"], optimizer=case["optimizer"],
                        activation_checkpointing=case["checkpointing"], precision=case["precision"])
    stage, stages = {"first": (0, 2), "middle": (1, 3), "last": (1, 2)}[case["position"]]
    return stage_memory(layer_profiles(spec)[start:end], workload, in_flight=workload.in_flight(stage, stages))


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """(In a child process.) The stage's peak above the process before it, and where in the step it grew."""
    retain_freed_blocks()
    torch.set_num_threads(1)
    spec = model_spec_from_config(model_config(case))
    start, end = stage_range(case)
    is_first, is_last = start == 0, end == spec.num_layers
    stage, stages = {"first": (0, 2), "middle": (1, 3), "last": (1, 2)}[case["position"]]
    name, momentum = ("sgd", 0.9) if case["optimizer"] == "sgd-momentum" else (case["optimizer"], 0.0)
    warm_up_training(torch.device("cpu"))  # as an agent before it registers
    capabilities(torch.device("cpu"), declared_flops=1e9)
    generator = torch.Generator().manual_seed(0)
    size, t, d = case["micro_batch_size"], case["block_size"], case["d_model"]
    tokens = [torch.randint(0, VOCAB, (size, t), generator=generator) for _ in range(case["micro_batches"])]
    hidden = [torch.randn(size, t, d, generator=generator) for _ in range(case["micro_batches"])]
    baseline = status_bytes("VmRSS")
    layers = build_layers(spec, start, end, 0)
    built = status_bytes("VmRSS")
    runtime = StageRuntime(
        layers, optimizer=OptimizerConfig(name, 1e-4, momentum=momentum),
        is_first=is_first, is_last=is_last, input_layout=spec.input_layout(start), max_micro_batch_size=size,
        device=torch.device("cpu"), precision=case["precision"], activation_checkpointing=case["checkpointing"],
    )
    growth: dict[str, int] = {}
    constructed = status_bytes("VmRSS")

    def note(phase: str, before: int) -> None:
        grown = status_bytes("VmHWM") - before
        if grown > 0:
            growth[phase] = growth.get(phase, 0) + grown

    note("build", baseline)
    batch = size * case["micro_batches"]
    for step in range(case["steps"]):
        for action in build_schedule(case["schedule"], stages, case["micro_batches"])[stage]:
            before, m = status_bytes("VmHWM"), action.micro_batch
            if action.kind == "F":
                x = tokens[m] if is_first else hidden[m].clone()  # the transport decodes into a tensor of its own
                if is_last:
                    runtime.forward_loss((step, m), x, tokens[m], batch)
                else:
                    runtime.forward((step, m), x)
            else:
                runtime.backward((step, m), None if is_last else hidden[m].clone())
            note(f"{'forward' if action.kind == 'F' else 'backward'} (step {step})", before)
        before = status_bytes("VmHWM")
        runtime.optimizer_step()
        note(f"optimizer (step {step})", before)
    params = sum(p.numel() for p in runtime.layers.parameters())
    return {"params": params, "peak": status_bytes("VmHWM") - baseline, "baseline": baseline, "growth": growth,
            "weights": built - baseline, "optimizer_import": constructed - built}


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"d_model": args.d_model, "blocks": args.blocks, "block_size": args.block_size, "steps": args.steps,
            "micro_batch_size": 1, "micro_batches": 4, "schedule": args.schedule, "position": "middle",
            "optimizer": "adam", "precision": "fp32", "checkpointing": False}
    return [{**base, "optimizer": o, "precision": p, "checkpointing": c, "micro_batches": m, "position": s}
            for o in args.optimizers for p in args.precisions for c in args.checkpointing for m in args.micro_batches
            for s in args.positions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam", "adam8bit"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--checkpointing", nargs="+", type=lambda v: v == "on", default=[False, True],
                        help="on, off or both")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[4], help="GPipe: all of them in flight")
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"),
                        help="1f1b: the middle (of 3 stages) and the first (of 2) hold 2 in flight, the last 1")
    parser.add_argument("--positions", nargs="+", default=["middle"], choices=("first", "middle", "last"))
    parser.add_argument("--only", type=int, nargs="*", help="run only these cases (by index)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child's case JSON
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    rows = []
    for index, case in enumerate(cases(args)):
        if args.only is not None and index not in args.only:
            continue
        child = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                               check=True)
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        model = predicted(case)
        rows.append({**case, **measured, "predicted": model, "error": round(model / measured["peak"] - 1, 3)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    lines = [f"| {r['position']} | {r['optimizer']} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} | "
             f"{r['micro_batches']} | {r['params'] / 1e6:.1f}M | {r['peak'] / MIB:.0f} | {r['predicted'] / MIB:.0f} "
             f"| {r['error']:+.0%} |" for r in rows]
    command = "python bench/stage_peak_memory.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## A training stage's peak memory against the memory model (`bench/stage_peak_memory.py`)", "",
        machine_line(), "", f"`{command}`", "",
        f"GPT blocks of d_model {args.d_model}, block {args.block_size}, {args.blocks} per stage, the micro-batches "
        f"of the table under {args.schedule}, {args.steps} steps; each case a fresh process, its stage's peak "
        "the VmHWM at the end less its VmRSS before the stage; the model is `stage_memory`.", "",
        "| stage | optimizer | precision | recompute | micro-batches | params | peak (MiB) | model (MiB) | error |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *lines,
    ])
    print(body)
    if args.only is None:
        write_section("stage_peak_memory", body)
    print(json.dumps({"bench": "stage_peak_memory", "rows": rows}))


if __name__ == "__main__":
    main()
