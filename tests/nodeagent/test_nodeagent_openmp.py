"""cap_openmp_spin: the agent's spin count unless the operator chose how OpenMP threads wait, set where
torch has not loaded libgomp yet."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nodeagent.openmp import SPIN_COUNT, cap_openmp_spin


def test_the_spin_is_capped_when_nobody_chose() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert cap_openmp_spin(environ)
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": SPIN_COUNT}


@pytest.mark.parametrize("chosen", [{"GOMP_SPINCOUNT": "250k"}, {"OMP_WAIT_POLICY": "passive"}])
def test_an_operators_choice_is_kept(chosen: dict[str, str]) -> None:
    environ = dict(chosen)
    assert not cap_openmp_spin(environ)
    assert environ == chosen  # GOMP_SPINCOUNT would override OMP_WAIT_POLICY in libgomp


def test_the_entry_point_sets_it_before_anything_loads_torch() -> None:
    """`python -m nodeagent` imports nodeagent and nodeagent.openmp first: neither may import torch, or
    libgomp would have read its settings already."""
    check = "import sys, nodeagent, nodeagent.openmp; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
