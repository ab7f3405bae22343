"""Stage 0's inputs and the last stage's labels read by the stage itself from the samples a RunStep names (its
`data`: arceus.data.step_data), into its mailbox where the driver's pushes would have landed, so the step that
follows is the same either way."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from arceus.data.step_data import LocalDatasets, checked_indices, micro_batch_indices
from arceus.errors import SpecError
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure
from nodeagent.stage import HostedStage

_DATASETS = LocalDatasets()


def read_step_samples(stage: HostedStage, request: stage_pb2.RunStepRequest, micro_batches: Sequence[int]) -> None:
    """Put the step's `micro_batches` (this stage's, or this replica's share) of inputs (stage 0) and labels (the
    last stage) in the mailbox; INVALID_ARGUMENT for data a stage cannot read or a middle stage is sent."""
    io, data = stage.io, request.data
    if not (io.is_first or io.is_last):
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{stage.name} reads no samples: only the first and "
                         "the last stage take a RunStep's data")
    if len(data.indices) != request.batch_size:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"data.indices names {len(data.indices)} samples for a "
                         f"batch_size of {request.batch_size}")
    try:
        x, y = _DATASETS.split(data.dataset_json, data.validation)
        indices = checked_indices(list(data.indices), len(x))
    except SpecError as exc:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from None
    split = micro_batch_indices(indices, request.num_micro_batches)
    largest = max(len(part) for part in split)
    if largest > io.max_micro_batch_size:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"data makes micro-batches of {largest} samples, more "
                         f"than the assignment's max_micro_batch_size {io.max_micro_batch_size}")
    for kind, tensor, layout, on in (("ACTIVATION", x, io.input_layout, io.is_first),
                                     ("LABELS", y, io.label_layout, io.is_last)):
        if not on:
            continue
        if tuple(tensor.shape[1:]) != tuple(layout.shape):
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"the dataset's samples are {list(tensor.shape[1:])} "
                             f"but {stage.name} takes {kind} of {list(layout.shape)}")
        for m in micro_batches:
            stage.mailbox.put((request.step, kind, m), tensor[split[m]])
