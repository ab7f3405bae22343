"""An exported model's config is checked like any other: each wrong field is refused by name, a capture that does
not fit its dataset is refused at submission, and a named cut that cannot carry one tensor is refused at capture."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from arceus.errors import SpecError
from arceus.model.buffers import persistent_buffers
from arceus.model.build import build_layers
from arceus.model.exported.capture import CapturedModel, capture
from arceus.model.exported.program import program_layers
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config


class TwoHeads(nn.Module):
    """Two heads read the same hidden state: between them two tensors would cross."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 16)
        self.out = nn.Linear(16, 10)
        self.mid = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h) + self.mid(h)


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    torch.manual_seed(0)
    return capture(TwoHeads(), torch.rand(4, 64))


def test_the_spec_answers_from_the_config_alone(captured: CapturedModel) -> None:
    spec, _, dataset = fit_model_to_dataset(captured.model_config, {"name": "digits"})
    assert spec.num_layers == 2  # inp | out + mid: at mid's beginning h and out's logits would cross
    assert spec.layer_params() == [64 * 16 + 16, 2 * (16 * 10 + 10)]
    assert spec.input_layout(0).shape == (64,) and spec.output_layout(1).shape == (10,)
    assert spec.label_layout().bound == 10 and dataset["name"] == "digits"
    assert all(f > 0 for f in spec.layer_flops_per_sample())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.update(extra=1), "model_config.extra"),
        (lambda c: c.update(layers=[]), "model_config.layers"),
        (lambda c: c["layers"][0].update(sha256="x"), "model_config.layers[0].sha256"),
        (lambda c: c["layers"][0]["parameters"].update({"a b": [1]}), "model_config.layers[0].parameters"),
        (lambda c: c["layers"][0]["parameters"].update(w=[0]), "model_config.layers[0].parameters.w"),
        (lambda c: c["layers"][0]["output"].update(dtype="int64"), "model_config.layers[0].output.dtype"),
        (lambda c: c["labels"].update(bound=7), "model_config.labels"),
        (lambda c: c["layers"][0].update(buffers=[]), "model_config.layers[0].buffers"),
        (lambda c: c["layers"][0].update(buffers={"bn.m": {"dtype": "uint8", "shape": [2]}}),
         "model_config.layers[0].buffers.bn.m.dtype"),
        (lambda c: c["layers"][0].update(buffers={"bn.m": {"dtype": "float32", "shape": [0]}}),
         "model_config.layers[0].buffers.bn.m.shape"),
        (lambda c: c.update(program_sha256=None), "model_config.program_sha256"),
    ],
)
def test_a_wrong_field_is_refused_by_name(captured: CapturedModel, change: Any, field: str) -> None:
    config = copy.deepcopy(captured.model_config)
    change(config)
    with pytest.raises(SpecError) as refused:
        model_spec_from_config(config)
    assert refused.value.field == field


def test_a_capture_that_does_not_fit_its_dataset_is_refused(captured: CapturedModel) -> None:
    with pytest.raises(SpecError, match="digits samples are float32 \\[64\\]") as refused:
        fit_model_to_dataset(capture(nn.Linear(32, 10), torch.rand(4, 32)).model_config, {"name": "digits"})
    assert refused.value.field == "model_config.input"
    with pytest.raises(SpecError, match="3 classes") as refused:
        fit_model_to_dataset(capture(nn.Linear(64, 3), torch.rand(4, 64)).model_config, {"name": "digits"})


class TinyLanguageModel(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def test_a_captured_language_model_fits_a_text_by_its_vocabulary_and_window(tmp_path) -> None:  # noqa: ANN001
    text = tmp_path / "abc.txt"
    text.write_text("abcabcabd" * 20, encoding="utf-8")  # 4 distinct characters
    dataset = {"name": "text", "source": str(text)}
    fitted = capture(TinyLanguageModel(4), torch.randint(0, 4, (2, 12)), input_bound=4).model_config
    _, _, config = fit_model_to_dataset(fitted, dataset)
    assert config["block_size"] == 12  # the windows the model was captured on
    with pytest.raises(SpecError, match="the text has 4 distinct characters: capture the model with input_bound=4"):
        fit_model_to_dataset(capture(TinyLanguageModel(5), torch.randint(0, 5, (2, 12)), input_bound=5).model_config,
                             dataset)
    with pytest.raises(SpecError, match="reads windows of 12 tokens"):
        fit_model_to_dataset(fitted, {**dataset, "block_size": 16})
    with pytest.raises(SpecError, match="on a text, capture a language model on int64 token ids"):
        fit_model_to_dataset(capture(nn.Linear(64, 3), torch.rand(4, 64)).model_config, dataset)


def test_a_named_cut_that_cannot_carry_one_tensor_is_refused() -> None:
    torch.manual_seed(0)
    cut = capture(TwoHeads(), torch.rand(4, 64), split_points=["out"])
    assert [list(layer["parameters"]) for layer in cut.model_config["layers"]] == [
        ["inp.weight", "inp.bias"], ["out.weight", "out.bias", "mid.weight", "mid.bias"]
    ]
    with pytest.raises(SpecError, match="2 values cross it") as refused:
        capture(TwoHeads(), torch.rand(4, 64), split_points=["out", "mid"])
    assert refused.value.field == "split_points['mid']"
    with pytest.raises(SpecError, match="names no module"):
        capture(TwoHeads(), torch.rand(4, 64), split_points=["nowhere"])


def test_a_captured_batchnorms_buffers_are_declared_and_held_by_the_built_layers() -> None:
    """capture() declares each layer's persistent buffers (what a stage's state holds beside its weights, known to
    the control plane from the spec alone); the layers built from the program hold exactly those. A config that
    declares other buffers than its graph holds (one captured before buffers were declared) is refused at build,
    naming the field and how to fix it."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    cap = capture(module, torch.rand(4, 64), split_points=["3"])
    spec = model_spec_from_config(cap.model_config)
    documents = program_layers(cap.program, [layer["sha256"] for layer in cap.model_config["layers"]])
    built = build_layers(spec.with_documents(dict(enumerate(documents))), 0, spec.num_layers, seed=0)
    held = {name: (str(b.dtype).removeprefix("torch."), list(b.shape)) for name, b in persistent_buffers(built)}
    declared = {f"{i}.{name}": layout for i in range(spec.num_layers) for name, layout in spec.layer_buffers(i).items()}
    assert held == declared and {n.rpartition(".")[2] for n in declared} == {
        "running_mean", "running_var", "num_batches_tracked"
    }
    assert declared["0.1.num_batches_tracked"] == ("int64", [])

    old = copy.deepcopy(cap.model_config)
    for layer in old["layers"]:
        del layer["buffers"]
    stale = model_spec_from_config(old)
    assert all(stale.layer_buffers(i) == {} for i in range(stale.num_layers))
    with pytest.raises(SpecError, match="capture the model again") as refused:
        build_layers(stale.with_documents(dict(enumerate(documents))), 0, stale.num_layers, seed=0)
    assert refused.value.field == "model_config.layers[0].buffers"
