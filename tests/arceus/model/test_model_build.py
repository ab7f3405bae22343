from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.mlp.spec import MLPSpec

SPEC = MLPSpec(layer_sizes=(64, 128, 64, 10))


def test_any_split_starts_from_the_full_models_weights() -> None:
    full = dict(named_global_parameters(build_full_model(SPEC, seed=3)))
    for cuts in ([0, 1, 2, 3], [0, 2, 3], [0, 1, 3]):
        parts: dict[str, torch.Tensor] = {}
        for start, end in zip(cuts, cuts[1:], strict=False):
            parts.update(named_global_parameters(build_layers(SPEC, start, end, seed=3)))
        assert sorted(parts) == sorted(full)
        for name, param in full.items():
            assert torch.equal(parts[name], param), name


def test_weights_depend_on_the_seed_only() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    a = build_full_model(SPEC, seed=1)
    torch.manual_seed(456)
    b = build_full_model(SPEC, seed=1)
    c = build_full_model(SPEC, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0].weight, c[0].weight)
    assert not torch.equal(a[0].weight[:, :64], a[2].weight[:, :64])  # layers differ from each other


def test_split_forward_equals_full_forward() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    full = build_full_model(SPEC, seed=0)
    split = [build_layers(SPEC, 0, 1, 0), build_layers(SPEC, 1, 3, 0)]
    torch.testing.assert_close(split[1](split[0](x)), full(x), rtol=0, atol=0)


def test_relu_after_every_layer_but_the_last() -> None:
    model = build_full_model(SPEC, seed=0)
    assert [layer.activation for layer in model] == ["relu", "relu", None]
    out = model(torch.randn(50, 64))
    assert (out < 0).any()  # logits are not clamped
    assert (build_layers(SPEC, 0, 1, 0)(torch.randn(50, 64)) >= 0).all()


def test_init_follows_nn_linear_default_bounds() -> None:
    layer = build_layers(MLPSpec((400, 300)), 0, 1, seed=0)[0]
    bound = 1 / 400**0.5
    for tensor in (layer.weight, layer.bias):
        assert tensor.abs().max() <= bound
        assert tensor.abs().max() > 0.9 * bound  # uniform over the whole range, like nn.Linear
    reference = nn.Linear(400, 300)
    assert layer.weight.std().item() == pytest.approx(reference.weight.std().item(), rel=0.05)


def test_global_parameter_names() -> None:
    names = [name for name, _ in named_global_parameters(build_layers(SPEC, 1, 3, seed=0))]
    assert names == ["layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias"]


@pytest.mark.parametrize(("start", "end"), [(0, 0), (2, 1), (0, 4), (-1, 2)])
def test_invalid_layer_range(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="layer range"):
        build_layers(SPEC, start, end, seed=0)


def test_an_agent_loads_torch_export_only_for_an_exported_model() -> None:
    """sympy and torch.export's serializer double a (re)joining agent's start-up CPU; an MLP's stage needs neither."""
    probe = (
        "import sys; from arceus.model.build import build_layers; from arceus.model.mlp.spec import MLPSpec; "
        "import nodeagent.agent; build_layers(MLPSpec(layer_sizes=(4, 3, 2)), 0, 2, seed=0); "
        "print(sorted(m for m in ('sympy', 'torch._export.serde.serialize') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
