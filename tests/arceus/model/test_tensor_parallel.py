"""Tensor-parallel GPT blocks (Megatron split) computed in one process: each rank runs in its own thread
and the all-reduce sums over the threads. Every split must match the unsplit layer in outputs, input
gradients and (sliced) parameter gradients."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.build import build_full_model
from arceus.model.gpt.layers import GPTBlock, gpt_layer
from arceus.model.gpt.parallel import (
    ParallelBlock,
    build_parallel_block,
    check_split,
    shard_rows,
    shard_tensor,
)
from arceus.model.gpt.spec import GPTSpec
from arceus.model.seeding import layer_generator
from arceus.model.sharding import AllReduce, Shard
from arceus.model.tensor_parallel import build_parallel_layers

SPEC = GPTSpec(n_layer=2, n_head=8, d_model=32, block_size=6, vocab_size=10)
SEED, LAYER = 7, 1


class ThreadAllReduce:
    """An all-reduce among `size` threads: each contributes, all get the sum in rank order."""

    def __init__(self, size: int) -> None:
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=30)
        self.calls = 0

    def for_rank(self, rank: int) -> AllReduce:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = tensor.detach().clone()
            self._barrier.wait()
            total = self._slots[0].clone()
            for other in self._slots[1:]:
                total += other
            if rank == 0:
                self.calls += 1
            self._barrier.wait()  # nobody overwrites a slot before every rank has summed
            return total

        return all_reduce


def unsplit_block() -> GPTBlock:
    return gpt_layer(SPEC, LAYER, layer_generator(SEED, LAYER))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, SPEC.block_size, SPEC.d_model, generator=g), torch.randn(
        3, SPEC.block_size, SPEC.d_model, generator=g
    )


def run(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, then backward of sum(output * weight): (output, input gradient)."""
    x = x.clone().requires_grad_(True)
    out = module(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def run_ranks(size: int, part: Callable[[ParallelBlock], nn.Module]) -> tuple[list, list[ParallelBlock]]:
    reducer = ThreadAllReduce(size)
    blocks = [build_parallel_block(SPEC, LAYER, SEED, Shard(r, size), reducer.for_rank(r)) for r in range(size)]
    x, weight = inputs()
    with ThreadPoolExecutor(max_workers=size) as pool:
        results = list(pool.map(lambda b: run(part(b), x, weight), blocks))
    return results, blocks


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("part_name", ["attn", "mlp", "block"])
def test_split_matches_the_unsplit_layer_in_outputs_and_gradients(size: int, part_name: str) -> None:
    def part(block: nn.Module) -> nn.Module:
        return block if part_name == "block" else getattr(block, part_name)

    full = unsplit_block()
    want_out, want_grad = run(part(full), *inputs())
    full_grads = {n: p.grad for n, p in full.named_parameters() if p.grad is not None}
    prefix = "" if part_name == "block" else f"{part_name}."

    results, blocks = run_ranks(size, part)
    for rank, ((out, x_grad), block) in enumerate(zip(results, blocks, strict=True)):
        torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(x_grad, want_grad, rtol=0, atol=1e-5)
        grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
        assert set(grads) == set(full_grads) and all(n.startswith(prefix) for n in grads)
        for name, grad in grads.items():
            want = shard_tensor(SPEC, Shard(rank, size), name, full_grads[name])
            assert grad.shape == want.shape
            torch.testing.assert_close(grad, want, rtol=0, atol=1e-5)
    # Replicated values (outputs, LayerNorm and bias gradients) are bitwise equal on every rank.
    for out, _ in results[1:]:
        assert torch.equal(out, results[0][0])
    replicated = [n for n in full_grads if shard_rows(SPEC, Shard(0, size), n) is None]
    assert any(n.endswith("c_proj.bias") for n in replicated)
    for block in blocks[1:]:
        params = dict(block.named_parameters())
        first = dict(blocks[0].named_parameters())
        assert all(torch.equal(params[n].grad, first[n].grad) for n in replicated)


def test_shards_start_from_slices_of_the_seeded_weights_and_reassemble_it() -> None:
    full = unsplit_block().state_dict()
    d = SPEC.d_model
    shards = [build_parallel_block(SPEC, LAYER, SEED, Shard(r, 2), lambda t: t).state_dict() for r in range(2)]
    # q|k|v are packed: rank 0 holds the first half of each third.
    qkv = full["attn.c_attn.weight"]
    torch.testing.assert_close(
        shards[0]["attn.c_attn.weight"], torch.cat([qkv[: d // 2], qkv[d : d + d // 2], qkv[2 * d : 2 * d + d // 2]])
    )
    assert shards[0]["attn.c_attn.weight"].shape == (3 * d // 2, d)
    assert shards[1]["mlp.c_proj.weight"].shape == (d, 2 * d)
    torch.testing.assert_close(
        torch.cat([s["mlp.c_proj.weight"] for s in shards], dim=1), full["mlp.c_proj.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        torch.cat([s["mlp.c_fc.weight"] for s in shards]), full["mlp.c_fc.weight"], rtol=0, atol=0
    )
    for name in ("ln_1.weight", "attn.c_proj.bias", "mlp.c_proj.bias"):
        assert torch.equal(shards[0][name], full[name]) and torch.equal(shards[1][name], full[name])


def test_a_block_makes_four_all_reduces_per_forward_and_backward() -> None:
    reducer = ThreadAllReduce(1)
    block = build_parallel_block(SPEC, LAYER, SEED, Shard(0, 1), reducer.for_rank(0))
    x, weight = inputs()
    run(block, x, weight)
    assert reducer.calls == 4  # g of attention and MLP forward, f of both backward


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: check_split(SPEC, 3), "n_head \\(8\\) must be divisible by the tensor-parallel size \\(3\\)"),
        (lambda: Shard(2, 2), "rank must be in \\[0, 2\\)"),
        (lambda: Shard(0, 0), "at least 1 rank"),
        (lambda: build_parallel_block(SPEC, 0, SEED, Shard(0, 2), lambda t: t), "not a transformer block"),
        (lambda: build_parallel_block(SPEC, 1, SEED, Shard(0, 16), lambda t: t), "divisible"),
    ],
)
def test_bad_splits_are_refused_with_a_clear_error(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("size", [2, 4])
def test_a_whole_gpt_split_over_ranks_trains_like_the_unsplit_model(size: int) -> None:
    """Embedding, both blocks split, head: one SGD step gives the unsplit loss and updated weights."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SPEC.vocab_size, (4, SPEC.block_size), generator=g)
    labels = torch.randint(0, SPEC.vocab_size, (4, SPEC.block_size), generator=g)

    def train_step(model: nn.Module) -> float:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        return loss.item()

    full = build_full_model(SPEC, SEED)
    want_loss = train_step(full)
    reducer = ThreadAllReduce(size)
    ranks = [
        build_parallel_layers(SPEC, 0, SPEC.num_layers, SEED, Shard(r, size), reducer.for_rank(r)) for r in range(size)
    ]
    with ThreadPoolExecutor(max_workers=size) as pool:
        losses = list(pool.map(train_step, ranks))
    assert losses == pytest.approx([want_loss] * size, abs=1e-6)
    assert reducer.calls == 4 * SPEC.n_layer
    full_params = dict(full.named_parameters())
    for rank, model in enumerate(ranks):
        for name, param in model.named_parameters():
            want = shard_tensor(SPEC, Shard(rank, size), name, full_params[name].detach())
            torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-5, msg=name)
