"""Decoding with a key/value cache computes what the plain forward computes, however the positions are fed."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.model.build import build_full_model, build_layers
from arceus.model.decoding import DecodeState, decode, decodes
from arceus.model.registry import model_spec_from_config

CONFIG = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 12, "vocab_size": 7}
SPEC = model_spec_from_config(CONFIG)


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=6),
    batch=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_decoding_in_chunks_equals_the_forward_of_the_whole_prefix(chunks: list[int], batch: int, seed: int) -> None:
    total = min(sum(chunks), SPEC.block_size)
    ids = torch.randint(0, 7, (batch, total), generator=torch.Generator().manual_seed(seed))
    model = build_full_model(SPEC, seed=seed % 5)
    with torch.no_grad():
        expected = model(ids)
        state, outputs, start = DecodeState(), [], 0
        for size in chunks:
            if start >= total:
                break
            outputs.append(decode(model, ids[:, start : start + size], state))
            start += outputs[-1].shape[1]
    assert state.position == total
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_a_split_model_decodes_stage_by_stage_as_one() -> None:
    ids = torch.randint(0, 7, (1, 9), generator=torch.Generator().manual_seed(1))
    whole = build_full_model(SPEC, seed=0)
    stages = [build_layers(SPEC, 0, 2, seed=0), build_layers(SPEC, 2, SPEC.num_layers, seed=0)]
    states = [DecodeState(), DecodeState()]
    with torch.no_grad():
        expected = whole(ids)
        outputs = []
        for start, size in ((0, 5), (5, 1), (6, 3)):
            x = ids[:, start : start + size]
            for stage, state in zip(stages, states, strict=True):
                x = decode(stage, x, state)
            outputs.append(x)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_only_layers_with_a_decode_step_decode() -> None:
    assert decodes(build_full_model(SPEC, seed=0))
    assert not decodes(build_full_model(model_spec_from_config({"layer_sizes": [4, 3, 2]}), seed=0))
