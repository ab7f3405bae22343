"""Run one step's schedule actions on a hosted stage: wait for inputs, compute, push outputs on.

Sends are asynchronous (a stage never waits for its neighbour to accept before computing the next
micro-batch); the step fails if any send failed, and the optimizer steps only once all are delivered.
Each action computes with the agent's share of torch threads, or, when no other stage of the pipeline
can compute meanwhile and that pays (nodeagent.lending), with the threads it may borrow from stages that
share its machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext

import grpc
import torch

from arceus.pipeline.lending import solo_planner
from arceus.pipeline.schedule import Action, build_schedule
from arceus.v1 import stage_pb2
from arceus.verify.receipts import RECEIVED, SENT, ReceiptFields, ReceiptSigner, tensor_digest
from arceus.wire.compression import Encoded, decode_payload
from arceus.wire.push_stream import PushError, outgoing_push
from nodeagent.lending import ComputeThreads
from nodeagent.mailbox import MailboxCancelled, MailboxClosed, MailboxTimeout
from nodeagent.stage import HostedStage, NeighbourLink
from nodeagent.status import RpcFailure, neighbour_failure_code
from nodeagent.validation import check_run_step
from nodeagent.verify import AuditRecord

MIN_CALL_TIMEOUT = 0.05


class PushTracker:
    """Outstanding pushes of one step. The first failure sets `abort` so waits stop early."""

    def __init__(self, stage: HostedStage, step: int, deadline: float, abort: threading.Event) -> None:
        self._stage = stage
        self._step = step
        self._deadline = deadline
        self._abort = abort
        self._futures: list[Future[None]] = []
        self._cond = threading.Condition()
        self._pending = 0  # pushes whose completion has not been accounted for yet
        self.failure: RpcFailure | None = None

    def send(
        self, links: Sequence[NeighbourLink], target_index: int, kind: int, micro_batch: int, tensor: torch.Tensor
    ) -> Encoded:
        """Start the push to every rank of the neighbour (`links`); returns the payload as encoded (what
        the receivers will decode)."""
        # Encoded once, per the job's transfer setting; top-k error feedback is kept per micro-batch slot.
        encoded = self._stage.transfer.encode(tensor, gradient=kind == stage_pb2.GRADIENT, stream=micro_batch)
        push = outgoing_push(self._stage.ref(target_index), kind, self._step, micro_batch, encoded)
        timeout = max(MIN_CALL_TIMEOUT, self._deadline - time.monotonic())
        nbytes = encoded.nbytes
        for link in links:
            what = (
                f"the {stage_pb2.TensorKind.Name(kind)} of step {self._step} micro-batch {micro_batch} "
                f"to stage {target_index} at {link.address}"
            )
            with self._cond:
                self._pending += 1
            future = link.pushes.push(push, timeout)
            self._futures.append(future)
            future.add_done_callback(lambda f, what=what: self._done(f, what, nbytes))
        return encoded

    def _done(self, future: Future[None], what: str, nbytes: int) -> None:
        try:
            if future.cancelled():
                return
            error = future.exception()
            if error is None:
                self._stage.add_bytes_sent(nbytes)
                return
            code = error.code() if isinstance(error, PushError) else None
            status = f"{code.name}: {error.details()}" if code is not None else str(error)
            with self._cond:
                if self.failure is None:
                    self.failure = RpcFailure(
                        neighbour_failure_code(code), f"{self._stage.name} could not push {what}: {status}"
                    )
            self._abort.set()
            self._stage.mailbox.wake()
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def raise_if_failed(self) -> None:
        with self._cond:
            failure = self.failure
        if failure is not None:
            raise failure

    def wait_all(self) -> None:
        """Wait until every push is delivered and counted (each has its own deadline); raise the first
        failure."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._pending == 0, timeout=max(0.0, self._deadline - time.monotonic()) + 1
            )
            if self._pending:
                raise RpcFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self._stage.name}: {self._pending} pushes did not finish by the deadline",
                )
        self.raise_if_failed()

    def cancel_all(self) -> None:
        for future in self._futures:
            future.cancel()


