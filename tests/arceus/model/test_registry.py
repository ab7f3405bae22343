"""The registry (torch-free) and the torch layers beside it (`arceus.model.build.LAYERS`) name the same
architectures, and what the contracts and the control plane validate with loads neither torch nor gRPC."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arceus.errors import SpecError
from arceus.model.build import LAYERS
from arceus.model.registry import ARCHITECTURES, check_tensor_parallel, model_spec_from_config, reduced_layout

GPT = {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16, "vocab_size": 40}


def test_every_architecture_has_torch_layers_and_splits_only_where_it_has_split_layers() -> None:
    assert list(LAYERS) == list(ARCHITECTURES)
    for kind, architecture in ARCHITECTURES.items():
        assert (architecture.tensor_parallel is None) == (LAYERS[kind].tensor_parallel is None), kind


def test_a_split_is_checked_without_torch_layers() -> None:
    spec = model_spec_from_config(GPT)
    check_tensor_parallel(spec, 2)
    assert reduced_layout(spec).shape == (16, 32)
    with pytest.raises(SpecError) as raised:
        check_tensor_parallel(spec, 3)
    assert raised.value.field == "tensor_parallel.size" and "use one of 2, 4" in raised.value.message
    with pytest.raises(SpecError) as raised:
        check_tensor_parallel(model_spec_from_config({"type": "mlp", "layer_sizes": [4, 8, 2]}), 2)
    assert raised.value.field == "tensor_parallel" and '"transformer" or "llama"' in raised.value.message


@pytest.mark.parametrize(
    "module", ["arceus.contracts.assignment", "arceus.model.registry", "arceus.placement.profiles"]
)
def test_validating_a_model_or_an_assignment_loads_neither_torch_nor_grpc(module: str) -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print(sorted({{'torch', 'grpc'}} & set(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    assert loaded == "[]"
