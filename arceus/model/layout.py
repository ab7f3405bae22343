"""What one sample's tensor looks like at a stage boundary: dtype, shape and, for ids, their range.

Torch-free, so the control plane (placement memory, message sizes) and the agents' input checks read
the same description the model spec gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "int64": 8}


@dataclass(frozen=True)
class TensorLayout:
    dtype: str  # a wire dtype name ("float32", "int64")
    shape: tuple[int, ...]  # per sample: the batch dimension is not included
    bound: int | None = None  # integer tensors hold ids in [0, bound)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one sample's tensor."""
        return self.elements * ITEMSIZE[self.dtype]

    def batch_shape(self) -> str:
        """The shape of a batch of these, "[batch, 16]", for error messages."""
        return "[" + ", ".join(["batch", *map(str, self.shape)]) + "]"
