"""A Llama's (and a GPT's) stage checkpoint files assembled into a Hugging Face folder (a tar stream):
`transformers` loads it with `LlamaForCausalLM.from_pretrained` (`GPT2LMHeadModel`), and its logits are the
pipeline's; and the other way,
uploaded Hugging Face weights (fp32, or bf16/fp16 and sharded as `transformers` saves them) give each stage its
layers, cut from the upload and checked layer by layer."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from arceus.checkpoint import StateFile, encode_checkpoint
from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.gpt.hf import hf_config as gpt_hf_config
from arceus.model.hugging_face import (
    SHARDS_INDEX,
    folder_weights,
    hugging_face_config_check,
    hugging_face_folder,
    hugging_face_weights_check,
    initial_weights_layer_digests,
    initial_weights_slice,
    initial_weights_slice_check,
)
from arceus.model.llama.hf import hf_config, hf_name
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import OPTIMIZER_PREFIX, CheckpointError
from tests.arceus.model.test_llama_model import SMALL, ids

SPEC = model_spec_from_config(SMALL)


def stage_file(start: int, end: int) -> io.BytesIO:
    """Stage [start, end)'s state file as an agent writes it: its weights and an optimizer's state."""
    tensors = {name: p.detach() for name, p in named_global_parameters(build_layers(SPEC, start, end, seed=7))}
    tensors |= {f"{OPTIMIZER_PREFIX}{name}.momentum_buffer": t * 0.5 for name, t in tensors.items()}
    return io.BytesIO(encode_checkpoint(tensors))


def test_the_folder_loads_with_from_pretrained_and_gives_the_pipelines_logits(tmp_path: Path) -> None:
    size, chunks = hugging_face_folder(
        SPEC, [stage_file(0, 2), stage_file(2, 4)], keep=lambda n: not n.startswith(OPTIMIZER_PREFIX),
        metadata={"step": "3"},
    )
    archive = b"".join(chunks)
    assert len(archive) == size
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r|") as tar:
        tar.extractall(tmp_path / "folder", filter="data")
    folder = tmp_path / "folder"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["num_key_value_heads"] == 2

    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.rope_parameters["rope_theta"] == 500.0 and loaded.dtype == torch.float32
    with torch.no_grad():
        want = build_full_model(SPEC, seed=7)(ids())
        torch.testing.assert_close(loaded(ids()).logits, want, rtol=0, atol=1e-5)


def test_a_model_without_the_format_is_refused_naming_format() -> None:
    mlp = model_spec_from_config({"layer_sizes": [4, 3, 2]})
    with pytest.raises(SpecError) as info:
        hugging_face_folder(mlp, [], keep=lambda n: True, metadata={})
    assert info.value.field == "format" and "no Hugging Face format (only transformer, llama)" in info.value.message


def uploaded(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    full = build_full_model(SPEC, seed=11)
    path = tmp_path / "model.safetensors"
    save_file({hf_name(SPEC, n): p.detach() for n, p in named_global_parameters(full)}, path)
    return path, full


def test_a_stage_gets_its_layers_of_uploaded_weights_under_its_own_names_and_checks_each(tmp_path: Path) -> None:
    path, full = uploaded(tmp_path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        hugging_face_weights_check(SPEC, handle, size)
        digests = initial_weights_layer_digests(SPEC, handle, size)
        length, chunks = initial_weights_slice(SPEC, handle, size, 1, 3)
        sliced = tmp_path / "slice.safetensors"
        sliced.write_bytes(b"".join(chunks))
    assert len(digests) == SPEC.num_layers and sliced.stat().st_size == length < size
    with sliced.open("rb") as handle:  # what the agent checks before it loads a tensor
        initial_weights_slice_check(handle, length, 1, digests[1:3])
    stage = build_layers(SPEC, 1, 3, seed=0)
    weights = StateFile(sliced)
    assert sorted(weights) == sorted(n for n, _ in named_global_parameters(stage))
    assert weights.shape_of("layers.1.self_attn.k_proj.weight") == [16, 32]  # read from the header
    stage.load_state_dict({n.removeprefix("layers."): t for n, t in weights.items()})
    with torch.no_grad():
        h = full[0](ids())
        torch.testing.assert_close(stage(h), full[1:3](h), rtol=0, atol=0)


def test_a_slice_that_is_not_its_layers_as_uploaded_is_refused_naming_the_layer(tmp_path: Path) -> None:
    path, _ = uploaded(tmp_path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        digests = initial_weights_layer_digests(SPEC, handle, size)
        _, chunks = initial_weights_slice(SPEC, handle, size, 1, 3)
        data = bytearray(b"".join(chunks))
    data[-1] ^= 1  # one bit of the last tensor of layer 2
    with pytest.raises(CheckpointError, match="layer 2 of the initial weights hashes to"):
        initial_weights_slice_check(io.BytesIO(bytes(data)), len(data), 1, digests[1:3])
    with pytest.raises(CheckpointError, match="layer 1 of the initial weights hashes to"):  # another layer's digest
        initial_weights_slice_check(io.BytesIO(bytes(data)), len(data), 1, digests[2:4])
    with pytest.raises(CheckpointError, match="hold layer 2, outside layers \\[1, 2\\)"):
        initial_weights_slice_check(io.BytesIO(bytes(data)), len(data), 1, digests[1:2])
    extra = encode_checkpoint({"lm_head.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="lm_head.weight is no layer's parameter"):
        initial_weights_slice_check(io.BytesIO(extra), len(extra), 1, digests[1:2])


def shipped_folder(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, LlamaForCausalLM]:
    """A Llama of SPEC's config as Hugging Face ships one: saved by `transformers` in `dtype`, sharded (an index
    and several files)."""
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**hf_config(SPEC))).to(dtype)
    folder = tmp_path / "shipped"
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder, model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sharded_half_precision_checkpoint_uploads_as_one_file_each_stage_gets_its_layers(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """A checkpoint as shipped (bf16 or fp16, in shards named by model.safetensors.index.json) streams as the one
    file an upload is; it passes the control plane's check as it is (half the bytes of fp32), and the stages
    built from their slices, their weights widened to fp32, give the logits of `transformers`' own model."""
    folder, shipped = shipped_folder(tmp_path, dtype)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2 and not (folder / "model.safetensors").exists()
    upload = tmp_path / "upload.safetensors"
    with folder_weights(folder) as (length, chunks), upload.open("wb") as out:
        for chunk in chunks:
            out.write(chunk)
    size = upload.stat().st_size
    assert size == length < sum(p.numel() for p in shipped.parameters()) * 2 + 8192  # 2 bytes a parameter
    stages = [build_layers(SPEC, 0, 2, seed=0), build_layers(SPEC, 2, 4, seed=0)]
    with upload.open("rb") as handle:
        hugging_face_weights_check(SPEC, handle, size)
        digests = initial_weights_layer_digests(SPEC, handle, size)
        for stage, (start, end) in zip(stages, [(0, 2), (2, 4)], strict=True):
            sliced = tmp_path / f"slice-{start}.safetensors"
            sliced.write_bytes(b"".join(initial_weights_slice(SPEC, handle, size, start, end)[1]))
            with sliced.open("rb") as received:  # what the agent checks before it loads a tensor
                initial_weights_slice_check(received, sliced.stat().st_size, start, digests[start:end])
            weights = StateFile(sliced)
            assert {weights.dtype_of(n) for n in weights} == {dtype}
            stage.load_state_dict({n.removeprefix("layers."): t for n, t in weights.items()})  # copied, widened
    theirs = shipped.float().eval()  # the shipped values exactly, computed in fp32
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](ids())), theirs(ids()).logits, rtol=0, atol=1e-5)


