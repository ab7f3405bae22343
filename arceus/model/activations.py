"""The activations a model config may name (torch-free: specs validate with it)."""

from __future__ import annotations

from typing import Any

from arceus.errors import SpecError

ACTIVATIONS = ("relu", "gelu", "tanh")
# Whether the activation keeps its output for the backward (else its input, a tensor of the same size).
KEEPS_OUTPUT = {"relu": True, "gelu": False, "tanh": True}


def activation_from_config(config: dict[str, Any], default: str = "relu") -> str:
    """`model_config.activation`, lower-cased; SpecError naming the field otherwise."""
    activation = config.get("activation", default)
    if not isinstance(activation, str) or activation.lower() not in ACTIVATIONS:
        raise SpecError("model_config.activation", f"must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    return activation.lower()
