"""Run by test_nodeagent_memory.py in a fresh interpreter: one agent process rebuilds the same stage at ten
generations, each from the previous one's checkpoint (streamed out with GetState, loaded from the file),
training a step in between; prints one JSON line: the stage's training-state bytes and the RSS after each
rebuild."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from arceus.checkpoint import StateFile
from arceus.contracts.assignment import Assignment
from arceus.training.plan import StageEndpoint
from arceus.training.stage_client import StageClient
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity
from nodeagent.agent import Agent
from nodeagent.heap import retain_freed_blocks

JOB = "00000000-0000-0000-0000-000000000000"
MODEL = {"type": "transformer", "n_layer": 3, "n_head": 8, "d_model": 512, "block_size": 32, "vocab_size": 64}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    retain_freed_blocks()  # as `python -m nodeagent` runs
    directory = Path(tempfile.mkdtemp())
    agent = Agent(device=torch.device("cpu"), load_checkpoint=lambda ref: StateFile(Path(ref.url), sha256=ref.sha256))
    agent.start()
    remember_identity(agent.advertise_address, agent.identity)
    checkpoint, rss, state_bytes = None, [], 0
    try:
        for generation in range(1, 11):
            [raw] = pipeline_assignments(
                job_id=JOB, model_config=MODEL, boundaries=[0, 5], addresses=[agent.advertise_address],
                optimizer={"name": "adam", "lr": 1e-3}, seed=0, micro_batches=1, max_micro_batch_size=2,
                generation=generation,
            )
            raw["checkpoint"] = checkpoint
            agent.apply_assignments([Assignment.from_json(raw)])
            [stage] = agent.registry.stages()
            x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
            stage.runtime.forward_loss((generation, 0), x, y, 2)
            stage.runtime.backward((generation, 0))
            stage.runtime.optimizer_step()
            params = sum(p.numel() for p in stage.runtime.layers.parameters())
            state_bytes = 16 * params  # weights, gradients and Adam's two moments, fp32
            path = directory / f"generation-{generation}.safetensors"
            client = StageClient(StageEndpoint(0, agent.advertise_address, "node", 0, 5,
                certificate=identity_for(agent.advertise_address).certificate), job_id=JOB,
                                 generation=generation, credential=driver_token(JOB, generation), timeout=60)
            sha256, _ = client.save_state(path)
            client.close()
            checkpoint = {"step": generation, "url": str(path), "sha256": sha256}
            del stage  # the agent frees what it drops once nothing else holds it
            rss.append(rss_bytes())
    finally:
        agent.stop()
    print(json.dumps({"state_bytes": state_bytes, "rss": rss}))


if __name__ == "__main__":
    sys.exit(main())