def run_step(
    stage: HostedStage,
    request: stage_pb2.RunStepRequest,
    *,
    deadline: float,
    abort: threading.Event,
    signer: ReceiptSigner,
    threads: ComputeThreads | None = None,
) -> stage_pb2.RunStepReply:
    """Execute this stage's actions for one step; `deadline` is a time.monotonic() value. Every
    activation accepted from the previous stage gets a receipt signed by `signer`; on a retained train
    step, so does every activation sent on (role "sent"). `threads`: None leaves the calling thread's
    torch thread count as it is."""
    schedule = check_run_step(stage.io, request)
    a, io, runtime = stage.assignment, stage.io, stage.runtime
    train = request.mode == stage_pb2.TRAIN
    actions = build_schedule(schedule, a.num_stages, request.num_micro_batches, train)[a.stage_index]
    # The ranks of a tensor-parallel stage compute side by side: none of them computes alone.
    planner = (
        solo_planner(schedule, a.num_stages, request.num_micro_batches, train)
        if threads is not None and threads.solo > threads.own and stage.tensor_parallel is None
        else None
    )
    stage.mailbox.retain_step(request.step)
    # Leave a little of the caller's deadline so our own explanation reaches it before its timer fires.
    wait_until = deadline - min(1.0, 0.05 * max(0.0, deadline - time.monotonic()))
    pushes = PushTracker(stage, request.step, deadline, abort)
    compute_before = runtime.counters.compute_seconds
    forward_sizes: dict[int, int] = {}
    results: dict[int, tuple[float, int, int]] = {}
    receipts: list[stage_pb2.Receipt] = []
    sent_receipts: list[stage_pb2.Receipt] = []
    stage.audit_record = None  # the previous step's is no longer auditable
    record = AuditRecord(request.step) if request.retain_for_audit and train else None

    def receive(kind: int, micro_batch: int) -> torch.Tensor:
        return _receive(stage, request.step, kind, micro_batch, wait_until, abort, pushes)

    def group_op(micro_batch: int) -> AbstractContextManager[None]:
        """Names the all-reduces of a tensor-parallel stage's compute, which its ranks run in one order."""
        group = stage.tensor_parallel
        if group is None:
            return nullcontext()
        return group.micro_batch(request.step, micro_batch, deadline=wait_until, abort=abort)

    @contextmanager
    def computing(index: int, samples: int) -> Iterator[None]:
        """Around the compute of action `index`, once its inputs are in (what has arrived by then tells
        which of the neighbours' actions are done): its threads, its tensor-parallel group's names, and
        the timing the lending gauge learns from."""
        action = actions[index]
        lent = (
            planner is not None
            and planner.solo(a.stage_index, index, _arrived(stage, request.step))
            and stage.lending.lend(action.kind)
        )
        if threads is not None:
            threads.apply(lent)
        before = runtime.counters.compute_seconds
        with group_op(action.micro_batch):
            yield
        if planner is not None:
            stage.lending.record(action.kind, lent, runtime.counters.compute_seconds - before, samples)

    try:
        for index, action in enumerate(actions):
            m = action.micro_batch
            key = (request.step, m)
            if action.kind == "F":
                x = receive(stage_pb2.ACTIVATION, m)
                forward_sizes[m] = len(x)
                if not io.is_first:
                    receipts.append(_receipt(stage, signer, request.step, m, x, a.stage_index, RECEIVED))
                    if record is not None:
                        record.received[m] = x
                if io.is_last:
                    labels = receive(stage_pb2.LABELS, m)
                    if len(labels) != len(x):
                        raise RpcFailure(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"micro-batch {m} of step {request.step} has {len(x)} activations "
                            f"but {len(labels)} labels",
                        )
                    with computing(index, len(x)):
                        if train:
                            loss_sum, correct = runtime.forward_loss(key, x, labels, request.batch_size)
                        else:
                            loss_sum, correct = runtime.eval_loss(x, labels)
                    results[m] = (loss_sum, correct, len(x))
                else:
                    with computing(index, len(x)):
                        out = runtime.forward(key, x) if train else runtime.eval_forward(x)
                    if a.sends_on:  # ranks 1.. of a tensor-parallel stage compute the same output as rank 0
                        encoded = pushes.send(stage.next_links, a.stage_index + 1, stage_pb2.ACTIVATION, m, out)
                        if record is not None:
                            record.sent[m] = _as_delivered(out, encoded)
                            sent_receipts.append(
                                _receipt(stage, signer, request.step, m, record.sent[m], a.stage_index + 1, SENT)
                            )
            else:
                grad = None
                if not io.is_last:
                    grad = receive(stage_pb2.GRADIENT, m)
                    if len(grad) != forward_sizes[m]:
                        raise RpcFailure(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"the GRADIENT of step {request.step} micro-batch {m} has {len(grad)} "
                            f"rows but its forward had {forward_sizes[m]}",
                        )
                with computing(index, forward_sizes[m]):
                    grad_input = runtime.backward(key, grad)
                if grad_input is not None and a.sends_on:
                    pushes.send(stage.prev_links, a.stage_index - 1, stage_pb2.GRADIENT, m, grad_input)
            pushes.raise_if_failed()
        pushes.wait_all()
        if record is not None:
            record.weights = runtime.named_weights()  # what the forwards used: the optimizer has not stepped
            stage.audit_record = record
        if train:
            if threads is not None:
                lending = stage.lending
                threads.apply(
                    planner is not None
                    and planner.solo_optimizer_step(a.stage_index)
                    and lending.pays("F")
                    and lending.pays("B")
                )
            runtime.optimizer_step(request.learning_rate or None)
    except BaseException:
        runtime.abort_step()
        pushes.cancel_all()
        raise
    ordered = [results[m] for m in sorted(results)]
    return stage_pb2.RunStepReply(
        loss_sums=[r[0] for r in ordered],
        correct=[r[1] for r in ordered],
        sample_counts=[r[2] for r in ordered],
        compute_seconds=runtime.counters.compute_seconds - compute_before,
        counters=stage.counters(),
        receipts=receipts,
        sent_receipts=sent_receipts,
    )


