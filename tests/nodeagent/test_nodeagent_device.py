from __future__ import annotations

import time

import pytest
import torch

from nodeagent.device import (
    DeviceError,
    capabilities,
    check_device_computes,
    device_memory_peak_bytes,
    measure_matmul_flops,
    memory_used_bytes,
    select_device,
    total_memory_bytes,
)


def test_cpu_is_always_available() -> None:
    assert select_device("cpu") == torch.device("cpu")
    assert select_device(None).type in ("cuda", "mps", "cpu")


def test_cuda_request_matches_availability() -> None:
    if torch.cuda.is_available():
        assert select_device("cuda").type == "cuda"
    else:
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            select_device("cuda")


def test_mps_request_matches_availability() -> None:
    if torch.backends.mps.is_available():
        assert select_device("mps").type == "mps"
    else:
        with pytest.raises(DeviceError, match="Metal backend is not available"):
            select_device("mps")


def test_a_device_torch_sees_but_cannot_compute_on_is_refused_with_torchs_reason() -> None:
    check_device_computes(torch.device("cpu"))  # computes, and the gradient is right
    # The meta device stands in for a GPU without kernels for this build: tensors exist, no data comes back.
    with pytest.raises(DeviceError, match=r"torch cannot compute on meta .*Cannot copy out of meta tensor"):
        check_device_computes(torch.device("meta"))


def test_unknown_device() -> None:
    with pytest.raises(DeviceError, match="choose one of cuda, mps, cpu"):
        select_device("tpu")


def test_cpu_capabilities_are_plausible() -> None:
    cpu = torch.device("cpu")
    assert total_memory_bytes(cpu) > 100 * 2**20
    assert 0 < memory_used_bytes(cpu) < total_memory_bytes(cpu)
    assert 0 < device_memory_peak_bytes(cpu) < total_memory_bytes(cpu)
    started = time.perf_counter()
    flops = measure_matmul_flops(cpu, budget_seconds=0.1)
    assert time.perf_counter() - started < 0.5
    assert 1e7 < flops < 1e15
    caps = capabilities(cpu).to_json()
    assert set(caps) == {
        "device_type", "device_name", "memory_bytes", "flops_fp32", "flops_fp16", "flops_bf16", "runtime_bytes"
    }
    # What this process holds already (Python, torch): placement leaves it room.
    assert 50 * 2**20 < caps["runtime_bytes"] < caps["memory_bytes"]
    # torch's CPU build multiplies in half and bfloat16, so both are measured (never left null on CPU).
    assert 1e6 < caps["flops_fp16"] < 1e15 and 1e6 < caps["flops_bf16"] < 1e15
    assert caps["device_type"] == "cpu" and caps["device_name"]
