"""The Llama-family decoder: its spec refuses bad configs by field, any split computes what the whole model
computes (also decoding position by position, and split over tensor-parallel ranks), and the whole model is
Hugging Face's `LlamaForCausalLM`: its state maps 1:1 onto `transformers`' names and gives the same logits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.decoding import DecodeState, decode
from arceus.model.llama.hf import hf_config, hf_name
from arceus.model.llama.parallel import shard_rows
from arceus.model.llama.spec import LlamaSpec
from arceus.model.llama.spec import tensor_parallel_check_size as check_size
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config
from arceus.model.sharding import Shard, slice_state
from arceus.model.tensor_parallel import build_parallel_layers
from tests.arceus.model.test_tensor_parallel import ThreadAllReduce

# Grouped-query attention: 4 query heads share 2 key/value heads.
SMALL: dict[str, Any] = {
    "type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 10, "vocab_size": 23, "rope_theta": 500.0,
    "rms_norm_eps": 1e-5,
}
SPEC = model_spec_from_config(SMALL)


def ids(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (batch, SPEC.block_size), generator=torch.Generator().manual_seed(seed))


def transformers_model(spec: LlamaSpec, ours: nn.Module) -> LlamaForCausalLM:
    """`LlamaForCausalLM` from our config.json, holding our weights under its names (strictly: every one)."""
    model = LlamaForCausalLM(LlamaConfig(**hf_config(spec)))
    model.load_state_dict({hf_name(spec, n): p.detach() for n, p in named_global_parameters(ours)}, strict=True)
    return model.eval()


def test_layers_hold_the_params_the_spec_counts_under_transformers_names() -> None:
    assert isinstance(SPEC, LlamaSpec) and SPEC.num_layers == 4 and SPEC.head_dim == 8 and SPEC.kv_size == 16
    model = build_full_model(SPEC, seed=3)
    assert [type(layer).__name__ for layer in model] == [
        "LlamaEmbedding", "LlamaDecoderLayer", "LlamaDecoderLayer", "LlamaHead"
    ]
    assert [sum(p.numel() for p in layer.parameters()) for layer in model] == SPEC.layer_params()
    names = sorted(hf_name(SPEC, n) for n, _ in named_global_parameters(model))
    assert names == sorted(LlamaForCausalLM(LlamaConfig(**hf_config(SPEC))).state_dict())
    assert hf_name(SPEC, "layers.2.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj.weight"
    for bad in ("layers.0.norm.weight", "layers.3.embed_tokens.weight", "optimizer.layers.0.x", "layers.x.y"):
        with pytest.raises(ValueError):
            hf_name(SPEC, bad)


def test_layouts_and_costs() -> None:
    d, t, kv, i, v = 32, 10, 16, 48, 23
    assert SPEC.input_layout(0).shape == (t,) and SPEC.input_layout(0).bound == v
    assert SPEC.output_layout(0).shape == SPEC.input_layout(3).shape == (t, d)
    assert SPEC.output_layout(3).shape == (t, v) and SPEC.label_layout().shape == (t,)
    assert SPEC.layer_flops_per_sample()[1] == 2 * t * (2 * d * d + 2 * d * kv + 3 * d * i) + 4 * t * t * d
    assert SPEC.split_layers() == frozenset({1, 2})


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"hidden_size": 36}, "model_config.hidden_size", "times an even head size"),
        ({"hidden_size": 12, "num_attention_heads": 4}, "model_config.hidden_size", "even head size"),
        ({"num_key_value_heads": 3}, "model_config.num_key_value_heads", "must divide num_attention_heads (4)"),
        ({"num_hidden_layers": 0}, "model_config.num_hidden_layers", "between 1 and"),
        ({"intermediate_size": True}, "model_config.intermediate_size", "positive integer"),
        ({"rms_norm_eps": 0}, "model_config.rms_norm_eps", "above 0"),
        ({"rope_theta": float("nan")}, "model_config.rope_theta", "must be a number"),
        ({"rope_theta": "1e4"}, "model_config.rope_theta", "must be a number"),
        ({"vocab": "word"}, "model_config.vocab", "must be one of char"),
        ({"tie_word_embeddings": 1}, "model_config.tie_word_embeddings", "must be true or false"),
        ({"tie_weights": True}, "model_config.tie_weights", "unknown key for a llama"),
    ],
)
def test_invalid_configs_name_the_field(change: dict, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        model_spec_from_config({**SMALL, **change})
    assert info.value.field == field and fragment in info.value.message
    without_vocab = {k: v for k, v in SMALL.items() if k != "vocab_size"}
    with pytest.raises(SpecError, match="model_config.vocab_size: is required"):
        model_spec_from_config(without_vocab)


def test_defaults_are_hugging_faces_where_it_has_one(tmp_path) -> None:  # noqa: ANN001
    spec = model_spec_from_config({"type": "llama", "vocab_size": 50})
    assert spec.num_key_value_heads == spec.num_attention_heads == 8 and spec.rms_norm_eps == 1e-6
    assert spec.rope_theta == 10000.0 and spec.block_size == 128
    text = tmp_path / "t.txt"
    text.write_text("abcab")
    fitted, model, dataset = fit_model_to_dataset(
        {"type": "llama", "max_position_embeddings": 4}, {"name": "text", "source": str(text)}
    )
    assert fitted.vocab_size == 3 and model["vocab_size"] == 3 and dataset["block_size"] == 4
    with pytest.raises(SpecError, match="model's max_position_embeddings is 4"):
        fit_model_to_dataset(
            {"type": "llama", "max_position_embeddings": 4}, {"name": "text", "source": str(text), "block_size": 5}
        )


@pytest.mark.parametrize("cut", [(0, 2), (1, 3), (2, 4)])
def test_any_split_starts_from_the_same_weights_and_computes_the_same(cut: tuple[int, int]) -> None:
    full = build_full_model(SPEC, seed=5)
    start, end = cut
    part = build_layers(SPEC, start, end, seed=5)
    full_params = dict(full.named_parameters())
    for name, param in part.named_parameters():
        assert torch.equal(param, full_params[name]), name
    with torch.no_grad():
        h = full[:start](ids()) if start else ids()
        torch.testing.assert_close(part(h), full[start:end](h), rtol=0, atol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query and multi-query attention
def test_the_logits_are_llama_for_causal_lms_to_1e_5(kv_heads: int) -> None:
    spec = model_spec_from_config({**SMALL, "num_key_value_heads": kv_heads})
    ours = build_full_model(spec, seed=kv_heads)
    theirs = transformers_model(spec, ours)
    with torch.no_grad():
        want = theirs(ids(seed=kv_heads)).logits
        got = ours(ids(seed=kv_heads))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert want.abs().max() > 0.1  # logits that say something


def test_decoding_with_the_cache_gives_the_forwards_logits() -> None:
    model = build_full_model(SPEC, seed=2)
    tokens = ids(batch=2, seed=4)
    stages = [build_layers(SPEC, 0, 2, seed=2), build_layers(SPEC, 2, SPEC.num_layers, seed=2)]
    states = [DecodeState(), DecodeState()]
    with torch.no_grad():
        expected = model(tokens)
        outputs = []
        for start, size in ((0, 4), (4, 1), (5, 5)):
            x = tokens[:, start : start + size]
            for stage, state in zip(stages, states, strict=True):
                x = decode(stage, x, state)
            outputs.append(x)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=0, atol=1e-5)


def test_a_llama_split_over_two_ranks_trains_like_the_unsplit_model() -> None:
    """Both decoder layers split by key/value groups and MLP units: one SGD step gives the unsplit loss,
    the unsplit weights (each rank its slice), and sampling's decode gives the same logits."""
    g = torch.Generator().manual_seed(5)
    tokens, labels = ids(batch=4, seed=1), torch.randint(0, SPEC.vocab_size, (4, SPEC.block_size), generator=g)

    def train_step(model: nn.Module) -> tuple[float, torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            return loss.item(), decode(model, tokens[:, :3], DecodeState())

    full = build_full_model(SPEC, 9)
    want_loss, want_decoded = train_step(full)
    reducer = ThreadAllReduce(2)
    ranks = [build_parallel_layers(SPEC, 0, SPEC.num_layers, 9, Shard(r, 2), reducer.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(train_step, ranks))
    full_state = {n: p.detach() for n, p in full.named_parameters()}
    for rank, (model, (loss, decoded)) in enumerate(zip(ranks, results, strict=True)):
        assert loss == pytest.approx(want_loss, abs=1e-6)
        torch.testing.assert_close(decoded, want_decoded, rtol=0, atol=1e-5)
        want = slice_state(shard_rows, SPEC, Shard(rank, 2), full_state)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), want[name], rtol=0, atol=1e-5, msg=name)
    assert model.get_submodule("1.self_attn.k_proj").weight.shape == (SPEC.kv_size // 2, SPEC.hidden_size)


def test_a_split_must_give_each_rank_whole_key_value_groups() -> None:
    check_size(SPEC, 2)
    with pytest.raises(SpecError) as info:
        check_size(SPEC, 4)  # 2 key/value heads
    assert info.value.field == "tensor_parallel.size" and "use one of 2" in info.value.message
