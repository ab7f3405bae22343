"""The per-stage encoder for a job's `transfer` setting (`arceus.contracts.transfer`)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from arceus.contracts.transfer import TransferConfig
from arceus.wire.compression import Encoded, ErrorFeedback, encode


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
