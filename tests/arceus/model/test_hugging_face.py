"""A Llama's stage checkpoint files assembled into a Hugging Face folder (a tar stream): `transformers`
loads it with `LlamaForCausalLM.from_pretrained`, and its logits are the pipeline's."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from arceus.checkpoint import OPTIMIZER_PREFIX, encode_checkpoint
from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.hugging_face import hugging_face_folder
from arceus.model.registry import model_spec_from_config
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
