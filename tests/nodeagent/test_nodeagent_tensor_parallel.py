"""Tensor parallelism over real gRPC. Acceptance: a GPT block (attention + MLP, 8 heads, 4 per rank)
split over 2 agent processes, all-reducing over TensorParallelService, matches the unsplit block to 1e-5
in outputs, input gradients and (sliced) parameter gradients. Also: bad partials get the right codes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from arceus.contracts.assignment import Assignment
from arceus.model.autocast import autocast
from arceus.model.gpt.layers import gpt_layer
from arceus.model.gpt.parallel import shard_tensor
from arceus.model.gpt.spec import GPTSpec
from arceus.model.seeding import layer_generator
from arceus.model.sharding import Shard
from arceus.model.tensor_parallel import gather_state_tensors
from arceus.v1 import stage_pb2, tensor_parallel_pb2, tensor_parallel_pb2_grpc
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import to_proto
from devtools.launch import free_ports
from devtools.pipeline import certificates_for, identity_for
from devtools.pipeline import rank_credentials as pipeline_credentials
from nodeagent.agent import Agent
from nodeagent.all_reduce import TensorParallelGroup
from nodeagent.hosting import HostedStages
from nodeagent.rpc import RpcFailure
from nodeagent.stage import build_hosted_stage

sys.path.insert(0, str(Path(__file__).parent))
from tp_rank_worker import (  # noqa: E402
    GENERATION,
    JOB,
    LAYER,
    MICRO_BATCHES,
    MODEL,
    SEED,
    SPEC,
    STAGE,
    micro_batch_inputs,
    rank_credentials,
    write_identities,
)

WORKER = Path(__file__).parent / "tp_rank_worker.py"
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
BF16_ERROR = 2e-2  # of the largest value of each tensor: a few bfloat16 roundings (2^-8 each)


def assert_matches(got: torch.Tensor, want: torch.Tensor, precision: str, what: str) -> None:
    """fp32: to 1e-5. bf16: the largest error within BF16_ERROR of the tensor's largest value."""
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=what)
    else:
        error, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert error <= BF16_ERROR * scale, f"{what}: error {error:.3g} against values up to {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_block_split_over_two_agent_processes_matches_the_unsplit_block(tmp_path: Path, precision: str) -> None:
    """fp32: to 1e-5. bf16 autocast: each rank's partials round to bfloat16 before the sum, the unsplit
    block's sums round once, so within bf16's rounding; and the ranks, summing in float32 in rank order,
    get the same bits of every replicated result."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    outs = [tmp_path / f"rank-{r}.safetensors" for r in range(2)]
    write_identities(tmp_path, 2)

    def spawn(rank: int) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"rank-{rank}.log", "wb") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), ",".join(peers), str(outs[rank]), precision, str(tmp_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            )

    processes = [spawn(r) for r in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], "\n".join((tmp_path / f"rank-{r}.log").read_text()[-3000:] for r in range(2))

    full = gpt_layer(SPEC, LAYER, layer_generator(SEED, LAYER))
    want: dict[str, torch.Tensor] = {}
    for mb in range(MICRO_BATCHES):
        x, weight = micro_batch_inputs(mb)
        x.requires_grad_(True)
        with autocast(CPU, precision):
            output = full(x)
        (output.float() * weight).sum().backward()
        want[f"output.{mb}"], want[f"input_grad.{mb}"] = output.detach().float(), x.grad
    full_grads = dict((n, p.grad) for n, p in full.named_parameters())

    for rank, out in enumerate(outs):
        got = load_file(out)
        for key, value in want.items():
            assert_matches(got[key], value, precision, f"rank {rank} {key}")
        grads = {k.removeprefix("grad."): v for k, v in got.items() if k.startswith("grad.")}
        assert set(grads) == set(full_grads)
        for name, grad in grads.items():
            sliced = shard_tensor(SPEC, Shard(rank, 2), name, full_grads[name])
            assert grad.shape == sliced.shape, name
            assert_matches(grad, sliced, precision, f"rank {rank} {name}")
    # Each rank holds half the heads: half the attention rows, and the replicated parts bitwise equal.
    rank0, rank1 = load_file(outs[0]), load_file(outs[1])
    if precision == "bf16":  # it really computed in bfloat16: not what fp32 gives
        x, _ = micro_batch_inputs(1)
        assert not torch.allclose(rank0["output.1"], full(x).detach(), rtol=0, atol=1e-5)
    assert rank0["grad.attn.c_attn.weight"].shape == (3 * SPEC.d_model // 2, SPEC.d_model)
    replicated = [k for k in rank0 if not k.startswith("grad.") or rank0[k].shape == full_grads[k[5:]].shape]
    assert "output.1" in replicated and "input_grad.1" in replicated and "grad.ln_1.weight" in replicated
    assert all(torch.equal(rank0[k], rank1[k]) for k in replicated), [
        k for k in replicated if not torch.equal(rank0[k], rank1[k])
    ]


@pytest.fixture
def served_group() -> Iterator[tuple[TensorParallelGroup, tensor_parallel_pb2_grpc.TensorParallelServiceStub]]:
    own, dead = (f"127.0.0.1:{p}" for p in free_ports(2))
    agent = Agent(device=torch.device("cpu"), listen=own)
    group = TensorParallelGroup(
        job_id=JOB,
        stage_index=STAGE,
        generation=GENERATION,
        rank=0,
        peers=[own, dead],
        layout=SPEC.output_layout(LAYER),
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=4,
        max_message_bytes=1024 * 1024,
        credentials=rank_credentials(0),
        model=MODEL,
        certificates={dead: identity_for(dead).certificate},
    )
    agent.tensor_parallel.add(group)
    agent.start()
    try:
        with open_channel(own, token=rank_credentials(1).token, certificate=agent.identity.certificate) as channel:
            yield group, tensor_parallel_pb2_grpc.TensorParallelServiceStub(channel)
    finally:
        agent.stop(grace=0.5)


def partial_request(**overrides: object) -> tensor_parallel_pb2.PushPartialRequest:
    fields: dict[str, object] = {
        "target": stage_pb2.StageRef(job_id=JOB, stage_index=STAGE, generation=GENERATION),
        "step": 5,
        "micro_batch": 0,
        "op": 0,
        "source_rank": 1,
        "tensor": to_proto(torch.ones(2, SPEC.block_size, SPEC.d_model)),
    }
    fields.update(overrides)
    return tensor_parallel_pb2.PushPartialRequest(**fields)


@pytest.mark.parametrize(
    ("overrides", "code", "says"),
    [
        ({"tensor": to_proto(torch.ones(2, SPEC.block_size, 7))}, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        ({"tensor": to_proto(torch.ones(5, SPEC.block_size, SPEC.d_model))}, grpc.StatusCode.INVALID_ARGUMENT, "batch"),
        (
            {"tensor": to_proto(torch.ones(2, SPEC.block_size, SPEC.d_model, dtype=torch.float16))},
            grpc.StatusCode.INVALID_ARGUMENT,
            "float32",
        ),
        ({"source_rank": 0}, grpc.StatusCode.PERMISSION_DENIED, "source_rank"),  # not the caller's rank
        ({"source_rank": 2}, grpc.StatusCode.PERMISSION_DENIED, "source_rank"),
        ({"micro_batch": MICRO_BATCHES}, grpc.StatusCode.INVALID_ARGUMENT, "micro_batch"),
        ({"op": -1}, grpc.StatusCode.INVALID_ARGUMENT, "op"),
        (
            {"target": stage_pb2.StageRef(job_id=JOB, stage_index=STAGE, generation=GENERATION - 1)},
            grpc.StatusCode.PERMISSION_DENIED,
            "does not allow PushPartial",
        ),
        (
            {"target": stage_pb2.StageRef(job_id="other", stage_index=STAGE, generation=GENERATION)},
            grpc.StatusCode.PERMISSION_DENIED,
            "does not allow PushPartial",
        ),
    ],
)
def test_bad_partials_are_refused_with_their_code(
    served_group: tuple[TensorParallelGroup, tensor_parallel_pb2_grpc.TensorParallelServiceStub],
    overrides: dict[str, object],
    code: grpc.StatusCode,
    says: str,
) -> None:
    _, stub = served_group
    with pytest.raises(grpc.RpcError) as caught:
        stub.PushPartial(partial_request(**overrides), timeout=5)
    assert caught.value.code() == code and says in caught.value.details()


def test_a_partial_is_summed_and_a_silent_peer_fails_the_all_reduce_by_its_deadline(
    served_group: tuple[TensorParallelGroup, tensor_parallel_pb2_grpc.TensorParallelServiceStub],
) -> None:
    group, stub = served_group
    stub.PushPartial(partial_request(), timeout=5)  # rank 1's op 0 of step 5 arrives early: parked
    own = torch.full((2, SPEC.block_size, SPEC.d_model), 2.0)
    started = time.monotonic()
    with group.micro_batch(step=5, micro_batch=0, deadline=time.monotonic() + 1.0):
        # The partial is there, but rank 1's address is dead: our push to it cannot finish.
        with pytest.raises(RpcFailure) as caught:
            group.all_reduce(own)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "rank 1" in caught.value.message
        # op 1 never came from rank 1 at all.
        with pytest.raises(RpcFailure) as caught:
            group.all_reduce(own)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5


def test_a_rank_loads_its_slice_of_an_unsplit_checkpoint_and_its_group_lives_with_the_stage() -> None:
    """A checkpoint is always the unsplit stage's: each rank slices it, and the ranks' states gather back
    into it. The registry serves the group while the stage is hosted, and not after."""
    model = {"type": "transformer", "n_layer": 2, "n_head": 8, "d_model": 32, "block_size": 6, "vocab_size": 10}
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    common = {
        "job_id": JOB,
        "stage_index": 0,
        "num_stages": 1,
        "generation": GENERATION,
        "model": model,
        "layer_start": 0,
        "layer_end": 4,
        "seed": SEED,
        "optimizer": {"name": "adam", "lr": 1e-2},
        "micro_batches": 1,
        "max_micro_batch_size": 4,
        "prev_address": None,
        "next_address": None,
        "credentials": pipeline_credentials(JOB, GENERATION, 0, 0, [1]).to_json(),
        "certificates": certificates_for(peers),
    }
    whole = Assignment.from_json({**common, "stage_id": "whole"})
    unsplit = build_hosted_stage(whole, CPU, max_message_bytes=2**20)
    tokens = torch.randint(0, 10, (3, 6), generator=torch.Generator().manual_seed(0))
    unsplit.runtime.forward_loss((0, 0), tokens, tokens, batch_size=3)
    unsplit.runtime.backward((0, 0))
    unsplit.runtime.optimizer_step()  # Adam state: step, exp_avg, exp_avg_sq of every parameter
    full = unsplit.runtime.state_tensors()
    ref = stage_pb2.StageRef(job_id=JOB, stage_index=0, generation=GENERATION)

    states = []
    for rank in range(2):
        registry = HostedStages(CPU, max_message_bytes=2**20, load_checkpoint=lambda _: full)
        split = {"rank": rank, "size": 2, "peers": peers}
        checkpoint = {"step": 1, "url": "file", "sha256": "0" * 64}
        assignment = {
            **common, "stage_id": f"rank-{rank}", "tensor_parallel": split, "checkpoint": checkpoint,
            "credentials": pipeline_credentials(JOB, GENERATION, 0, rank, [2]).to_json(),
        }
        registry.apply([Assignment.from_json(assignment)])
        stage = registry.resolve(ref)
        assert registry.tensor_parallel.resolve(ref) is stage.tensor_parallel
        states.append(stage.runtime.state_tensors())
        del stage  # a dropped stage is freed once nothing holds it
        registry.close()
        with pytest.raises(RpcFailure) as caught:
            registry.tensor_parallel.resolve(ref)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert states[1]["layers.1.mlp.c_fc.weight"].shape == (2 * 32, 32)
    assert torch.equal(states[1]["layers.1.mlp.c_fc.weight"], full["layers.1.mlp.c_fc.weight"][64:])
    gathered = gather_state_tensors(GPTSpec(**{k: v for k, v in model.items() if k != "type"}), states)
    assert gathered.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(gathered[name], tensor), name
