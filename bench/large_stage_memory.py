"""Peak memory of an agent hosting one large GPT stage, across a save and a rebuild from its own state.

    .venv/bin/python bench/large_stage_memory.py [--d-model 1024] [--n-layer 12]

The agent (nodeagent.agent.Agent, in this process, keeping freed blocks as an agent does) builds the
whole GPT as one stage with Adam, takes one training step, and streams its state to a file over GetState
(arceus.training.stage_client). Generation 2 is then assigned with that file as its checkpoint: the agent
drops generation 1, rebuilds and loads the state. Read from /proc/self/status after each generation:
VmRSS (now) and VmHWM (peak so far). The process is the agent plus the client reading the state stream,
so its peak bounds what the agent alone needs. Beside them: the placement solver's estimate for the stage
(arceus.placement.solver.stage_memory) and the process's RSS before any stage (Python, torch, the agent).
Prints a table, writes docs/BENCHMARKS.md, and ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.checkpoint import StateFile  # noqa: E402
from arceus.contracts.assignment import Assignment  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.placement.profiles import layer_profiles  # noqa: E402
from arceus.placement.solver import Workload, stage_memory  # noqa: E402
from arceus.training.plan import StageEndpoint  # noqa: E402
from arceus.training.stage_client import StageClient  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity  # noqa: E402
from nodeagent.agent import Agent  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402

JOB_ID = "00000000-0000-0000-0000-000000000000"
BATCH, VOCAB, BLOCK = 2, 100, 64


def memory_mib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
    return {key: int(value.split()[0]) // 1024 for key, value in fields.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    args = parser.parse_args()
    retain_freed_blocks()
    torch.set_num_threads(2)
    model = {"type": "transformer", "n_layer": args.n_layer, "n_head": 16, "d_model": args.d_model,
             "block_size": BLOCK, "vocab_size": VOCAB}
    layers = args.n_layer + 2  # embedding, blocks, head
    agent = Agent(device=torch.device("cpu"), load_checkpoint=lambda ref: StateFile(Path(ref.url), sha256=ref.sha256))
    agent.start()
    remember_identity(agent.advertise_address, agent.identity)
    baseline_mib = memory_mib()["VmRSS"]
    estimate_mib = stage_memory(layer_profiles(model_spec_from_config(model)), Workload(BATCH, 1)) // 2**20
    rows, checkpoint, params = [], None, 0
    with tempfile.TemporaryDirectory() as tmp:
        for generation in (1, 2):
            [raw] = pipeline_assignments(
                job_id=JOB_ID, model_config=model, boundaries=[0, layers], addresses=[agent.advertise_address],
                optimizer={"name": "adam", "lr": 1e-4}, seed=0, micro_batches=1, max_micro_batch_size=BATCH,
                generation=generation,
            )
            raw["checkpoint"] = checkpoint
            started = time.perf_counter()
            agent.apply_assignments([Assignment.from_json(raw)])
            built = time.perf_counter() - started
            [stage] = agent.registry.stages()
            params = sum(p.numel() for p in stage.runtime.layers.parameters())
            x, y = torch.randint(0, VOCAB, (BATCH, BLOCK)), torch.randint(0, VOCAB, (BATCH, BLOCK))
            started = time.perf_counter()
            stage.runtime.forward_loss((generation, 0), x, y, BATCH)
            stage.runtime.backward((generation, 0))
            stage.runtime.optimizer_step()
            stepped = time.perf_counter() - started
            del stage
            client = StageClient(StageEndpoint(0, agent.advertise_address, "bench", 0, layers,
                certificate=identity_for(agent.advertise_address).certificate), job_id=JOB_ID,
                                 generation=generation, credential=driver_token(JOB_ID, generation), timeout=600)
            path = Path(tmp) / f"generation-{generation}.safetensors"
            started = time.perf_counter()
            sha256, size = client.save_state(path)
            saved = time.perf_counter() - started
            client.close()
            checkpoint = {"step": generation, "url": str(path), "sha256": sha256}
            rows.append({"generation": generation, "state_mib": size // 2**20, "build_s": round(built, 1),
                         "step_s": round(stepped, 1), "save_s": round(saved, 1), **memory_mib()})
    agent.stop()

    param_mib = params * 4 // 2**20
    table = ["| generation | built from | build s | step s | state saved MiB | save s | VmRSS MiB | VmHWM MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        source = "seed" if row["generation"] == 1 else "generation 1's state file"
        table.append(f"| {row['generation']} | {source} | {row['build_s']} | {row['step_s']} | {row['state_mib']} | "
                     f"{row['save_s']} | {row['VmRSS']} | {row['VmHWM']} |")
    body = "\n".join([
        "## One large GPT stage: build, step, save, rebuild from state (`bench/large_stage_memory.py`)", "",
        f"{machine_line()}. GPT d_model {args.d_model}, {args.n_layer} layers, {params / 1e6:.1f}M parameters "
        f"({param_mib} MiB fp32) as one stage with Adam (weights + gradients + two moments = {4 * param_mib} MiB), "
        f"batch {BATCH}x{BLOCK}; agent and state-reading client in one process.", "", *table, "",
        f"Peak after the rebuild: **{rows[-1]['VmHWM']} MiB**, {rows[-1]['VmHWM'] / (4 * param_mib):.2f}x the "
        "stage's training state. The placement solver's estimate for this stage (`stage_memory`): "
        f"{estimate_mib} MiB; the process held {baseline_mib} MiB before any stage, so measured above that "
        f"baseline: {rows[0]['VmHWM'] - baseline_mib} MiB after the first step "
        f"({(rows[0]['VmHWM'] - baseline_mib) / estimate_mib:.2f}x the estimate) and "
        f"{rows[-1]['VmHWM'] - baseline_mib} MiB at the peak of the rebuild "
        f"({(rows[-1]['VmHWM'] - baseline_mib) / estimate_mib:.2f}x).",
    ])
    print(body)
    write_section("large_stage_memory", body)
    print(json.dumps({"bench": "large_stage_memory", "params": params, "estimate_mib": estimate_mib,
                      "baseline_mib": baseline_mib, "generations": rows}))


if __name__ == "__main__":
    main()
