"""A model's buffers that training updates (BatchNorm's running statistics and batch count), and what one step
does to them, however its micro-batches are spread over stages and replicas.

Which buffers: every persistent buffer of the layers (a torch module's `register_buffer(..., persistent=True)`,
an exported graph's persistent buffers); non-persistent ones are constants. Of the architectures today only
exported models have any (a captured BatchNorm's).

What one step does, defined so that it does not depend on which replica ran which micro-batch, nor in which order,
nor on a recompute: every micro-batch's forward starts from the buffers as the step found them, and the step
leaves them at that value plus the mean over the step's micro-batches of each forward's change. For BatchNorm
(momentum m) that is running_mean' = (1 - m) running_mean + m * (mean of the micro-batches' batch means): with
equal micro-batches, what one forward over the whole batch gives; running_var takes the mean of the micro-batches'
(unbiased) variances; num_batches_tracked goes up by 1 a step. An integer buffer moves by the floor of the mean.
The changes are summed like gradients, so replicas exchange them with their gradients (`vector`) and leave the step
with the same bits; one process running the same micro-batches computes the same (`devtools.reference`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module`'s persistent buffers, by name, in `named_buffers` order."""
    found = []
    for owner_name, owner in module.named_modules():
        for leaf, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and leaf not in owner._non_persistent_buffers_set:
                found.append((f"{owner_name}.{leaf}" if owner_name else leaf, buffer))
    return found


class BufferSteps:
    """The persistent buffers of `module` and the step in progress: the value the step started from, and the sum
    of the changes and number of the micro-batches forwarded in it so far."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.names: list[str] = []
        self.start: list[torch.Tensor] = []
        self.sums = torch.zeros(0)
        self.count = 0
        self.rebind()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self._buffers

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers by their names in the module."""
        return list(zip(self.names, self._buffers, strict=True))

    @property
    def elements(self) -> int:
        """Elements of `vector`: every buffer's, and the count; 0 without buffers."""
        n = int(self.sums.numel())
        return n + 1 if n else 0

    def rebind(self) -> None:
        """Take the module's buffers (again: after a move to a device) as the step's start, with nothing summed."""
        named = persistent_buffers(self.module)
        self.names = [name for name, _ in named]
        self._buffers = [b for _, b in named]
        self.start = [b.detach().clone() for b in self._buffers]
        self.sums = torch.zeros(sum(b.numel() for b in self._buffers), dtype=torch.float32)
        self.count = 0

    def forwarded(self) -> None:
        """After one micro-batch's training forward: add its change to the sums and put the buffers back."""
        if not self._buffers:
            return
        pairs = zip(self._buffers, self.start, strict=True)
        changes = torch.cat([(b.detach() - s).reshape(-1).float().cpu() for b, s in pairs])
        self.sums += changes
        self.count += 1
        self.restore()

    def restore(self) -> None:
        """The buffers back at the step's start (after anything else that ran the layers: a recompute in the
        backward, an evaluation, a decode). Through `.data`: autograd saved the buffers the forwards passed to
        BatchNorm (its backward in training reads the batch's statistics, not these), and an in-place write it
        sees would fail that backward."""
        for b, s in zip(self._buffers, self.start, strict=True):
            b.data.copy_(s)

    def vector(self) -> torch.Tensor:
        """The sums then the count, one float32 vector (empty without buffers): what replicas add up."""
        if not self._buffers:
            return torch.zeros(0)
        return torch.cat([self.sums, torch.tensor([float(self.count)])])

    def set_vector(self, flat: torch.Tensor) -> None:
        """Replace the sums and the count with `flat` (`vector`'s layout): every replica's, added up."""
        if flat.shape != (self.elements,):
            raise ValueError(f"a buffer vector of shape {list(flat.shape)} for {self.elements} elements")
        if not self._buffers:
            return
        count = float(flat[-1])
        if count != round(count) or count < 0:
            raise ValueError(f"the micro-batch count of a buffer vector must be a whole number, got {count}")
        self.sums = flat[:-1].clone()
        self.count = int(count)

    def apply(self) -> None:
        """End the step: each buffer at its start plus the mean change (nothing changes when no micro-batch
        was forwarded), which is then the next step's start."""
        if self._buffers and self.count:
            offset = 0
            for b, s in zip(self._buffers, self.start, strict=True):
                total = self.sums[offset : offset + b.numel()].view(b.shape).to(b.device)
                offset += b.numel()
                if b.dtype.is_floating_point:
                    s.add_((total / self.count).to(b.dtype))
                else:
                    s.add_(torch.div(total.round().to(torch.int64), self.count, rounding_mode="floor"))
        self.discard()

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Inside: the step's sums and count set aside and the buffers at the step's start, so forwards run again
        (a sibling's micro-batches recomputed for an audit) sum changes of their own into `vector`; after: the
        step's sums and count back, and the buffers at its start."""
        sums, count = self.sums, self.count
        self.sums, self.count = torch.zeros_like(sums), 0
        self.restore()
        try:
            yield
        finally:
            self.sums, self.count = sums, count
            self.restore()

    def discard(self) -> None:
        """Forget the step's changes: the buffers stay as it found them."""
        self.sums.zero_()
        self.count = 0
        self.restore()
