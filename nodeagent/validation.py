"""Checks on what arrives over the network, done before any of it reaches the stage's model.

Every failure is an RpcFailure(INVALID_ARGUMENT) whose message says what was expected.
"""

from __future__ import annotations

import math

import grpc
import torch

from arceus.model.layout import TensorLayout
from arceus.pipeline.schedule import SCHEDULES, peak_in_flight
from arceus.v1 import stage_pb2
from arceus.wire import codec
from arceus.wire.incoming_push import IncomingPush
from arceus.wire.proto_tensor import decode_tensor
from nodeagent.rpc import RpcFailure
from nodeagent.stage_io import StageIO

KIND_NAMES = {
    stage_pb2.ACTIVATION: "ACTIVATION", stage_pb2.GRADIENT: "GRADIENT", stage_pb2.LABELS: "LABELS",
    stage_pb2.TIED_GRADIENT: "TIED_GRADIENT",  # checked by the stage's TiedGradients (nodeagent.tied)
}


def _invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)


def expected_layout(io: StageIO, kind: int) -> TensorLayout:
    """The per-sample layout a tensor of `kind` must have for this stage (after its batch dimension)."""
    if kind == stage_pb2.ACTIVATION:
        return io.input_layout
    if kind == stage_pb2.GRADIENT:
        if io.is_last:
            raise _invalid("the last stage computes its own loss gradient; it accepts no GRADIENT")
        return io.output_layout
    if kind == stage_pb2.LABELS:
        if not io.is_last:
            raise _invalid("only the last stage accepts LABELS")
        return io.label_layout
    raise _invalid(f"tensor kind {kind} is not one of {', '.join(KIND_NAMES.values())}")


def check_layout(what: str, message: stage_pb2.Tensor, expected: TensorLayout, max_micro_batch_size: int) -> int:
    """Check a tensor's header (dtype, shape after the batch dimension, batch size) against what the stage takes,
    before any of its bytes are looked at; returns the most bytes such a tensor may hold."""
    dtype, layout = expected.dtype, [-1, *expected.shape]
    shape = list(message.shape)
    if message.dtype != dtype:
        raise _invalid(f"{what} tensors must be {dtype}, got {message.dtype!r}")
    wanted = "[batch, " + ", ".join(str(d) for d in layout[1:]) + "]" if len(layout) > 1 else "[batch]"
    if len(shape) != len(layout) or any(
        want not in (-1, got) for want, got in zip(layout, shape, strict=True)
    ):
        raise _invalid(f"{what} tensor must have shape {wanted}, got {shape}")
    if not 1 <= shape[0] <= max_micro_batch_size:
        raise _invalid(
            f"{what} batch dimension must be in [1, {max_micro_batch_size}] (max_micro_batch_size), got {shape[0]}"
        )
    return max_micro_batch_size * math.prod(layout[1:]) * codec.itemsize(dtype)


def decode_push(io: StageIO, push: IncomingPush) -> torch.Tensor:
    """Validate a PushTensor request against this stage and decode its tensor."""
    request = push.header
    if request.step < 0:
        raise _invalid(f"step must be >= 0, got {request.step}")
    if not 0 <= request.micro_batch < io.micro_batches:
        raise _invalid(f"micro_batch must be in [0, {io.micro_batches}), got {request.micro_batch}")
    if not request.HasField("tensor"):
        raise _invalid("the request carries no tensor")
    max_bytes = check_layout(KIND_NAMES[request.kind], request.tensor, expected_layout(io, request.kind),
                             io.max_micro_batch_size)
    return decode_checked(io, request.kind, request.tensor, push.data, push.scales, push.indices, max_bytes)


def decode_checked(
    io: StageIO, kind: int, header: stage_pb2.Tensor, data: codec.Payload, scales: codec.Payload,
    indices: codec.Payload, max_bytes: int,
) -> torch.Tensor:
    """Decode a tensor of `kind` whose header passed `check_layout` (its payloads apart from it), checking its
    values where the layout bounds them."""
    expected, name = expected_layout(io, kind), KIND_NAMES[kind]
    try:
        # Plain or compressed (Tensor.encoding). No copy: the runtime never writes to its inputs.
        tensor = decode_tensor(header, data, scales, indices, max_bytes=max_bytes, copy=False)
    except codec.TensorValidationError as exc:
        raise _invalid(f"{name} tensor rejected: {exc}") from exc
    if expected.bound is not None:  # class indices or token ids: an embedding or loss must not index out
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= expected.bound:
            what = "labels must be class indices" if kind == stage_pb2.LABELS else f"{name} ids must be"
            raise _invalid(f"{what} in [0, {expected.bound}), got values in [{low}, {high}]")
    return tensor


def check_run_step(io: StageIO, request: stage_pb2.RunStepRequest) -> str:
    """Validate a RunStep request; returns the schedule name."""
    if request.step < 0:
        raise _invalid(f"step must be >= 0, got {request.step}")
    if request.train_step < 0:
        raise _invalid(f"train_step must be >= 0, got {request.train_step}")
    if request.mode not in (stage_pb2.TRAIN, stage_pb2.EVAL):
        raise _invalid(f"mode must be TRAIN or EVAL, got {request.mode}")
    if not 1 <= request.num_micro_batches <= io.micro_batches:
        raise _invalid(
            f"num_micro_batches must be in [1, {io.micro_batches}] (the assignment's micro_batches), "
            f"got {request.num_micro_batches}"
        )
    schedule = request.schedule or "gpipe"
    if schedule not in SCHEDULES:
        raise _invalid(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if request.mode == stage_pb2.TRAIN and schedule != io.schedule:
        held = peak_in_flight(schedule, io.num_stages, request.num_micro_batches, io.stage_index)
        allowed = peak_in_flight(io.schedule, io.num_stages, request.num_micro_batches, io.stage_index)
        if held > allowed:
            raise _invalid(
                f"schedule {schedule!r} holds {held} micro-batches at once on this stage, more than the "
                f"{allowed} of its assignment's {io.schedule!r}, which its memory was checked for"
            )
    max_batch = request.num_micro_batches * io.max_micro_batch_size
    if request.mode == stage_pb2.TRAIN and not 1 <= request.batch_size <= max_batch:
        raise _invalid(
            f"batch_size must be in [1, {max_batch}] for {request.num_micro_batches} micro-batches, "
            f"got {request.batch_size}"
        )
    if not math.isfinite(request.learning_rate) or request.learning_rate < 0:
        raise _invalid(f"learning_rate must be a finite number >= 0, got {request.learning_rate}")
    return schedule
