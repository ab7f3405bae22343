"""Checkpoint files: named tensors as safetensors bytes, identified by their SHA-256.

safetensors holds only raw tensors and a JSON header, so loading a checkpoint can never run code
(unlike `torch.load` of a pickle): what a contributor's agent downloads is data and nothing else.
"""

from __future__ import annotations

import hashlib

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

# Names of optimizer-state entries start with this; the rest of a stage checkpoint are its weights.
OPTIMIZER_PREFIX = "optimizer."


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, or not the one that was asked for."""


def encode_checkpoint(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return save({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)


def checkpoint_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_checkpoint(data: bytes, *, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; with `sha256`, the bytes must hash to it first."""
    if sha256 is not None:
        actual = checkpoint_digest(data)
        if actual != sha256:
            raise CheckpointError(f"checkpoint content hash is {actual}, expected {sha256}: corrupt or replaced")
    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"not a valid safetensors checkpoint: {exc}") from exc
