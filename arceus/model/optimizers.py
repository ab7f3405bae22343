"""The optimizer that trains a job's parameters, built from the job's settings: one home, so that every
process training a job's model (each stage's agent, the single-process reference) steps identically.

Adam runs torch's fused kernel on the devices torch has one for (CPU, CUDA): one pass over each
parameter's memory instead of a dozen elementwise passes (on a CPU about a fifth of the default
implementation's time: docs/BENCHMARKS.md, "Where the pipeline's step time goes").

"adam8bit" is bitsandbytes' blockwise 8-bit Adam (Dettmers et al. 2022), which has a CPU backend: both
moments kept as one byte per element with a float32 scale per block of
`arceus.model.expected_state.ADAM8BIT_BLOCK` elements, the update
computed in float32. Training state is 10 bytes a parameter instead of fp32 Adam's 16 (weights and gradients
stay float32). Every parameter, however small, is quantized (`min_8bit_size=0`), so its state has one layout
(`arceus.model.expected_state.optimizer_entry_layout`). Its step on a CPU is slower than fused Adam.

bf16 weights with float32 master copies are not offered: on a CPU they save nothing (a bfloat16 weight and
gradient plus a float32 master copy are the 8 bytes a float32 weight and gradient are) while making every
step cast the weights; bf16 Adam moments are not offered either: a second moment's update with beta2 0.999 is
a thousandth of it, below bfloat16's half-ulp (1/512), so rounding to nearest would freeze it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

FUSED_ADAM_DEVICES = frozenset({"cpu", "cuda"})
# What each optimizer keeps of its own per parameter but does not save: bitsandbytes' quantization maps,
# the same constants for every parameter, rebuilt by the optimizer (the entry names the map it holds).
_ADAM8BIT_MAPS = {"qmap1": "dynamic", "qmap2": "udynamic"}


def make_optimizer(
    params: Sequence[nn.Parameter], name: str, lr: float, *, momentum: float = 0.0, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """`name` "sgd", "adam" or "adam8bit"; ValueError for any other. The parameters must share one device."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        devices = {p.device.type for p in params}
        fused = len(devices) == 1 and devices <= FUSED_ADAM_DEVICES
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=fused)
    if name == "adam8bit":
        import bitsandbytes  # only jobs that ask for it pay for its import

        return bitsandbytes.optim.Adam8bit(params, lr=lr, weight_decay=weight_decay, min_8bit_size=0)
    raise ValueError(f"unknown optimizer {name!r}")


def saved_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """The state `optimizer` keeps for `param` as the tensors a checkpoint holds (`OPTIMIZER_STATE_KEYS`):
    the tensors themselves, except bitsandbytes' step, an int, as a float32 scalar like torch's."""
    held = optimizer.state.get(param, {})
    return {
        key: value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        for key, value in held.items()
        if key not in _ADAM8BIT_MAPS and (isinstance(value, torch.Tensor) or key == "step")
    }


def load_saved_state(
    optimizer: torch.optim.Optimizer,
    param: nn.Parameter,
    entries: Mapping[str, torch.Tensor],
    *,
    owned: bool = False,
) -> None:
    """Set `param`'s state in `optimizer` to `entries` (`saved_state`'s form), each copied beside its parameter
    (Adam's step on the CPU unless fused or capturable, as torch keeps it). `owned`: the entries are the caller's
    to give away (read for this call alone), so one already where torch keeps it is kept, not copied."""
    state = optimizer.state[param]
    is_8bit = hasattr(optimizer, "name2qmap")
    for key, value in entries.items():
        if key == "step" and is_8bit:
            state[key] = int(value.item())
            continue
        beside = value.dim() or optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
        state[key] = value.to(param.device if beside else value.device, copy=not owned)
    if is_8bit and entries:
        if not optimizer.name2qmap:
            optimizer.fill_qmap()
        for key, name in _ADAM8BIT_MAPS.items():
            state[key] = optimizer.name2qmap[name].to(param.device)
