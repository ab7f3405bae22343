"""Tied weights as the spec declares them: groups checked, which stages share one, and the one order of the sum."""

from __future__ import annotations

import pytest
import torch

from arceus.errors import SpecError
from arceus.model.registry import model_spec_from_config
from arceus.model.tied import stages_sharing, tied_groups, tied_groups_check, tied_sum

LLAMA = {"type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "max_position_embeddings": 8, "vocab_size": 13, "tie_word_embeddings": True}
SHAPES = {0: {"wte.weight": [5, 4]}, 1: {"w": [4, 4]}, 2: {"head.weight": [5, 4], "bias": [5]}}


def test_the_first_and_last_stage_share_a_tied_embedding_and_the_middle_stage_shares_nothing() -> None:
    spec = model_spec_from_config(LLAMA)
    (group,) = tied_groups(spec)
    assert group.members == ("layers.0.embed_tokens.weight", "layers.3.lm_head.weight")
    assert group.held(0, 1) == ("layers.0.embed_tokens.weight",) and group.held(1, 3) == ()
    ranges = [(0, 1), (1, 3), (3, 4)]
    assert [stages_sharing(spec, ranges, i) for i in range(3)] == [(2,), (), (0,)]
    assert stages_sharing(spec, [(0, 4)], 0) == ()  # one stage holds both copies: it sums them itself
    assert stages_sharing(model_spec_from_config({**LLAMA, "tie_word_embeddings": False}), ranges, 0) == ()


@pytest.mark.parametrize(
    ("groups", "fragment"),
    [
        ([["layers.0.wte.weight"]], "at least two"),
        ([["layers.0.wte.weight", "layers.2.nope"]], "layers.2.nope is no parameter"),
        ([["layers.0.wte.weight", "layers.2.bias"]], "different shapes"),
        ([["layers.2.head.weight", "layers.0.wte.weight"]], "by layer"),
        ([["layers.0.wte.weight", "layers.2.head.weight"], ["layers.0.wte.weight", "layers.1.w"]], "in two groups"),
        ([["wte.weight", "layers.2.head.weight"]], "not a pipeline parameter name"),
    ],
)
def test_a_bad_group_is_refused_naming_it(groups: list[list[str]], fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        tied_groups_check(groups, SHAPES.__getitem__, 3, "model_config.tied")
    assert info.value.field.startswith("model_config.tied[") and fragment in info.value.message


def test_the_sum_adds_in_member_order_whoever_computes_it() -> None:
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    assert tied_sum(parts).item() == (parts[0] + parts[1] + parts[2]).item() == 0.0  # fp32: 1e8 + 1 rounds away
    assert tied_sum(parts[:2]).equal(parts[1] + parts[0])  # two copies: either order is the same bits
