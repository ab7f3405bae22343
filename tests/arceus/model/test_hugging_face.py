"""A Llama's stage checkpoint files assembled into a Hugging Face folder (a tar stream): `transformers`
loads it with `LlamaForCausalLM.from_pretrained`, and its logits are the pipeline's; and the other way,
uploaded Hugging Face weights give each stage its layers, cut from the upload and checked layer by layer."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from arceus.checkpoint import StateFile, encode_checkpoint
from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.hugging_face import (
    hugging_face_folder,
    hugging_face_weights_check,
    initial_weights_layer_digests,
    initial_weights_slice,
    initial_weights_slice_check,
)
from arceus.model.llama.hf import hf_name
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
    assert info.value.field == "format" and "no Hugging Face format (only llama)" in info.value.message


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
