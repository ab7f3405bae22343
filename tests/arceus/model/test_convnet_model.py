"""The CNN spec (torch-free sizes, costs and layouts), its layers and its fit to a dataset: any split starts
from the full model's weights, and every config error names its field."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from arceus.errors import SpecError
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.convnet.spec import ConvNetSpec
from arceus.model.layout import TensorLayout
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config

DIGITS = {"type": "convnet", "input_shape": [1, 8, 8], "classes": 10}
MNIST = {"type": "convnet", "channels": [4, 8, 16], "kernel_size": 5, "input_shape": [1, 28, 28], "classes": 10}


def test_defaults_and_case() -> None:
    spec = model_spec_from_config({**DIGITS, "type": "ConvNet", "activation": "GELU"})
    assert spec == ConvNetSpec(input_shape=(1, 8, 8), classes=10, channels=(8, 16), kernel_size=3, activation="gelu")
    assert spec.num_layers == 3 and spec.split_layers() == frozenset()


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"dropout": 0.1}, "model_config.dropout", "unknown key for a convnet"),
        ({"input_shape": None}, "model_config.input_shape", "job submission fills it in"),
        ({"classes": None}, "model_config.classes", "job submission fills it in"),
        ({"input_shape": [8, 8]}, "model_config.input_shape", "[channels, height, width]"),
        ({"input_shape": [1, 0, 8]}, "model_config.input_shape[1]", "from 1 to"),
        ({"classes": True}, "model_config.classes", "integer"),
        ({"channels": 8}, "model_config.channels", "list"),
        ({"channels": []}, "model_config.channels", "1 to 32 entries"),
        ({"channels": [8] * 33}, "model_config.channels", "1 to 32 entries"),
        ({"channels": [8, 4097]}, "model_config.channels[1]", "from 1 to 4096"),
        ({"channels": [8, 0]}, "model_config.channels[1]", "from 1 to 4096"),
        ({"channels": [2, 2, 2, 2]}, "model_config.channels", "too small for that many layers"),
        ({"kernel_size": 4}, "model_config.kernel_size", "odd"),
        ({"kernel_size": 9}, "model_config.kernel_size", "odd integer from 1 to 7"),
        ({"activation": "swish"}, "model_config.activation", "relu, gelu, tanh"),
    ],
)
def test_config_errors_name_the_field(change: dict[str, Any], field: str, words: str) -> None:
    config = {key: value for key, value in {**DIGITS, **change}.items() if value is not None}
    with pytest.raises(SpecError) as error:
        model_spec_from_config(config)
    assert error.value.field == field
    assert words in error.value.message


def test_an_image_takes_as_many_conv_layers_as_it_halves() -> None:
    assert model_spec_from_config({**DIGITS, "channels": [2, 2, 2]}).shapes()[-1] == (2, 1, 1)
    odd = model_spec_from_config({**DIGITS, "input_shape": [3, 7, 9], "channels": [2, 2]})
    assert odd.shapes() == [(3, 7, 9), (2, 3, 4), (2, 1, 2)]  # floor, like MaxPool2d(2)
    with pytest.raises(SpecError, match="at most 2"):
        model_spec_from_config({**DIGITS, "input_shape": [3, 7, 9], "channels": [2, 2, 2]})


@pytest.mark.parametrize("config", [DIGITS, MNIST], ids=["digits", "mnist"])
def test_layer_params_are_the_built_layers(config: dict[str, Any]) -> None:
    spec = model_spec_from_config(config)
    model = build_full_model(spec, seed=0)
    assert [sum(p.numel() for p in layer.parameters()) for layer in model] == spec.layer_params()


def test_layouts_chain_and_costs() -> None:
    spec = model_spec_from_config(DIGITS)
    assert spec.input_layout(0) == TensorLayout("float32", (64,))
    assert spec.output_layout(0) == spec.input_layout(1) == TensorLayout("float32", (8, 4, 4))
    assert spec.output_layout(1) == spec.input_layout(2) == TensorLayout("float32", (16, 2, 2))
    assert spec.output_layout(2) == TensorLayout("float32", (10,))
    assert spec.label_layout() == TensorLayout("int64", (), bound=10)
    assert spec.layer_params() == [1 * 9 * 8 + 8, 8 * 9 * 16 + 16, 64 * 10 + 10]
    assert spec.layer_flops_per_sample() == [2 * 1 * 9 * 8 * 64, 2 * 8 * 9 * 16 * 16, 2 * 64 * 10]
    mnist = model_spec_from_config(MNIST)
    for layer in range(mnist.num_layers - 1):
        assert mnist.output_layout(layer) == mnist.input_layout(layer + 1)


@pytest.mark.parametrize("config", [DIGITS, MNIST], ids=["digits", "mnist"])
def test_full_model_maps_flat_images_to_logits(config: dict[str, Any]) -> None:
    spec = model_spec_from_config(config)
    model = build_full_model(spec, seed=1)
    h = torch.randn(5, spec.input_layout(0).elements, generator=torch.Generator().manual_seed(0))
    for index, layer in enumerate(model):
        h = layer(h)
        assert h.dtype == torch.float32 and tuple(h.shape) == (5, *spec.output_layout(index).shape)
    assert h.shape == (5, 10) and (h < 0).any()  # logits are not clamped


def test_parameter_names_are_plain() -> None:
    names = [name for name, _ in named_global_parameters(build_full_model(model_spec_from_config(DIGITS), 0))]
    assert names == [
        "layers.0.conv.weight",
        "layers.0.conv.bias",
        "layers.1.conv.weight",
        "layers.1.conv.bias",
        "layers.2.linear.weight",
        "layers.2.linear.bias",
    ]


@pytest.mark.parametrize("config", [DIGITS, MNIST], ids=["digits", "mnist"])
def test_any_split_starts_from_the_full_models_weights(config: dict[str, Any]) -> None:
    spec = model_spec_from_config(config)
    torch.manual_seed(123)  # the global RNG must not matter
    full = dict(named_global_parameters(build_full_model(spec, seed=3)))
    for start in range(spec.num_layers):
        for end in range(start + 1, spec.num_layers + 1):
            torch.manual_seed(start * 10 + end)
            for name, param in named_global_parameters(build_layers(spec, start, end, seed=3)):
                assert torch.equal(param, full[name]), (start, end, name)
    other = dict(named_global_parameters(build_full_model(spec, seed=4)))
    assert not torch.equal(other["layers.0.conv.weight"], full["layers.0.conv.weight"])


def test_init_follows_torch_default_bounds() -> None:
    layer = build_layers(model_spec_from_config(MNIST), 1, 2, seed=0)[0]
    bound = 1 / (4 * 5 * 5) ** 0.5  # 1/sqrt(fan_in), like nn.Conv2d
    for tensor in (layer.conv.weight, layer.conv.bias):
        assert 0.9 * bound < tensor.abs().max() <= bound


def test_fit_fills_the_image_shape_and_classes() -> None:
    spec, model, dataset = fit_model_to_dataset({"type": "convnet", "channels": [4, 8]}, {"name": "digits"})
    assert model == {"type": "convnet", "channels": [4, 8], "input_shape": [1, 8, 8], "classes": 10}
    assert spec == model_spec_from_config(model) and dataset["name"] == "digits"
    same, _, _ = fit_model_to_dataset({**DIGITS, "channels": [4, 8]}, {"name": "digits"})
    assert same == spec


@pytest.mark.parametrize(
    ("model", "dataset", "field", "words"),
    [
        (
            {"type": "convnet"}, {"name": "text"}, "dataset_config.name",
            "a convnet trains on an image dataset (digits, MNIST)",
        ),
        ({"type": "convnet"}, {"name": "cifar"}, "dataset_config.name", "unknown dataset"),
        ({**DIGITS, "input_shape": [3, 8, 8]}, {"name": "digits"}, "model_config.input_shape", "leave it out"),
        ({"type": "convnet", "classes": 7}, {"name": "digits"}, "model_config.classes", "leave it out"),
        ({"type": "convnet", "channels": [2] * 4}, {"name": "digits"}, "model_config.channels", "too small"),
    ],
)
def test_fit_errors_name_the_field(model: dict[str, Any], dataset: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as error:
        fit_model_to_dataset(model, dataset)
    assert error.value.field == field
    assert words in error.value.message
