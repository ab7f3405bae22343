"""Which device the agent computes on, and what it can do (reported to the control plane at register)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nodeagent.settings import DEVICE_TYPES


class DeviceError(RuntimeError):
    """The requested device does not exist on this machine."""


@dataclass(frozen=True)
class Capabilities:
    device_type: str
    device_name: str
    memory_bytes: int
    flops_fp32: float
    flops_fp16: float | None = None  # None: this device has no usable fp16 matmul
    flops_bf16: float | None = None
    runtime_bytes: int = 0  # what the agent holds before any stage: placement leaves it room

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def select_device(requested: str | None = None) -> torch.device:
    """`requested` if given (and available), else the best there is: cuda, then mps, then cpu."""
    if requested is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if requested not in DEVICE_TYPES:
        raise DeviceError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_TYPES)}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda was requested but torch sees no CUDA GPU (or this torch build has no CUDA)"
        )
    if requested == "mps" and not _mps_available():
        raise DeviceError(
            "--device mps was requested but Apple's Metal backend is not available on this machine"
        )
    return torch.device(requested)


def check_device_computes(device: torch.device) -> None:
    """A small forward and backward on `device`, checked against the CPU's: a GPU torch sees but cannot run
    (a compute capability this build has no kernels for, a broken driver) is refused before the agent
    registers, with torch's reason, rather than failing the first stage it is given."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
    try:
        x = a.to(device).requires_grad_()
        (x @ b.to(device)).square().sum().backward()
        synchronize(device)
        grad = x.grad.cpu() if x.grad is not None else None
    except (RuntimeError, AssertionError) as exc:
        raise DeviceError(f"torch cannot compute on {device} ({device_name(device)}): {exc}") from exc
    expected = 2 * (a @ b) @ b.T
    if grad is None or not torch.allclose(grad, expected, rtol=1e-3, atol=1e-3):
        raise DeviceError(f"{device} ({device_name(device)}) computed a wrong gradient in a 64x64 check")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return _cpu_model() or platform.processor() or platform.machine() or "cpu"


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def memory_used_bytes(device: torch.device) -> int:
    """Tensor memory on a GPU; this process's resident set size on CPU (and MPS, which shares RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return memory_peak_bytes()  # a peak, not current, but all macOS offers without psutil


def memory_peak_bytes() -> int:
    """This process's peak resident set so far (Linux's VmHWM; ru_maxrss is in KiB there, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)


def device_memory_peak_bytes(device: torch.device) -> int:
    """The most tensor memory a GPU has held since the process started; the peak resident set on CPU (and MPS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return memory_peak_bytes()


def memory_summary(device: torch.device) -> str:
    """The process's memory now and at its peak, for the log (what an owner's budget is about)."""
    return f"memory {memory_used_bytes(device) / 2**20:.0f} MiB, peak {memory_peak_bytes() / 2**20:.0f} MiB"


def measure_matmul_flops(
    device: torch.device, budget_seconds: float = 0.2, size: int = 256, dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of repeated size×size `dtype` matmuls for about `budget_seconds` (a rough, relative figure)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device, dtype)
    b = torch.randn(size, size, generator=generator).to(device, dtype)
    synchronize(device)
    torch.mm(a, b)  # warm-up: first-call dispatch and allocation are not compute
    synchronize(device)
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= budget_seconds:
            return 2.0 * size**3 * runs / elapsed


def capabilities(device: torch.device, *, declared_flops: float | None = None) -> Capabilities:
    """What the agent reports at registration; `declared_flops` (the owner's --declare-flops) replaces
    the measured matmul rate."""
    return Capabilities(
        device_type=device.type,
        device_name=device_name(device),
        memory_bytes=total_memory_bytes(device),
        flops_fp32=declared_flops if declared_flops is not None else measure_matmul_flops(device),
        flops_fp16=_low_precision_flops(device, torch.float16),
        flops_bf16=_low_precision_flops(device, torch.bfloat16),
        runtime_bytes=memory_used_bytes(device),
    )


def _low_precision_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The matmul rate in `dtype`, or None where the device or this torch build cannot multiply in it."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return None
    try:
        return measure_matmul_flops(device, budget_seconds=0.1, dtype=dtype)
    except (RuntimeError, TypeError):  # "not implemented for 'Half'" and the like
        return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels: a GPU runs them asynchronously, so a clock read before this
    times the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _cpu_model() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None
