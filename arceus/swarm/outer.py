"""Replicas that sync every H steps (arceus.contracts.replica_sync, DiLoCo): what a replica contributes to a sync
and what it does with the sum. Between syncs each replica's own optimizer steps its weights; at a sync the replicas
sum, in the exchange's one order, the vector `local_vector` returns (their weight deltas since the last sync and
their optimizer state and floating-point buffers), and every replica applies the mean the same way: the mean delta
as the negative gradient of an outer Nesterov SGD on the weights of the last sync, the mean optimizer state and
buffers in place of its own (BatchNorm's running statistics; an integer buffer, its batch count, moved alike on
every replica). Same bits in, same bits out: replicas leave every sync equal. Plain torch; the transport is the
caller's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from arceus.contracts.replica_sync import ReplicaSync
from arceus.model.expected_state import OPTIMIZER_STATE_KEYS

# Optimizer entries that are not shaped like their parameter (Adam's step count): every replica took the same
# number of steps, so they agree without being sent.
_SCALAR_KEYS = frozenset({"step"})


def sync_elements(num_parameter_elements: int, optimizer_kind: str, buffer_elements: int = 0) -> int:
    """The length of `local_vector` for a stage of that many parameter elements and that optimizer kind
    (`arceus.model.expected_state.optimizer_kind`): the deltas, each per-parameter optimizer entry and the elements
    of its floating-point buffers."""
    return num_parameter_elements * (1 + len(OPTIMIZER_STATE_KEYS[optimizer_kind] - _SCALAR_KEYS)) + buffer_elements


def synced_buffers(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers a sync averages: the floating-point ones."""
    return [b for b in buffers if b.is_floating_point()]


class OuterSync:
    """One replica's side of syncing every H steps: the weights of the last sync (the anchor) and the outer
    optimizer's momentum. Made when the replicas are equal (a stage's first train step after it was built)."""

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        inner: torch.optim.Optimizer,
        config: ReplicaSync,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        """`buffers`: the layers' buffers that training updates (arceus.model.buffers), the tensors themselves."""
        if config.exact:
            raise ValueError("replicas that sync every step exchange gradients, not weights: no outer optimizer")
        self.parameters = list(parameters)
        self.buffers = synced_buffers(buffers)
        self.inner = inner
        self.anchor = [p.detach().clone() for p in self.parameters]
        momentum = config.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def local_vector(self) -> torch.Tensor:
        """This replica's part of the sum, one float32 CPU vector: its weight deltas since the last sync in
        parameter order, then its optimizer's per-parameter entries (parameter by parameter, in key order), then its
        buffers."""
        deltas = [(p.detach() - a).reshape(-1) for p, a in zip(self.parameters, self.anchor, strict=True)]
        own = (s.reshape(-1) for s in (*self._state(), *self.buffers))
        return torch.cat([t.float().cpu() for t in (*deltas, *own)])

    def apply(self, summed: torch.Tensor, replicas: int) -> None:
        """Apply the members' sum of `local_vector`s (`replicas` of them): the outer step on the anchor, the
        weights set to it, the optimizer state and buffers to the members' mean. ValueError if `summed` is not that
        long."""
        state = self._state()
        expected = sum(a.numel() for a in self.anchor) + sum(s.numel() for s in (*state, *self.buffers))
        if summed.shape != (expected,) or replicas < 1:
            raise ValueError(f"a sum of {list(summed.shape)} from {replicas} replicas; this replica syncs {expected}")
        mean = summed / replicas
        offset = 0
        for anchor in self.anchor:
            part = mean[offset : offset + anchor.numel()].view_as(anchor)
            # DiLoCo's outer gradient: the anchor less the mean of the replicas' weights.
            anchor.grad = part.neg().to(anchor.device, anchor.dtype)
            offset += anchor.numel()
        self.outer.step()
        with torch.no_grad():
            for p, anchor in zip(self.parameters, self.anchor, strict=True):
                p.copy_(anchor)
                anchor.grad = None
            for s in state:
                s.copy_(mean[offset : offset + s.numel()].view_as(s))
                offset += s.numel()
        for b in self.buffers:  # through .data: autograd may hold them (arceus.model.buffers.BufferSteps.restore)
            b.data.copy_(mean[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    def _state(self) -> list[torch.Tensor]:
        """The inner optimizer's entries shaped like their parameters, in a fixed order."""
        entries = []
        for p in self.parameters:
            held = self.inner.state.get(p, {})
            entries.extend(
                held[key] for key in sorted(held) if key not in _SCALAR_KEYS and isinstance(held[key], torch.Tensor)
            )
        return entries
