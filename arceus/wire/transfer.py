"""A job's `transfer` setting (how activations and gradients travel) and the per-stage encoder for it.

    {"activations": "int8", "gradients": "topk", "block_size": 64, "topk_ratio": 0.1}

Every field is optional; `{}` (the default) sends fp32, byte for byte the uncompressed path.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from arceus.errors import SpecError
from arceus.wire.compression import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    Encoded,
    ErrorFeedback,
    encode,
)

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


class TransferEncoder:
    """Encodes one stage's outgoing tensors per its job's TransferConfig.

    Top-k gradients keep an ErrorFeedback residual per stream (e.g. per micro-batch slot), so what one
    step drops is added to the next step's gradient of the same slot. Used by one step at a time.
    """

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._feedback: dict[Hashable, ErrorFeedback] = {}

    def encode(self, tensor: torch.Tensor, *, gradient: bool, stream: Hashable) -> Encoded:
        c = self.config
        encoding = c.gradients if gradient else c.activations
        if encoding == "topk":
            feedback = self._feedback.setdefault(stream, ErrorFeedback())
            return feedback.encode(tensor, encoding, block_size=c.block_size, topk_ratio=c.topk_ratio)
        return encode(tensor, encoding, block_size=c.block_size, topk_ratio=c.topk_ratio)
