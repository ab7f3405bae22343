"""The GPT spec (torch-free sizes, costs and layouts) and its layers: any split starts from the same weights
and computes the same function as the whole model."""

from __future__ import annotations

import pytest
import torch

from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers
from arceus.model.gpt.spec import GPTSpec
from arceus.model.layout import TensorLayout
from arceus.model.registry import model_spec_from_config

SMALL = {"type": "transformer", "n_layer": 3, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 11}


def test_layers_are_embedding_blocks_and_head_with_the_params_the_spec_counts() -> None:
    spec = model_spec_from_config(SMALL)
    assert isinstance(spec, GPTSpec) and spec.num_layers == 5
    model = build_full_model(spec, seed=3)
    assert [type(layer).__name__ for layer in model] == ["GPTEmbedding", "GPTBlock", "GPTBlock", "GPTBlock", "GPTHead"]
    assert [sum(p.numel() for p in layer.parameters()) for layer in model] == spec.layer_params()
    # The head is not tied to the embedding unless the config says so (tie_word_embeddings).
    assert model[0].wte.weight.data_ptr() != model[4].lm_head.weight.data_ptr()
    assert spec.tied_parameters() == ()


def test_tied_embeddings_are_one_parameter_in_one_process_and_equal_copies_in_any_split() -> None:
    spec = model_spec_from_config({**SMALL, "tie_word_embeddings": True})
    assert spec.tied_parameters() == (("layers.0.wte.weight", "layers.4.lm_head.weight"),)
    model = build_full_model(spec, seed=3)
    assert model[4].lm_head.weight is model[0].wte.weight
    assert sum(p.numel() for p in model.parameters()) == sum(spec.layer_params()) - 11 * 16
    assert set(model.state_dict()) >= {"0.wte.weight", "4.lm_head.weight"}  # a checkpoint names both copies
    head = build_layers(spec, 3, 5, seed=3)  # the last stage builds layer 0's embedding to start its copy
    assert torch.equal(head.get_parameter("4.lm_head.weight"), model[0].wte.weight)
    assert not torch.equal(build_layers(model_spec_from_config(SMALL), 3, 5, seed=3).get_parameter(
        "4.lm_head.weight"), model[0].wte.weight)


def test_layouts_and_costs() -> None:
    spec = model_spec_from_config(SMALL)
    assert spec.input_layout(0) == TensorLayout("int64", (8,), bound=11)
    assert spec.input_layout(2) == spec.output_layout(0) == TensorLayout("float32", (8, 16))
    assert spec.output_layout(4) == TensorLayout("float32", (8, 11))
    assert spec.label_layout() == TensorLayout("int64", (8,), bound=11)
    flops = spec.layer_flops_per_sample()
    assert flops[1] == 24 * 8 * 16 * 16 + 4 * 8 * 8 * 16 and flops[4] == 2 * 8 * 16 * 11
    assert spec.output_layout(1).nbytes == 8 * 16 * 4


@pytest.mark.parametrize("cut", [(0, 2), (2, 4), (1, 5)])
def test_any_split_starts_from_the_same_weights_and_computes_the_same(cut: tuple[int, int]) -> None:
    spec = model_spec_from_config(SMALL)
    full = build_full_model(spec, seed=5)
    start, end = cut
    part = build_layers(spec, start, end, seed=5)
    full_params = dict(full.named_parameters())
    for name, param in part.named_parameters():
        torch.testing.assert_close(param, full_params[name], rtol=0, atol=0)
    x = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(0))
    h = x
    for i in range(start):
        h = full[i](h)
    want = h
    for i in range(start, end):
        want = full[i](want)
    torch.testing.assert_close(part(h), want, rtol=0, atol=0)


def test_attention_is_causal() -> None:
    model = build_full_model(model_spec_from_config(SMALL), seed=1)
    x = torch.randint(0, 11, (1, 8), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 11
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :5], model(changed)[:, :5])
        assert not torch.allclose(model(x)[:, 5:], model(changed)[:, 5:])


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"d_model": 15}, "model_config.d_model", "divisible by n_head (2)"),
        ({"n_head": 0}, "model_config.n_head", "between 1 and"),
        ({"block_size": "8"}, "model_config.block_size", "positive integer"),
        ({"vocab": "word"}, "model_config.vocab", "must be one of char"),
        ({"tie_weights": True}, "model_config.tie_weights", "unknown key for a transformer"),
        ({"tie_word_embeddings": "yes"}, "model_config.tie_word_embeddings", "must be true or false"),
    ],
)
def test_invalid_gpt_configs_name_the_field(change: dict, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        model_spec_from_config({**SMALL, **change})
    assert info.value.field == field and fragment in info.value.message


def test_vocab_size_is_required_once_resolved() -> None:
    config = {k: v for k, v in SMALL.items() if k != "vocab_size"}
    with pytest.raises(SpecError) as info:
        model_spec_from_config(config)
    assert info.value.field == "model_config.vocab_size"
