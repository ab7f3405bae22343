"""The OpenMP spin of an agent process, set before torch loads libgomp (which reads it once).

Stages that share a machine hand cores to each other several times a step (nodeagent.lending); after a
parallel region an idle OpenMP thread spins for GOMP_SPINCOUNT iterations (300k by default when
OMP_WAIT_POLICY is unset: milliseconds) on the core a neighbouring stage has just taken back. 10k keeps the
wake-up between one action's regions fast and frees the core in well under a millisecond
(bench/pipeline_vs_torch.py). Imports nothing that loads torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = "10000"


def cap_openmp_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set GOMP_SPINCOUNT unless the operator chose how OpenMP threads wait (GOMP_SPINCOUNT or
    OMP_WAIT_POLICY set: libgomp would let our spin count override their policy). True if it was set."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def describe_openmp_spin(environ: Mapping[str, str] = os.environ) -> str:
    """The spin count this process runs with, for its start-up log line."""
    if "GOMP_SPINCOUNT" in environ:
        return environ["GOMP_SPINCOUNT"]
    if "OMP_WAIT_POLICY" in environ:
        return f"as OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']} sets it"
    return "libgomp's default"
