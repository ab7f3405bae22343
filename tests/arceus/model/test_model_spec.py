from __future__ import annotations

import pytest

from arceus.errors import SpecError
from arceus.model.mlp.spec import MLPSpec
from arceus.model.registry import model_spec_from_config


def test_mlp_spec_describes_its_layers() -> None:
    spec = model_spec_from_config({"type": "mlp", "layer_sizes": [64, 128, 64, 10]})
    assert spec == MLPSpec(layer_sizes=(64, 128, 64, 10), activation="relu")
    assert spec.num_layers == 3
    assert (spec.input_features, spec.output_features) == (64, 10)
    assert spec.layer_params() == [64 * 128 + 128, 128 * 64 + 64, 64 * 10 + 10]
    assert spec.layer_flops_per_sample() == [2 * 64 * 128, 2 * 128 * 64, 2 * 64 * 10]
    assert spec.layer_input_features() == [64, 128, 64]
    assert spec.layer_output_features() == [128, 64, 10]


def test_type_defaults_to_mlp_and_is_case_insensitive() -> None:
    assert model_spec_from_config({"layer_sizes": [2, 3]}).num_layers == 1
    assert (
        model_spec_from_config({"type": "MLP", "layer_sizes": [2, 3], "activation": "Tanh"}).activation
        == "tanh"
    )


@pytest.mark.parametrize(
    ("config", "field", "fragment"),
    [
        (
            {"type": "transformer", "layer_sizes": [2, 3]},
            "model_config.layer_sizes",
            "unknown key for a transformer",
        ),
        ({"type": "rnn", "layer_sizes": [2, 3]}, "model_config.type", "unknown model type 'rnn'"),
        ({"type": 3, "layer_sizes": [2, 3]}, "model_config.type", "supported: mlp"),
        ({}, "model_config.layer_sizes", "is required"),
        (
            {"layer_sizes": [64]},
            "model_config.layer_sizes",
            "needs at least 2 entries (input and output), got 1",
        ),
        ({"layer_sizes": "64,10"}, "model_config.layer_sizes", "must be a list of positive integers"),
        ({"layer_sizes": [64, 0]}, "model_config.layer_sizes[1]", "must be at least 1, got 0"),
        ({"layer_sizes": [64, -3]}, "model_config.layer_sizes[1]", "must be at least 1"),
        ({"layer_sizes": [True, 10]}, "model_config.layer_sizes[0]", "must be a positive integer, got True"),
        ({"layer_sizes": [64, 2.5]}, "model_config.layer_sizes[1]", "must be a positive integer"),
        ({"layer_sizes": [64, 1_000_001]}, "model_config.layer_sizes[1]", "must be at most 1,000,000"),
        ({"layer_sizes": [2, 3], "activation": "swish"}, "model_config.activation", "must be one of relu"),
        ({"layer_sizes": [2, 3], "dropout": 0.1}, "model_config.dropout", "unknown key"),
    ],
)
def test_invalid_configs_name_the_field_and_the_fix(config: dict, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        model_spec_from_config(config)
    assert info.value.field == field
    assert fragment in info.value.message
    assert isinstance(info.value, ValueError)


def test_non_object_config_is_rejected() -> None:
    with pytest.raises(SpecError, match="must be a JSON object"):
        model_spec_from_config([64, 10])