def _arrived(stage: HostedStage, step: int) -> list[Action]:
    """The neighbours' actions of `step` whose outputs wait in the mailbox: the previous stage's forwards
    (not the driver's inputs to the first stage) and the next stage's backwards."""
    arrived = []
    for kind, micro_batch in stage.mailbox.arrived(step):
        if kind == "ACTIVATION" and not stage.io.is_first:
            arrived.append(Action("F", micro_batch))
        elif kind == "GRADIENT":
            arrived.append(Action("B", micro_batch))
    return arrived


def _as_delivered(out: torch.Tensor, encoded: Encoded) -> torch.Tensor:
    """The activation as the receiver decodes it: its digest is comparable with the receiver's."""
    return out.detach() if encoded.encoding == "fp32" else decode_payload(encoded)


def _receipt(
    stage: HostedStage, signer: ReceiptSigner, step: int, micro_batch: int, x: torch.Tensor, receiver: int, role: str
) -> stage_pb2.Receipt:
    """A receipt for the activation of `micro_batch` that stage `receiver` receives."""
    a = stage.assignment
    fields = ReceiptFields(a.job_id, receiver, a.generation, step, micro_batch, tensor_digest(x), role)
    return stage_pb2.Receipt(
        stage=stage.ref(receiver),
        step=step,
        micro_batch=micro_batch,
        sha256=fields.sha256,
        signature=signer.sign(fields),
    )


def _receive(
    stage: HostedStage,
    step: int,
    kind: int,
    micro_batch: int,
    wait_until: float,
    abort: threading.Event,
    pushes: PushTracker,
) -> torch.Tensor:
    a = stage.assignment
    kind_name = stage_pb2.TensorKind.Name(kind)
    if kind == stage_pb2.GRADIENT:
        source = f"stage {a.stage_index + 1} at {a.next_address}"
    elif kind == stage_pb2.ACTIVATION and not a.is_first:
        source = f"stage {a.stage_index - 1} at {a.prev_address}"
    else:
        source = "the driver"
    timeout = max(0.0, wait_until - time.monotonic())
    try:
        return stage.mailbox.get((step, kind_name, micro_batch), timeout, abort)
    except MailboxTimeout:
        raise RpcFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{stage.name} waited {timeout:.1f}s for the {kind_name} of step {step} "
            f"micro-batch {micro_batch} from {source}; it never arrived",
        ) from None
    except MailboxClosed:
        raise RpcFailure(
            grpc.StatusCode.ABORTED, f"{stage.name} was removed from this agent while running step {step}"
        ) from None
    except MailboxCancelled:
        pushes.raise_if_failed()
        raise RpcFailure(grpc.StatusCode.CANCELLED, f"step {step} on {stage.name} was cancelled") from None
