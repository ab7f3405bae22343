"""What training any stage loads is loaded before the agent measures what it holds: after `warm_up_training`, a
stage of another width adds no more than its tensors to the process; without it, the first optimizer's imports and
the kernels' code add tens of MiB that the memory model does not count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (In a fresh process.) RSS before and after one training step of a small GPT stage with Adam, its tensors'
# bytes; warmed up first when asked.
SCRIPT = """
import json, sys
from pathlib import Path
import torch
from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers
from arceus.model.registry import model_spec_from_config
from nodeagent.heap import retain_freed_blocks
from nodeagent.runtime import StageRuntime
from nodeagent.warm_up import warm_up_training

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

retain_freed_blocks()
torch.set_num_threads(1)
if sys.argv[1] == "warm":
    warm_up_training(torch.device("cpu"))
spec = model_spec_from_config({"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 32,
                               "vocab_size": 50})
before = rss()
runtime = StageRuntime(build_layers(spec, 0, spec.num_layers, 0), optimizer=OptimizerConfig("adam", 1e-3),
                       is_first=True, is_last=True, input_layout=spec.input_layout(0), max_micro_batch_size=2,
                       device=torch.device("cpu"))
tokens = torch.randint(0, 50, (2, 32))
runtime.forward_loss((0, 0), tokens, tokens, 2)
runtime.backward((0, 0))
runtime.optimizer_step()
params = sum(p.numel() for p in runtime.layers.parameters())
print(json.dumps({"grown": rss() - before, "state": 16 * params}))
"""


def grown(mode: str) -> tuple[int, int]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240, check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["grown"], report["state"]


def test_after_the_warm_up_a_stage_adds_its_tensors_and_not_the_libraries_it_trains_with() -> None:
    cold, state = grown("cold")
    warm, _ = grown("warm")
    assert state < 2 * 2**20  # 105K parameters: weights, gradients, two moments
    assert warm < state + 4 * 2**20, f"{warm / 2**20:.1f} MiB beyond a warmed-up agent"
    assert cold > warm + 40 * 2**20, f"{cold / 2**20:.1f} MiB cold, {warm / 2**20:.1f} warm"
