"""The optimizer every process training a job's model builds (arceus.model.optimizers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from arceus.model.optimizers import make_optimizer


def _params(device: str = "cpu") -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3, device=device)), nn.Parameter(torch.randn(3, device=device))]


def test_adam_on_a_cpu_runs_the_fused_kernel_and_steps_like_the_default_one() -> None:
    fused_params = _params()
    default_params = [nn.Parameter(p.detach().clone()) for p in fused_params]
    fused = make_optimizer(fused_params, "adam", 1e-2, weight_decay=0.01)
    default = torch.optim.Adam(default_params, lr=1e-2, weight_decay=0.01)
    assert fused.defaults["fused"] is True
    for step in range(5):
        for params in (fused_params, default_params):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (step + 1))
        fused.step()
        default.step()
    for a, b in zip(fused_params, default_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert set(fused.state[fused_params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_adam_on_a_device_without_a_fused_kernel_uses_the_default_one() -> None:
    assert not make_optimizer(_params("meta"), "adam", 1e-3).defaults["fused"]


def test_sgd_keeps_its_momentum_and_weight_decay() -> None:
    sgd = make_optimizer(_params(), "sgd", 0.1, momentum=0.9, weight_decay=0.01)
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.9, 0.01)


def test_an_unknown_optimizer_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        make_optimizer(_params(), "lamb", 1e-3)
