"""One rank of a tensor-parallel GPT block in its own process (test_nodeagent_tensor_parallel.py): a real
Agent serves gRPC, the rank runs forward and backward of its shard for two micro-batches, all-reducing
with its peer over gRPC, and writes its outputs and gradients to a safetensors file.

python tests/nodeagent/tp_rank_worker.py RANK PEER0,PEER1,... OUT.safetensors PRECISION (fp32 or bf16: autocast)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from arceus.contracts.credentials import StageCredentials, stage_credentials
from arceus.model.autocast import autocast
from arceus.model.gpt.parallel import build_parallel_block
from arceus.model.gpt.spec import GPTSpec
from arceus.wire.tls import TlsIdentity, load_identity, new_identity
from nodeagent.agent import Agent
from nodeagent.all_reduce import TensorParallelGroup

SPEC = GPTSpec(n_layer=2, n_head=8, d_model=32, block_size=6, vocab_size=10)  # 8 heads: 4 per rank of 2
SEED, LAYER, MICRO_BATCHES, JOB, STAGE, GENERATION = 11, 2, 2, "tp-job", 1, 3
MODEL = {"type": "transformer", "n_layer": 2, "n_head": 8, "d_model": 32, "block_size": 6, "vocab_size": 10}
RANKS = 2
SECRET = b"tp-rank-worker-test-key-32-bytes"


def rank_credentials(rank: int) -> StageCredentials:
    """Both ranks' processes mint the group's credentials under one test key (a control plane would)."""
    return stage_credentials(SECRET, JOB, GENERATION, STAGE, rank, [RANKS] * (STAGE + 1))


def micro_batch_inputs(micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, weight of the loss sum(output * weight)) of one micro-batch."""
    g = torch.Generator().manual_seed(100 + micro_batch)
    shape = (2 + micro_batch, SPEC.block_size, SPEC.d_model)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def write_identities(directory: Path, count: int) -> None:
    """What the control plane would hold: each rank's TLS key and certificate (the parent makes them)."""
    for rank in range(count):
        identity = new_identity()
        (directory / f"rank-{rank}.key.pem").write_bytes(identity.key_pem)
        (directory / f"rank-{rank}.cert.pem").write_bytes(identity.certificate_pem)


def read_identity(directory: Path, rank: int) -> TlsIdentity:
    return load_identity(
        (directory / f"rank-{rank}.key.pem").read_bytes(), (directory / f"rank-{rank}.cert.pem").read_bytes()
    )


def main(rank: int, peers: list[str], out: str, precision: str, identities: Path) -> None:
    torch.set_num_threads(1)
    agent = Agent(device=torch.device("cpu"), listen=peers[rank], identity=read_identity(identities, rank))
    group = TensorParallelGroup(
        job_id=JOB,
        stage_index=STAGE,
        generation=GENERATION,
        rank=rank,
        peers=peers,
        layout=SPEC.output_layout(LAYER),
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=4,
        max_message_bytes=64 * 1024 * 1024,
        credentials=rank_credentials(rank),
        model=MODEL,
        certificates={peer: read_identity(identities, r).certificate for r, peer in enumerate(peers) if r != rank},
    )
    agent.tensor_parallel.add(group)
    agent.start()
    try:
        block = build_parallel_block(SPEC, LAYER, SEED, group.shard, group.all_reduce)
        results: dict[str, torch.Tensor] = {}
        for mb in range(MICRO_BATCHES):
            x, weight = micro_batch_inputs(mb)
            x.requires_grad_(True)
            with group.micro_batch(step=0, micro_batch=mb, deadline=time.monotonic() + 60):
                with autocast(torch.device("cpu"), precision):
                    output = block(x)
                (output.float() * weight).sum().backward()
            results[f"output.{mb}"] = output.detach().float()
            results[f"input_grad.{mb}"] = x.grad
        results.update({f"grad.{n}": p.grad for n, p in block.named_parameters()})
        save_file({k: v.contiguous() for k, v in results.items()}, out)
    finally:
        agent.stop(grace=2.0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4], Path(sys.argv[5]))
