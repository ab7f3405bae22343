"""The exchange's cut (chunks cover the gradient, near-equal, owned by the members in order; shards bounded)
and its sum (the same bits whatever the arrival order; the true sum to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from arceus.swarm.exchange import MAX_SHARD_BYTES, Chunk, chunk_bounds, reduce_in_order, shard_bounds

member_ids = st.lists(st.integers(0, 100), min_size=1, max_size=8, unique=True).map(sorted)


@given(total=st.integers(0, 10**9), members=member_ids)
def test_chunks_cover_contiguously_near_equal_owned_in_order(total: int, members: list[int]) -> None:
    chunks = chunk_bounds(total, members)
    assert [c.owner for c in chunks] == members
    assert chunks[0].start == 0 and chunks[-1].end == total
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:], strict=False))
    sizes = [c.end - c.start for c in chunks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


@given(start=st.integers(0, 10**9), length=st.integers(0, 10**8), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_shards_tile_a_chunk_within_the_message_bound(start: int, length: int, itemsize: int) -> None:
    chunk = Chunk(owner=3, start=start, end=start + length)
    shards = shard_bounds(chunk, itemsize)
    assert [s for s, _ in shards] == list(range(start, start + length, MAX_SHARD_BYTES // itemsize))
    assert all(0 < (e - s) * itemsize <= MAX_SHARD_BYTES for s, e in shards)
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:], strict=False))
    assert (shards[-1][1] if shards else start) == chunk.end
    assert len(shards) == -(-length * itemsize // MAX_SHARD_BYTES)  # the fewest messages that fit


def test_cut_examples_and_errors() -> None:
    assert chunk_bounds(10, [2, 5, 9]) == (Chunk(2, 0, 4), Chunk(5, 4, 7), Chunk(9, 7, 10))
    assert chunk_bounds(1, [0, 1]) == (Chunk(0, 0, 1), Chunk(1, 1, 1))
    assert shard_bounds(Chunk(0, 0, 2**21 + 1), 4) == ((0, 2**20), (2**20, 2**21), (2**21, 2**21 + 1))
    assert shard_bounds(Chunk(0, 5, 5), 4) == ()
    with pytest.raises(ValueError, match="at least 1 member, each once"):
        chunk_bounds(10, [1, 1])
    with pytest.raises(ValueError, match="itemsize must be in"):
        shard_bounds(Chunk(0, 0, 1), 0)


parts_of = st.integers(1, 6).flatmap(
    lambda r: st.tuples(
        st.lists(st.integers(0, 50), min_size=r, max_size=r, unique=True),
        st.integers(0, 2**31 - 1),
        st.integers(1, 300),
        st.permutations(range(r)),
    )
)


@given(parts_of)
def test_reduce_is_bitwise_the_same_whatever_the_arrival_order(args: tuple) -> None:
    ids, seed, n, order = args
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes far apart, so a different order of addition would round differently.
    scales = torch.randint(-6, 7, (len(ids),), generator=generator).float()
    tensors = {k: torch.randn(n, generator=generator) * 10 ** scales[j] for j, k in enumerate(ids)}
    arrived = {ids[j]: tensors[ids[j]] for j in order}
    reduced = reduce_in_order(arrived)
    assert torch.equal(reduced, reduce_in_order(tensors))
    into = torch.full((n,), float("nan"))  # into a given tensor (the exchange's result): the same bits
    assert reduce_in_order(arrived, out=into) is into and torch.equal(into, reduced)
    expected = tensors[min(ids)].clone()
    for k in sorted(ids)[1:]:
        expected = expected + tensors[k]  # the definition: left to right in ascending replica id
    assert torch.equal(reduced, expected)
    exact = sum(t.double() for t in tensors.values())
    bound = len(ids) * torch.finfo(torch.float32).eps * sum(t.double().abs() for t in tensors.values())
    assert bool(((reduced.double() - exact).abs() <= bound).all())


def test_the_order_matters_which_is_why_it_is_fixed() -> None:
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    assert reduce_in_order({0: a, 1: b, 2: c}).item() == 1.0  # (a + b) + c
    assert reduce_in_order({0: a, 1: c, 2: b}).item() == 0.0  # (a + c) + b: c is lost to rounding


def test_reduce_leaves_the_parts_alone_and_refuses_mismatches() -> None:
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(reduce_in_order({4: a, 1: b}), torch.full((3,), 3.0))
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((3,), 2.0))
    assert reduce_in_order({7: a}) is not a
    with pytest.raises(ValueError, match="replica 2's part is torch.float32 \\(4,\\)"):
        reduce_in_order({1: a, 2: torch.ones(4)})
    with pytest.raises(ValueError, match="nothing to reduce"):
        reduce_in_order({})
    with pytest.raises(ValueError, match="the sum goes into a torch.float64 \\(3,\\) tensor"):
        reduce_in_order({1: a, 2: b}, out=torch.zeros(3, dtype=torch.float64))
