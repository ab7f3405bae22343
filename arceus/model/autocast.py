"""The context a stage's forward (and loss) computes in for its job's precision (`arceus.model.precision`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """bf16: matmuls in bfloat16 (autograd replays the context in the backward); fp32: nothing changes."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()
