"""Stage 0's inputs and the last stage's labels read by the stage itself from the samples a RunStep names (its
`data`: arceus.data.step_data), into its mailbox where the driver's pushes would have landed, so the step that
follows is the same either way. A bundled dataset is read from memory; an upload (a tensor file, or an uploaded
text's token file) by byte range through the control plane (`HostedStage.read_dataset`), only the rows the stage's
micro-batches name, contiguous rows in one range; a step chained after another (`after_step`) has its rows read
while that one computes (`prefetch_step_samples`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from arceus.data.config import UPLOADED_DATASET, validate_dataset_config
from arceus.data.step_data import BUNDLED_DATASETS, checked_indices, micro_batch_indices
from arceus.data.streaming import inputs_of, labels_of
from arceus.data.upload_rows import SplitLayout, UploadLayout, row_ranges, rows_decoded
from arceus.errors import SpecError
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure
from nodeagent.stage import DatasetReadError, HostedStage

# Reads ahead of a step: one or two per stage at a time (a window's next step, and the next window's first), a few
# stages per agent.
_AHEAD = ThreadPoolExecutor(max_workers=4, thread_name_prefix="samples-ahead")
# Per micro-batch: (inputs or None, labels or None), as the stage takes them.
Samples = dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]


def read_step_samples(stage: HostedStage, request: stage_pb2.RunStepRequest, micro_batches: Sequence[int]) -> None:
    """Put the step's `micro_batches` (this stage's, or this replica's share) of inputs (stage 0) and labels (the
    last stage) in the mailbox; INVALID_ARGUMENT for data a stage cannot read or a middle stage is sent,
    UNAVAILABLE where an upload's rows could not be read."""
    ahead = stage.samples_ahead.pop(request.step, None)
    # Steps run here in the order of their call ids: a read ahead for a step before this one is never taken.
    for old in [s for s in list(stage.samples_ahead) if s < request.step]:
        stage.samples_ahead.pop(old, None)
    samples = ahead.result() if ahead is not None else _samples(stage, request, micro_batches)
    io = stage.io
    for m in micro_batches:
        x, y = samples[m]
        if io.is_first:
            stage.mailbox.put((request.step, "ACTIVATION", m), x)
        if io.is_last:
            stage.mailbox.put((request.step, "LABELS", m), y)


def prefetch_step_samples(stage: HostedStage, request: stage_pb2.RunStepRequest) -> None:
    """Start reading a chained step's samples of an uploaded dataset now, while the step it follows computes; the
    step takes them (`read_step_samples`), a failure included. Only an unreplicated step is chained (all its
    micro-batches are this stage's), and only an upload's rows are worth reading ahead (a bundled dataset is in
    memory)."""
    if not (request.HasField("data") and request.data.layout_json) or request.HasField("replicas"):
        return
    stage.samples_ahead[request.step] = _AHEAD.submit(
        _samples, stage, request, range(request.num_micro_batches)
    )


def _samples(stage: HostedStage, request: stage_pb2.RunStepRequest, micro_batches: Sequence[int]) -> Samples:
    io, data = stage.io, request.data
    if not (io.is_first or io.is_last):
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{stage.name} reads no samples: only the first and "
                         "the last stage take a RunStep's data")
    if len(data.indices) != request.batch_size:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"data.indices names {len(data.indices)} samples for a "
                         f"batch_size of {request.batch_size}")
    try:
        if data.layout_json:
            layout = _layout(data.dataset_json, data.layout_json)
            indices = checked_indices(list(data.indices), layout.split(data.validation).samples)
        else:
            x, y = BUNDLED_DATASETS.split(data.dataset_json, data.validation)
            indices = checked_indices(list(data.indices), len(x))
    except SpecError as exc:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from None
    split = micro_batch_indices(indices, request.num_micro_batches)
    largest = max(len(part) for part in split)
    if largest > io.max_micro_batch_size:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"data makes micro-batches of {largest} samples, more "
                         f"than the assignment's max_micro_batch_size {io.max_micro_batch_size}")
    if data.layout_json:
        x, y = _uploaded_rows(stage, layout.split(data.validation), layout.kind,
                              [int(i) for m in micro_batches for i in split[m]])
        # An upload's ids, as read (a bundled dataset's are the agent's own): a text's inputs, any upload's labels.
        for what, ids, bound in (("an input id", x, io.input_layout.bound), ("a label", y, io.label_layout.bound)):
            if ids is not None and bound is not None and len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < bound:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"the dataset holds {what} outside [0, {bound}) "
                                 f"that {stage.name} takes")
        starts = itertools.accumulate((len(split[m]) for m in micro_batches), initial=0)
        parts = {m: slice(a, a + len(split[m])) for m, a in zip(micro_batches, starts, strict=False)}
    else:
        parts = {m: split[m] for m in micro_batches}
    for kind, tensor, layout_of, on in (("ACTIVATION", x, io.input_layout, io.is_first),
                                        ("LABELS", y, io.label_layout, io.is_last)):
        if on and tensor is not None and tuple(tensor.shape[1:]) != tuple(layout_of.shape):
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"the dataset's samples are {list(tensor.shape[1:])} "
                             f"but {stage.name} takes {kind} of {list(layout_of.shape)}")
    return {m: (x[parts[m]] if io.is_first else None, y[parts[m]] if io.is_last else None) for m in micro_batches}


def _layout(dataset_json: str, layout_json: str) -> UploadLayout:
    """The layout RunStep sends, checked, and of the dataset its config names; SpecError otherwise."""
    try:
        cfg, raw = json.loads(dataset_json), json.loads(layout_json)
    except json.JSONDecodeError as exc:
        raise SpecError("data", f"dataset_json or layout_json is not JSON: {exc}") from exc
    cfg = validate_dataset_config(cfg)
    layout = UploadLayout.from_json(raw)
    if cfg.get("dataset_id") != layout.dataset_id:
        raise SpecError("data.layout_json.dataset_id", f"is {layout.dataset_id}, but the dataset config names "
                        f"{cfg.get('dataset_id')}")
    kind = "tensors" if cfg["name"] == UPLOADED_DATASET else "text"
    if layout.kind != kind:
        raise SpecError("data.layout_json.kind", f"is {layout.kind}, but the dataset config names {kind}")
    return layout


def _uploaded_rows(
    stage: HostedStage, split: SplitLayout, kind: str, rows: list[int]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows `rows` of a split of an upload of `kind`, as tensors: x where this stage is the first (else None), y where
    it is the last. Each array's rows are read in as few ranges as they allow and taken only once every byte asked
    came back."""
    if stage.read_dataset is None:
        raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} cannot read an uploaded dataset: this "
                         "agent runs without a control plane")
    io = stage.io
    wanted = [split.x] * io.is_first + [split.y] * io.is_last
    ranges = [row_ranges(array, rows) for array in wanted]
    try:
        answers = stage.read_dataset(stage.assignment.job_id, [r for each in ranges for r in each])
    except DatasetReadError as exc:
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"{stage.name} could not read its samples: {exc}") from None
    arrays, first = [], 0
    try:
        for array, each in zip(wanted, ranges, strict=True):
            arrays.append(rows_decoded(array, rows, each, answers[first : first + len(each)]))
            first += len(each)
    except ValueError as exc:
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"{stage.name} read its samples wrong: {exc}") from None
    return (inputs_of(arrays[0], kind) if io.is_first else None), (labels_of(arrays[-1]) if io.is_last else None)
