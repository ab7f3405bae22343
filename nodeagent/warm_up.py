"""Load what training any stage loads, before the agent measures what it holds (its `runtime_bytes`).

A stage's first training step maps memory that does not grow with the stage: torch.optim's first optimizer
imports torch._dynamo (sympy, mpmath), and the forward, backward and optimizer kernels map their code and
per-thread buffers, more under bf16 autocast and activation checkpointing's recompute (measured by
bench/stage_peak_memory.py: docs/BENCHMARKS.md). Training a tiny GPT stage once in each mode here puts
them in the agent's measured baseline, which placement leaves room for, so that the memory model
(`arceus.placement.solver.stage_memory`) is the stage's own: its tensors and what grows with them.
"""

from __future__ import annotations

import torch

from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers
from arceus.model.registry import model_spec_from_config
from nodeagent.heap import release_free_memory
from nodeagent.runtime import StageRuntime

# Every pipeline layer of a GPT (embedding, block, head), a few KiB of tensors.
_MODEL = {"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 8}


def warm_up_training(device: torch.device) -> None:
    """One training step of a tiny GPT stage with Adam in fp32, and (on a CPU or CUDA device, which compute in
    bfloat16) one under bf16 autocast recomputing its activations; what they allocated is handed back."""
    spec = model_spec_from_config(_MODEL)
    tokens = torch.zeros(1, _MODEL["block_size"], dtype=torch.int64, device=device)
    modes = [("fp32", False), ("bf16", True)] if device.type in ("cpu", "cuda") else [("fp32", False)]
    for precision, recompute in modes:
        runtime = StageRuntime(
            build_layers(spec, 0, spec.num_layers, seed=0), optimizer=OptimizerConfig("adam", 1e-3), is_first=True,
            is_last=True, input_layout=spec.input_layout(0), max_micro_batch_size=1, device=device,
            precision=precision, activation_checkpointing=recompute,
        )
        runtime.forward_loss((0, 0), tokens, tokens, 1)
        runtime.backward((0, 0))
        runtime.optimizer_step()
    release_free_memory()
