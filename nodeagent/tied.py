"""A stage's part in keeping tied weights equal (arceus.model.tied): each train step, once its own gradients are
final (after its replica exchange, where it has one), it pushes the gradient of each tied copy it holds to every rank
of the other stages holding a copy of the same weight (TIED_GRADIENT pushes on its own links; `micro_batch` names
the copy by its index among the model's copies), takes theirs from its mailbox, and steps every copy it holds with
its group's sum, added in the group's one order (arceus.model.tied.tied_sum): every copy on every stage steps with
the same bits. The gradients travel exactly (fp32 bytes), whatever the job's transfer setting. A stage that holds
every copy of a group sums them here without a push. Only rank 0 of a tensor-parallel stage sends (its ranks hold
the same replicated copies); every rank takes the sum."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import torch

from arceus.contracts.assignment import Assignment
from arceus.model.spec import ModelSpec, split_global_param_name
from arceus.model.tied import TiedGroup, tied_groups, tied_sum
from arceus.wire import codec
from arceus.wire.compression import Encoded, encode
from arceus.wire.incoming_push import IncomingPush
from arceus.wire.proto_tensor import decode_tensor
from nodeagent.rpc import RpcFailure


class TiedGradients:
    """What a stage sends, expects and sums of the tied weights' gradients; `links` are made by the stage (its
    links to each sharing stage's ranks, by stage index)."""

    def __init__(self, assignment: Assignment, spec: ModelSpec) -> None:
        start, end = assignment.layer_start, assignment.layer_end
        groups = tied_groups(spec)
        self.copies = tuple(m for g in groups for m in g.members)  # a copy's index here names it on the wire
        self.groups: tuple[TiedGroup, ...] = tuple(g for g in groups if g.held(start, end))
        held = {m for g in self.groups for m in g.held(start, end)}
        self.held = tuple(m for m in self.copies if m in held)
        # Each copy held elsewhere that this stage needs: its index and shape.
        self.expected = {self.copies.index(m): _shape(spec, m) for g in self.groups for m in g.members if m not in held}
        # Where each held copy goes: the sharing stages holding another copy of its group.
        self.destinations = {
            m: tuple(peer.stage_index for peer in assignment.tied
                     if any(g.held(peer.layer_start, peer.layer_end) for g in self.groups if m in g.members))
            for m in self.held
        }
        holders = {m for peer in assignment.tied for g in self.groups for m in g.held(peer.layer_start, peer.layer_end)}
        if missing := sorted(set(self.copies[i] for i in self.expected) - holders):
            raise ValueError(f"{assignment.stage_id} needs the gradient of tied copy {missing[0]}, which no stage "
                             "its assignment names holds")

    def __bool__(self) -> bool:
        return bool(self.groups)

    def mailbox_slots(self) -> int:
        """The pushes a step of this stage takes (its mailbox holds them beside the micro-batches')."""
        return len(self.expected)

    def decode(self, push: IncomingPush) -> torch.Tensor:
        """A TIED_GRADIENT push checked (a copy this stage expects, its exact shape, fp32 bytes) and decoded;
        INVALID_ARGUMENT otherwise."""
        header = push.header
        shape = self.expected.get(header.micro_batch)
        if shape is None:
            raise _invalid(f"expects no tied gradient {header.micro_batch} (it expects {sorted(self.expected)})")
        tensor = header.tensor
        if header.step < 0 or tensor.dtype != "float32" or tensor.encoding not in ("", "fp32") or tuple(
            tensor.shape
        ) != shape:
            raise _invalid(f"tied gradient {header.micro_batch} must be float32 {list(shape)} as is (uncompressed), "
                           f"got {tensor.dtype} {list(tensor.shape)} encoded {tensor.encoding!r}")
        try:
            return decode_tensor(tensor, push.data, push.scales, push.indices, max_bytes=4 * math.prod(shape))
        except codec.TensorValidationError as exc:
            raise _invalid(f"tied gradient rejected: {exc}") from exc

    def send(self, gradient: Callable[[str], torch.Tensor], push: Callable[[int, int, Encoded], None]) -> None:
        """Push each held copy's gradient (`gradient(name)`) to its destinations: `push(stage index, copy index,
        encoded)`."""
        for name in self.held:
            if self.destinations[name]:
                encoded = encode(gradient(name), "fp32")
                for stage_index in self.destinations[name]:
                    push(stage_index, self.copies.index(name), encoded)

    def sum(self, gradient: Callable[[str], torch.Tensor], received: Callable[[int], torch.Tensor],
            set_gradient: Callable[[str, torch.Tensor], None]) -> None:
        """Set each held copy's gradient to its group's sum: held copies' from `gradient`, the others' as
        `received(copy index)` gives them (waiting for them)."""
        for group in self.groups:
            parts = [gradient(m) if m in self.held else received(self.copies.index(m)) for m in group.members]
            total = tied_sum(parts)
            for name in group.members:
                if name in self.held:
                    set_gradient(name, total.clone())


def _shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    layer, rest = split_global_param_name(name)
    return tuple(spec.layer_parameters(layer)[rest])


def _invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)