def test_a_shard_the_index_does_not_describe_and_a_folder_without_weights_are_refused(tmp_path: Path) -> None:
    folder, _ = shipped_folder(tmp_path, torch.bfloat16)
    index = json.loads((folder / SHARDS_INDEX).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    (folder / SHARDS_INDEX).write_text(json.dumps({"weight_map": {**index["weight_map"], name: other}}))
    with pytest.raises(CheckpointError, match=f"and {SHARDS_INDEX} disagree on {name}"), folder_weights(folder):
        pass
    (folder / SHARDS_INDEX).write_text(json.dumps({"weight_map": {name: "../model.safetensors"}}))
    with pytest.raises(CheckpointError, match="must name shard files in its folder"), folder_weights(folder):
        pass
    with pytest.raises(CheckpointError, match="holds neither model.safetensors nor"), folder_weights(tmp_path):
        pass


def test_weights_of_another_float_dtype_are_refused_naming_the_ones_taken(tmp_path: Path) -> None:
    path, full = uploaded(tmp_path)
    save_file({hf_name(SPEC, n): p.detach().double() for n, p in named_global_parameters(full)}, path)
    with path.open("rb") as handle, pytest.raises(CheckpointError, match=r"float64 \[23, 32\]; the model's is "
                                                    r"float32 \[23, 32\] \(or bfloat16, float16\)"):
        hugging_face_weights_check(SPEC, handle, path.stat().st_size)


GPT = model_spec_from_config({"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 8,
                              "vocab_size": 19})


def test_a_gpt_exports_as_a_gpt2_folder_and_a_gpt2_checkpoint_starts_one(tmp_path: Path) -> None:
    """Out: a GPT's stage files as the folder `GPT2LMHeadModel.from_pretrained` loads, its Conv1D weights
    transposed, with the pipeline's logits. In: that model saved by `transformers` in bf16, sharded, cut into
    stages whose logits are its own."""
    tokens = torch.randint(0, GPT.vocab_size, (3, GPT.block_size), generator=torch.Generator().manual_seed(1))
    stage_files = []
    for start, end in [(0, 2), (2, 4)]:
        layers = build_layers(GPT, start, end, seed=7)
        stage_files.append(io.BytesIO(encode_checkpoint({n: p.detach() for n, p in named_global_parameters(layers)})))
    size, chunks = hugging_face_folder(GPT, stage_files, keep=lambda n: True, metadata={})
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r|") as tar:
        tar.extractall(tmp_path / "exported", filter="data")
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, build_full_model(GPT, seed=7)(tokens), rtol=0, atol=1e-5)

    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "shipped", max_shard_size="6KB")
    assert len(list((tmp_path / "shipped").glob("model-*-of-*.safetensors"))) >= 2
    with folder_weights(tmp_path / "shipped") as (length, chunks):
        upload = io.BytesIO(b"".join(chunks))
    hugging_face_weights_check(GPT, upload, length)
    digests = initial_weights_layer_digests(GPT, upload, length)
    stages = []
    for start, end in [(0, 3), (3, 4)]:
        sliced = b"".join(initial_weights_slice(GPT, upload, length, start, end)[1])
        initial_weights_slice_check(io.BytesIO(sliced), len(sliced), start, digests[start:end])
        stage = build_layers(GPT, start, end, seed=0)
        stage.load_state_dict({n.removeprefix("layers."): t for n, t in safetensors_load(sliced).items()})
        stages.append(stage)
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), theirs.float()(tokens).logits, rtol=0, atol=1e-5)


