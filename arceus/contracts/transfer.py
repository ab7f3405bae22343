"""A job's `transfer` setting: how activations and gradients travel between stages (encoded by
`arceus.wire.transfer`).

    {"activations": "int8", "gradients": "topk", "block_size": 64, "topk_ratio": 0.1}

Every field is optional; `{}` (the default) sends fp32, byte for byte the uncompressed path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arceus.errors import SpecError

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20  # int8: values per absmax scale
ACTIVATION_ENCODINGS = ("fp32", "fp16", "bf16", "int8")  # top-k would drop most of each sample's features
GRADIENT_ENCODINGS = ("fp32", "fp16", "bf16", "int8", "topk")
_FIELDS = ("activations", "gradients", "block_size", "topk_ratio")


@dataclass(frozen=True)
class TransferConfig:
    activations: str = "fp32"
    gradients: str = "fp32"
    block_size: int = 64  # int8: values per absmax scale
    topk_ratio: float = 0.1  # topk: share of gradient values sent per message

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


def transfer_config_from_json(value: Any, *, field: str = "transfer") -> TransferConfig:
    """Parse and validate; raises SpecError with a field like "transfer.block_size"."""
    if value is None:
        return TransferConfig()
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", f"unknown field; known: {', '.join(_FIELDS)}")
    defaults = TransferConfig()
    activations = value.get("activations", defaults.activations)
    if activations not in ACTIVATION_ENCODINGS:
        raise SpecError(
            f"{field}.activations", f"must be one of {', '.join(ACTIVATION_ENCODINGS)}, got {activations!r}"
        )
    gradients = value.get("gradients", defaults.gradients)
    if gradients not in GRADIENT_ENCODINGS:
        raise SpecError(f"{field}.gradients", f"must be one of {', '.join(GRADIENT_ENCODINGS)}, got {gradients!r}")
    block_size = value.get("block_size", defaults.block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
        MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    ):
        raise SpecError(
            f"{field}.block_size", f"must be an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )
    ratio = value.get("topk_ratio", defaults.topk_ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise SpecError(f"{field}.topk_ratio", f"must be a number in (0, 1], got {ratio!r}")
    return TransferConfig(activations, gradients, block_size, float(ratio))
