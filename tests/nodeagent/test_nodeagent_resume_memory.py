"""A stage resumed from its checkpoint file takes no memory to load beside what it keeps: each tensor is read into
its place (a parameter, an optimizer moment), not into a tensor of its own first and then copied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20

# In a fresh interpreter, as an agent (its malloc tuned): an MLP stage of three 16 MiB weights trained one step under
# Adam and written as a checkpoint file (argv[2] "save"), or built from the seed and loaded from that file ("load"):
# its peak's growth while loading (VmHWM set back first), the optimizer state's bytes and the weights' sums.
_WORKER = """
import json, re, sys
from pathlib import Path
import torch
from arceus.checkpoint import StateFile, state_chunks
from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers
from arceus.model.mlp.spec import MLPSpec
from nodeagent.heap import retain_freed_blocks
from nodeagent.runtime import StageRuntime

def status(field): return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
retain_freed_blocks()
path, action = Path(sys.argv[1]), sys.argv[2]
spec = MLPSpec((2048, 2048, 2048, 2048))
stage = StageRuntime(build_layers(spec, 0, 3, seed=1), optimizer=OptimizerConfig("adam", 1e-3), is_first=True,
                     is_last=True, input_layout=spec.input_layout(0), max_micro_batch_size=4,
                     device=torch.device("cpu"))
if action == "save":
    stage.forward_loss((1, 0), torch.randn(4, 2048), torch.randint(0, 2048, (4,)), 4)
    stage.backward((1, 0))
    stage.optimizer_step()
    size, chunks = state_chunks(dict(stage.state_items()))
    with path.open("wb") as file:
        for chunk in chunks:
            file.write(chunk)
else:
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    stage.load_state_tensors(StateFile(path))
    grown = status("VmHWM") - before
    moments = sum(t.nbytes for state in stage.optimizer.state.values() for t in state.values())
print(json.dumps({"grown": grown, "moments": moments} if action == "load" else {}))
print(json.dumps({n: w.double().sum().item() for n, w in stage.named_weights().items()}))
"""


def run(path: Path, action: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", _WORKER, str(path), action], cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120, check=True,
    )
    return [json.loads(line) for line in result.stdout.strip().splitlines()[-2:]]


def test_loading_a_checkpoint_file_takes_no_memory_beside_the_optimizer_state(tmp_path: Path) -> None:
    path = tmp_path / "stage.safetensors"
    _, saved = run(path, "save")
    report, loaded = run(path, "load")
    assert loaded == saved
    assert report["moments"] >= 6 * 16 * MIB  # Adam's two moments of three 16 MiB weights
    # A tensor of the file's beside its place, even one at a time, would add 16 MiB.
    assert report["grown"] < report["moments"] + 4 * MIB, (
        f"loading grew the peak by {report['grown'] / MIB:.1f} MiB; the optimizer state is "
        f"{report['moments'] / MIB:.1f} MiB"
    )
