"""A job's compute precision: fp32, or bf16 autocast (matmuls in bfloat16, weights, optimizer state,
reductions and everything sent between stages in float32). Torch-free: the context a stage computes in is
`arceus.model.autocast`."""

from __future__ import annotations

from typing import Any

from arceus.errors import SpecError

PRECISIONS = ("fp32", "bf16")
# bf16 keeps 8 bits of mantissa: two computations of one stage that differ only in summation order may
# disagree by a few bf16 rounding steps, so spot checks of bf16 jobs compare within this much.
BF16_TOLERANCE = 2e-2


def check_precision(value: Any, field: str) -> str:
    if value not in PRECISIONS:
        raise SpecError(field, f"must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value