def test_a_checkpoint_config_that_computes_another_function_is_refused_naming_the_key(tmp_path: Path) -> None:
    """What transformers saves of our own configs passes; GPT-2's defaults (its tanh GELU, tied embeddings), a
    tied Llama or another epsilon compute something else from tensors of the very same shapes: refused."""
    for spec, config in ((SPEC, LlamaConfig(**hf_config(SPEC))), (GPT, GPT2Config(**gpt_hf_config(GPT)))):
        config.save_pretrained(tmp_path / spec.type)
        hugging_face_config_check(spec, json.loads((tmp_path / spec.type / "config.json").read_text()))
    gpt2 = GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=8, vocab_size=19).to_dict()
    with pytest.raises(CheckpointError, match="config.json's activation_function is 'gelu_new'; this job's "
                                              "transformer has 'gelu'"):
        hugging_face_config_check(GPT, gpt2)
    with pytest.raises(CheckpointError, match="activation_function is 'gelu_new'"):  # left out: transformers' default
        hugging_face_config_check(GPT, {k: v for k, v in gpt_hf_config(GPT).items() if k != "activation_function"})
    with pytest.raises(CheckpointError, match="tie_word_embeddings is True; this job's llama has False \\(set "
                                              "model_config.tie_word_embeddings to match\\)"):
        hugging_face_config_check(SPEC, {**hf_config(SPEC), "tie_word_embeddings": True})
    with pytest.raises(CheckpointError, match="rms_norm_eps is 1e-06; this job's llama has 1e-05"):
        hugging_face_config_check(SPEC, {**hf_config(SPEC), "rms_norm_eps": 1e-6})


