"""The digest a receipt signs of a tensor (`arceus.verify.receipts`)."""

from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 over dtype, shape and the C-order bytes of the tensor (independent of the wire encoding)."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed where it lies: no copy into bytes
    return h.digest()
