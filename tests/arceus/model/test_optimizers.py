"""The optimizer every process training a job's model builds (arceus.model.optimizers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from arceus.model.optimizers import load_saved_state, make_optimizer, saved_state


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


def test_8bit_adam_keeps_a_byte_an_element_and_steps_close_to_adam() -> None:
    """bitsandbytes' blockwise 8-bit Adam on a CPU: its moments are uint8 with a float32 scale per 256
    elements, and 20 steps of it stay within 2% of the weights' change under fp32 Adam."""
    torch.manual_seed(0)
    start = [torch.randn(64, 48), torch.randn(48)]
    eight = [nn.Parameter(p.clone()) for p in start]
    full = [nn.Parameter(p.clone()) for p in start]
    quantized, exact = make_optimizer(eight, "adam8bit", 1e-2), make_optimizer(full, "adam", 1e-2)
    for step in range(20):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(eight, full, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        quantized.step()
        exact.step()
    for a, b, p0 in zip(eight, full, start, strict=True):
        moved = (b.detach() - p0).norm()
        assert (a.detach() - b.detach()).norm() < 0.02 * moved
    saved = saved_state(quantized, eight[0])
    assert set(saved) == {"step", "state1", "state2", "absmax1", "absmax2"}
    assert saved["state1"].dtype == saved["state2"].dtype == torch.uint8
    assert saved["state1"].shape == eight[0].shape
    assert saved["absmax1"].shape == (64 * 48 // 256,) and saved["absmax1"].dtype == torch.float32
    assert saved["step"].dim() == 0 and saved["step"].item() == 20.0
    assert sum(t.numel() * t.element_size() for t in saved.values()) < 0.27 * 8 * eight[0].numel()  # vs fp32 m, v


def test_8bit_adam_state_loaded_into_a_fresh_optimizer_steps_identically() -> None:
    torch.manual_seed(1)
    first = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(7))]  # a partial block, a tiny one
    original = make_optimizer(first, "adam8bit", 1e-2)
    for p in first:
        p.grad = torch.randn_like(p)
    original.step()
    second = [nn.Parameter(p.detach().clone()) for p in first]
    resumed = make_optimizer(second, "adam8bit", 1e-2)
    for a, b in zip(first, second, strict=True):
        load_saved_state(resumed, b, saved_state(original, a))
    for _ in range(3):
        for a, b in zip(first, second, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        original.step()
        resumed.step()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
        for key, value in saved_state(original, a).items():
            assert torch.equal(value, saved_state(resumed, b)[key]), key


def test_loaded_state_is_a_copy_unless_the_caller_gives_its_tensors_away() -> None:
    param = nn.Parameter(torch.randn(5))
    optimizer = make_optimizer([param], "adam", 1e-2)
    given = {"exp_avg": torch.ones(5), "exp_avg_sq": torch.full((5,), 2.0), "step": torch.tensor(3.0)}
    load_saved_state(optimizer, param, given)
    assert all(optimizer.state[param][k].data_ptr() != t.data_ptr() for k, t in given.items())
    load_saved_state(optimizer, param, given, owned=True)  # already where torch keeps them: kept as they are
    assert all(optimizer.state[param][k] is t for k, t in given.items())