TIED = {
    "llama": model_spec_from_config({**SMALL, "tie_word_embeddings": True}),
    "transformer": model_spec_from_config({"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16,
                                           "block_size": 8, "vocab_size": 19, "tie_word_embeddings": True}),
}
HF_MODELS = {"llama": (LlamaForCausalLM, LlamaConfig, hf_config), "transformer": (GPT2LMHeadModel, GPT2Config,
                                                                                   gpt_hf_config)}


@pytest.mark.parametrize("kind", list(TIED))
def test_tied_embeddings_export_as_one_tensor_and_a_tied_sharded_bf16_checkpoint_gives_both_stages_its_copy(
    kind: str, tmp_path: Path
) -> None:
    """Out: a tied model's stage files (stage 0 holds the embedding, stage 1 the head's copy) as a folder holding the
    one tensor, which `from_pretrained` ties again: the pipeline's logits. In: a tied model as `transformers` saves
    it, bf16 and sharded (the head is not in the files): each stage's slice holds its copy, the same bits."""
    spec = TIED[kind]
    model_class, config_class, config_of = HF_MODELS[kind]
    tokens = torch.randint(0, spec.vocab_size, (3, spec.block_size), generator=torch.Generator().manual_seed(1))
    files = [io.BytesIO(encode_checkpoint({n: p.detach() for n, p in named_global_parameters(
        build_layers(spec, start, end, seed=7))})) for start, end in [(0, 2), (2, spec.num_layers)]]
    head = f"layers.{spec.num_layers - 1}.lm_head.weight"
    embedding = f"layers.0.{spec.embedding_weight}"
    size, chunks = hugging_face_folder(spec, files, keep=lambda n: True, metadata={})
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r|") as tar:
        tar.extractall(tmp_path / "exported", filter="data")
    stored = safetensors_load((tmp_path / "exported" / "model.safetensors").read_bytes())
    assert "lm_head.weight" not in stored and len(stored) == sum(len(spec.layer_parameters(i))
                                                                 for i in range(spec.num_layers)) - 1
    theirs = model_class.from_pretrained(tmp_path / "exported").eval()
    assert theirs.config.tie_word_embeddings and theirs.lm_head.weight is theirs.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, build_full_model(spec, seed=7)(tokens), rtol=0, atol=1e-5)

    torch.manual_seed(5)
    shipped = model_class(config_class(**config_of(spec))).to(torch.bfloat16)
    shipped.save_pretrained(tmp_path / "shipped", max_shard_size="6KB")
    assert len(list((tmp_path / "shipped").glob("model-*-of-*.safetensors"))) >= 2
    hugging_face_config_check(spec, json.loads((tmp_path / "shipped" / "config.json").read_text()))
    with folder_weights(tmp_path / "shipped") as (length, chunks):
        upload = io.BytesIO(b"".join(chunks))
    hugging_face_weights_check(spec, upload, length)
    digests = initial_weights_layer_digests(spec, upload, length)
    slices = []
    for start, end in [(0, 1), (1, spec.num_layers)]:
        sliced = b"".join(initial_weights_slice(spec, upload, length, start, end)[1])
        initial_weights_slice_check(io.BytesIO(sliced), len(sliced), start, digests[start:end])
        slices.append(safetensors_load(sliced))
    assert torch.equal(slices[0][embedding], slices[1][head])
    assert torch.equal(slices[1][head], shipped.get_input_embeddings().weight)
    untied = model_spec_from_config({**spec_config(kind), "tie_word_embeddings": False})
    with pytest.raises(CheckpointError, match="tie_word_embeddings is True; this job's .* has False"):
        hugging_face_config_check(untied, json.loads((tmp_path / "shipped" / "config.json").read_text()))
    with pytest.raises(CheckpointError, match="the weights lack lm_head.weight"):  # an untied job needs its own head
        hugging_face_weights_check(untied, upload, length)


def spec_config(kind: str) -> dict[str, object]:
    if kind == "llama":
        return {**SMALL}
    return {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 19}
