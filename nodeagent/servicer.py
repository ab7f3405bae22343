"""`StageService` over gRPC: authorize the caller (nodeagent.callers), resolve the addressed stage, validate,
run the step (`StepRun`), map errors.

Every failure leaves as a gRPC status with a message; nothing a client sends can stop the server.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import torch

from arceus.checkpoint import decode_checkpoint, state_chunks
from arceus.contracts.credentials import Role
from arceus.errors import SpecError
from arceus.model.precision import check_precision
from arceus.model.registry import model_spec_from_config
from arceus.swarm.exchange import MAX_SHARD_BYTES
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.verify.receipts import ReceiptSigner
from arceus.wire.channels import MAX_MESSAGE_BYTES
from arceus.wire.codec import TensorValidationError
from arceus.wire.incoming_push import IncomingPush, MalformedPush, parse_push
from arceus.wire.proto_tensor import from_proto, to_proto
from nodeagent.callers import DRIVER_ONLY, authorize, presented_digest, push_roles, replica_digest
from nodeagent.device import memory_summary
from nodeagent.hosting import HostedStages
from nodeagent.lending import ComputeThreads
from nodeagent.mailbox import MailboxClosed, MailboxFull
from nodeagent.metrics import AgentMetrics
from nodeagent.replicas import ReplicaStepPlan
from nodeagent.rpc import REPLY_MARGIN_SECONDS, RpcFailure, call_deadline, serve
from nodeagent.stage import HostedStage, StateUploader, StateUploadError
from nodeagent.step import StepRun, replica_plan
from nodeagent.step_grants import StepNotGranted
from nodeagent.step_samples import prefetch_step_samples
from nodeagent.step_window import window_requests
from nodeagent.validation import KIND_NAMES, check_layout, decode_push
from nodeagent.verify import AuditRecord, recompute_forward

log = logging.getLogger(__name__)


# Room for a safetensors header beside the weights of the layers being verified.
HEADER_ALLOWANCE = 1 << 20


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(
        self,
        registry: HostedStages,
        metrics: AgentMetrics,
        compute_threads: Callable[[], ComputeThreads] | None = None,
        *,
        signer: ReceiptSigner,
        device: torch.device,
        max_message_bytes: int,
        upload_state: StateUploader | None = None,
        stream_listener: Callable[[], stage_pb2.NeighbourStreamPortReply] | None = None,
    ) -> None:
        """`upload_state`: how SaveState sends a stage's state to the control plane (None: the agent has
        no control plane, and SaveState is refused). `stream_listener`: where the agent's peer stream listener is
        reached (None: it has none)."""
        self._stream_listener = stream_listener
        self._registry = registry
        self._upload_state = upload_state
        self._metrics = metrics
        self._compute_threads = compute_threads
        self._signer = signer
        self._device = device
        self._max_message_bytes = max_message_bytes

    def PushTensor(
        self, request: IncomingPush | MalformedPush, context: grpc.ServicerContext
    ) -> stage_pb2.PushTensorReply:
        def push() -> stage_pb2.PushTensorReply:
            self._deliver(request, context, "PushTensor")
            return stage_pb2.PushTensorReply()

        return serve(context, "PushTensor", push)

    def PushStream(
        self, request_iterator: Iterator[IncomingPush | MalformedPush], context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.PushAck]:
        # One ack per request, in order; a refused message is answered with its code and the stream
        # goes on. The stream ends when the sender half-closes, cancels, or the call's deadline passes,
        # or with INVALID_ARGUMENT at bytes that are no request (nothing to ack them by). Each message is
        # authorized on its own: one stream may carry several kinds, to several stages. A taken request sent with
        # ack_later is answered by the next ack (each ack costs both sides thread wake-ups: docs/BENCHMARKS.md).
        unanswered: stage_pb2.PushAck | None = None  # the last taken ack_later request, if not answered yet
        for request in request_iterator:
            if isinstance(request, MalformedPush):
                log.warning("PushStream -> INVALID_ARGUMENT: %s", request.reason)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            header = request.header
            ack = stage_pb2.PushAck(kind=header.kind, step=header.step, micro_batch=header.micro_batch)
            if unanswered is not None:
                ack.also_acked = unanswered.also_acked + 1
            try:
                self._deliver(request, context, "PushStream")
            except RpcFailure as failure:
                log.warning("PushStream message -> %s: %s", failure.code.name, failure.message)
                ack.code, ack.message = failure.code.value[0], failure.message
            except Exception as exc:
                log.error("PushStream message failed unexpectedly\n%s", traceback.format_exc())  # (as rpc.serve)
                ack.code = grpc.StatusCode.INTERNAL.value[0]
                ack.message = f"PushStream failed unexpectedly: {type(exc).__name__}: {exc}"
            if ack.code == 0 and header.ack_later:
                unanswered = ack
                continue
            unanswered = None
            yield ack
        if unanswered is not None:  # the sender half-closed after pushes it left for a later ack
            yield unanswered

    def _deliver(self, request: IncomingPush | MalformedPush, context: grpc.ServicerContext, method: str) -> None:
        """Authorize (by the tensor's kind), resolve, validate, decode and park one pushed tensor. A replica takes a
        neighbour's tensor only from a member of the push's membership epoch (nodeagent.membership): one from a
        replica taken off the job is refused before it is decoded, parked or counted."""
        if isinstance(request, MalformedPush):
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        header = request.header
        kind = KIND_NAMES.get(header.kind, "")
        roles = push_roles(kind, header.target.stage_index)
        authorize(presented_digest(context), self._registry.guards(), target=header.target, allowed=roles,
                  method=method)
        stage = self._registry.resolve(header.target)
        if stage.exchange is not None and kind in ("ACTIVATION", "GRADIENT") and Role.DRIVER not in roles:
            # a neighbour replica's activation or gradient
            producer = header.target.stage_index + (-1 if kind == "ACTIVATION" else 1)
            what = f"the {kind} of step {header.step} micro-batch {header.micro_batch} from stage {producer}"
            stage.exchange.members.check(header.epoch, producer, None, replica_digest(context), what=what,
                                         method=method, wait=max(0.0, call_deadline(context) - time.monotonic()))
        tensor = stage.tied.decode(request) if kind == "TIED_GRADIENT" else decode_push(stage.io, request)
        try:
            stage.mailbox.put((header.step, KIND_NAMES[header.kind], header.micro_batch), tensor)
        except MailboxFull as exc:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{stage.name}: {exc}") from None
        except MailboxClosed:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"{stage.name} was just removed from this agent") from None
        nbytes = request.nbytes  # encoded bytes, as they travelled
        stage.add_bytes_received(nbytes)
        self._metrics.bytes_received.inc(nbytes)

    def NeighbourStreamPort(
        self, request: stage_pb2.NeighbourStreamPortRequest, context: grpc.ServicerContext
    ) -> stage_pb2.NeighbourStreamPortReply:
        def port() -> stage_pb2.NeighbourStreamPortReply:
            method = "NeighbourStreamPort"
            authorize(presented_digest(context), self._registry.guards(), target=request.target,
                      allowed=frozenset({Role.PREV}), method=method)
            stage = self._registry.resolve(request.target)
            if not stage.neighbours.prev_streamed or self._stream_listener is None:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{stage.name} takes its previous stage's tensors over PushStream")
            return self._stream_listener()

        return serve(context, "NeighbourStreamPort", port)

    def RunStep(
        self, request: stage_pb2.RunStepRequest, context: grpc.ServicerContext
    ) -> stage_pb2.RunStepReply:
        def step() -> stage_pb2.RunStepReply:
            stage = self._driven(context, request.target, "RunStep")
            abort = self._abort_on_done(stage, context, request.step)
            replicas = replica_plan(stage, request)
            if 0 < request.after_step < request.step:
                prefetch_step_samples(stage, request)  # its samples read while the step before computes
            return self._run_step(stage, request, replicas, call_deadline(context), abort)

        return serve(context, "RunStep", step)

    def RunSteps(
        self, request: stage_pb2.RunStepsRequest, context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.RunStepReply]:
        """A window of train steps (nodeagent.step_window), run back to back, each reply sent as its step finishes; a
        failed step ends the call with its status, and the steps after it never run. A window chained after the one
        before (`first.after_step`) waits here for that one's last step, its first step's samples read meanwhile."""

        def begin() -> tuple[HostedStage, list[stage_pb2.RunStepRequest], threading.Event]:
            stage = self._driven(context, request.first.target, "RunSteps")
            steps = window_requests(request, staleness=stage.assignment.staleness)
            abort = self._abort_on_done(stage, context, request.first.step)
            if request.first.after_step:
                prefetch_step_samples(stage, steps[0])
                stage.wait_for_step(request.first.after_step, call_deadline(context), abort)
            return stage, steps, abort

        stage, steps, abort = serve(context, "RunSteps", begin)
        # The steps run on a thread of their own, each starting as soon as the one before ended: a reply is sent
        # (this thread waits for gRPC to write it) while the next step computes, not before it starts.
        replies: queue.SimpleQueue[stage_pb2.RunStepReply | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                for i, step_request in enumerate(steps):
                    if i + 1 < len(steps):
                        prefetch_step_samples(stage, steps[i + 1])  # read while this step computes
                    seconds = request.step_seconds
                    deadline = min(call_deadline(context),
                                   time.monotonic() + seconds - min(REPLY_MARGIN_SECONDS, seconds / 4))
                    replies.put(self._run_step(stage, step_request, None, deadline, abort))
            except BaseException as exc:  # noqa: BLE001 - the step's failure, mapped to its status on the call's thread
                replies.put(exc)

        threading.Thread(target=run, name="run-steps", daemon=True).start()
        for _ in steps:
            reply = replies.get()
            if isinstance(reply, BaseException):
                serve(context, "RunSteps", partial(_raise, reply))
            yield reply

    @staticmethod
    def _abort_on_done(stage: HostedStage, context: grpc.ServicerContext, step: int) -> threading.Event:
        """An event set when the call ends, including when the caller cancels it; CANCELLED if it already has."""
        abort = threading.Event()

        def on_done() -> None:
            abort.set()
            stage.mailbox.wake()  # (an exchange under way looks at `abort` itself)

        if not context.add_callback(on_done):  # the caller gave up before the step began: it never runs
            raise RpcFailure(grpc.StatusCode.CANCELLED, f"RunStep of step {step} was cancelled")
        return abort

    def _run_step(
        self, stage: HostedStage, request: stage_pb2.RunStepRequest, replicas: ReplicaStepPlan | None,
        deadline: float, abort: threading.Event,
    ) -> stage_pb2.RunStepReply:
        """Run one step on `stage` (`replicas`: its plan for a replica) once the step it is chained after finished
        here (`after_step`) and its job's grant covers it, and count it in the agent's metrics."""
        if request.after_step and not 0 < request.after_step < request.step:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                             f"after_step {request.after_step} is not a step before step {request.step}")
        if request.after_step and stage.assignment.staleness:  # overlaps the step it follows (nodeagent.step)
            self._granted(request, deadline, abort)
            stage.step_join(request.step, request.after_step, deadline, abort)
        else:
            if request.after_step:  # sent before the step it follows ended: it waits for that step to finish here
                stage.wait_for_step(request.after_step, deadline, abort)
            self._granted(request, deadline, abort)
            # A replica's step run again after a loss may find the cancelled attempt still unwinding; a chained
            # step, the step it follows releasing the lock.
            waits = request.HasField("replicas") or request.after_step
            stage.step_start(request.step, min(10.0, max(0.0, deadline - time.monotonic())) if waits else 0.0)
        finished = False
        try:
            threads = None if self._compute_threads is None else self._compute_threads()
            before = stage.counters()
            started = time.perf_counter()
            run = StepRun(
                stage, request, replicas=replicas, deadline=deadline, abort=abort, signer=self._signer,
                threads=threads,
            )
            reply = run.run()
            finished = True
            if run.wire is not None:  # what its neighbour streams brought (pushes are counted as they land)
                self._metrics.bytes_received.inc(run.wire.bytes_received)
            mode = "train" if request.mode == stage_pb2.TRAIN else "eval"
            self._metrics.step_seconds.labels(mode=mode).observe(time.perf_counter() - started)
            self._metrics.step_wait_seconds.labels(mode=mode).observe(reply.wait_seconds)
            self._metrics.wait_seconds.inc(reply.wait_seconds)
        finally:
            stage.step_end(request.step, finished)
        after = reply.counters
        self._metrics.samples.inc(after.samples - before.samples)
        self._metrics.micro_batches.inc(after.micro_batches - before.micro_batches)
        self._metrics.compute_seconds.inc(after.compute_seconds - before.compute_seconds)
        self._metrics.bytes_sent.inc(after.bytes_sent - before.bytes_sent)
        if stage.assignment.replica is not None:
            self._metrics.replica_step(
                stage.assignment.stage_index, stage.assignment.replica,
                samples=after.samples - before.samples, micro_batches=after.micro_batches - before.micro_batches,
                compute_seconds=after.compute_seconds - before.compute_seconds,
            )
        return reply

    def _granted(self, request: stage_pb2.RunStepRequest, deadline: float, abort: threading.Event) -> None:
        """Return once a train step is within its job's step grant (nodeagent/step_grants.py), before it begins here;
        else FAILED_PRECONDITION naming the step and the grant."""
        if request.mode != stage_pb2.TRAIN:
            return
        try:
            self._registry.grants.require(request.target.job_id, request.train_step, deadline=deadline, abort=abort)
        except StepNotGranted as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def _driven(self, context: grpc.ServicerContext, target: stage_pb2.StageRef, method: str) -> HostedStage:
        """The addressed stage, if the caller is its driver (nodeagent.callers)."""
        guards = self._registry.guards()
        authorize(presented_digest(context), guards, target=target, allowed=DRIVER_ONLY, method=method)
        stage = self._registry.resolve(target)
        if stage.assignment.inference and method != "Infer":
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} is served for inference: it only decodes (Infer)"
            )
        return stage

    def _between_steps(self, stage: HostedStage, context: grpc.ServicerContext) -> HostedStage:
        """`stage` with its step lock held and its optimizer step applied: a checkpoint holds the state after the
        step's optimizer step, never half updated. The caller releases the lock."""
        stage.hold_between_steps(call_deadline(context) - time.monotonic())
        return stage

    def GetState(
        self, request: stage_pb2.GetStateRequest, context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.StateChunk]:
        """The stage's state as one safetensors file in chunks of a few MiB, between steps (the step lock
        is held until the last chunk)."""
        def settled() -> HostedStage:
            return self._between_steps(self._driven(context, request.target, "GetState"), context)

        stage = serve(context, "GetState", settled)
        yield from state_stream(stage, include_optimizer_state=request.include_optimizer_state)

    def SaveState(
        self, request: stage_pb2.SaveStateRequest, context: grpc.ServicerContext
    ) -> stage_pb2.SaveStateReply:
        """Upload the stage's state (GetState's file) to `upload_path` on the control plane, between steps,
        a chunk at a time straight from the tensors; the reply says what was sent."""

        def save() -> stage_pb2.SaveStateReply:
            stage = self._driven(context, request.target, "SaveState")
            if self._upload_state is None:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this agent runs without a control plane, so it has nowhere to upload to; use GetState",
                )
            if not request.upload_path.startswith("/"):
                raise RpcFailure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"upload_path {request.upload_path!r} is not a path on the control plane (it starts with /)",
                )
            started = time.perf_counter()
            self._between_steps(stage, context)
            try:
                state = dict(stage.runtime.state_items(include_optimizer_state=request.include_optimizer_state))
                size = state_chunks(state)[0]
                seconds = max(0.0, call_deadline(context) - time.monotonic())
                sha256 = self._upload_state(request.upload_path, size, lambda: state_chunks(state)[1], seconds)
            except StateUploadError as exc:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"{stage.name}: {exc}") from None
            finally:
                stage.step_lock.release()
            took = time.perf_counter() - started
            self._metrics.state_bytes_uploaded.inc(size)
            self._metrics.state_save_seconds.observe(took)
            log.info("uploaded the state of %s (%d bytes) in %.1f s; %s", stage.name, size, took,
                     memory_summary(self._device))
            return stage_pb2.SaveStateReply(sha256=sha256, size_bytes=size)

        return serve(context, "SaveState", save)

    def Infer(self, request: stage_pb2.InferRequest, context: grpc.ServicerContext) -> stage_pb2.InferReply:
        """Decode the next positions of a sampler's sequence (between or during training steps)."""

        def infer() -> stage_pb2.InferReply:
            stage = self._driven(context, request.target, "Infer")
            if stage.assignment.tensor_parallel is not None:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{stage.name} is split across a tensor-parallel group, which does not decode for samplers",
                )
            if request.start < 0:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"start must be 0 or more, got {request.start}")
            try:
                x = from_proto(request.input, max_bytes=self._max_message_bytes)
            except TensorValidationError as exc:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"input: {exc}") from None
            out = stage.decoding.decode(request.session, request.start, x)
            return stage_pb2.InferReply(output=to_proto(out))

        return serve(context, "Infer", infer)

    def Audit(self, request: stage_pb2.AuditRequest, context: grpc.ServicerContext) -> stage_pb2.AuditReply:
        def audit() -> stage_pb2.AuditReply:
            stage, record = self._audit_record(request, context, "Audit")
            reply = stage_pb2.AuditReply()
            if not stage.io.is_first:
                if request.micro_batch not in record.received:
                    raise RpcFailure(
                        grpc.StatusCode.NOT_FOUND,
                        f"{stage.name} received no micro-batch {request.micro_batch} in step {request.step}",
                    )
                reply.received.CopyFrom(to_proto(record.received[request.micro_batch]))
            if request.micro_batch in record.sent:
                reply.sent.CopyFrom(to_proto(record.sent[request.micro_batch]))
            if request.micro_batch in record.gradients:
                reply.gradient.CopyFrom(to_proto(record.gradients[request.micro_batch]))
            return reply

        return serve(context, "Audit", audit)

    def AuditPartial(
        self, request: stage_pb2.AuditRequest, context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.GradientChunk]:
        """A replica's partial gradient of a retained step, before its exchange, in chunks."""

        def partial() -> torch.Tensor:
            stage, record = self._audit_record(request, context, "AuditPartial")
            if record.partial is None:
                raise RpcFailure(
                    grpc.StatusCode.NOT_FOUND, f"{stage.name} kept no partial gradient of step {request.step}"
                )
            return record.partial

        yield from _gradient_chunks(serve(context, "AuditPartial", partial))

    def VerifyPartial(
        self, request_iterator: Iterator[stage_pb2.VerifyPartialRequest], context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.GradientChunk]:
        """Recompute a sibling replica's partial gradient of retained step `step` with this replica's own weights and
        buffers of that step (the replicas of a stage hold the same bits), from the micro-batches the driver sends
        (each naming its index, which with the step seeds its draws): the step lock is held throughout, so the
        weights are the step's."""

        def settled() -> tuple[HostedStage, stage_pb2.VerifyPartialRequest]:
            first = next(request_iterator, None)
            if first is None:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "VerifyPartial needs a first message")
            stage = self._driven(context, first.target, "VerifyPartial")
            if stage.exchange is None:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{stage.name} is not replicated")
            if not stage.step_lock.acquire(timeout=max(0.0, call_deadline(context) - time.monotonic())):
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{stage.name} stayed busy with a step")
            if stage.audit_record is None or stage.audit_record.step != first.step:
                stage.step_lock.release()
                raise RpcFailure(
                    grpc.StatusCode.NOT_FOUND,
                    f"{stage.name} kept nothing of step {first.step}: its weights are not that step's",
                )
            return stage, first

        stage, first = serve(context, "VerifyPartial", settled)
        try:
            def recompute() -> torch.Tensor:
                runtime, a = stage.runtime, stage.assignment
                if not 1 <= first.batch_size <= a.micro_batches * a.max_micro_batch_size:
                    raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"batch_size must be in [1, {a.micro_batches * a.max_micro_batch_size}]")
                items = []
                try:
                    for message in request_iterator:
                        if len(items) == a.micro_batches:
                            raise ValueError(f"more than the job's {a.micro_batches} micro-batches")
                        if not 0 <= message.micro_batch < a.micro_batches or any(
                            message.micro_batch == m for m, _, _ in items
                        ):
                            raise ValueError(f"micro_batch {message.micro_batch} is not one of the job's "
                                             f"{a.micro_batches} or came twice")
                        x = from_proto(message.input, max_bytes=check_layout(
                            "input", message.input, runtime.input_layout, a.max_micro_batch_size
                        ))
                        target = message.labels if stage.io.is_last else message.gradient
                        items.append((message.micro_batch, x, from_proto(target, max_bytes=MAX_MESSAGE_BYTES)))
                    if not items:
                        raise ValueError("no micro-batch to recompute")
                    return runtime.recompute_partial(
                        items, batch_size=first.batch_size, train_step=stage.audit_record.train_step
                    )
                except (ValueError, TensorValidationError) as exc:
                    raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"cannot verify: {exc}") from None

            yield from _gradient_chunks(serve(context, "VerifyPartial", recompute))
        finally:
            stage.step_lock.release()

    def AuditWeights(
        self, request: stage_pb2.AuditRequest, context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.StateChunk]:
        """The weights a retained step's forwards used, as one safetensors file in chunks of a few MiB: the
        stage's own weights, read in place (its optimizer step waits while the record lasts)."""

        def retained() -> HostedStage:
            stage, _ = self._audit_record(request, context, "AuditWeights")
            if not stage.step_lock.acquire(timeout=max(0.0, call_deadline(context) - time.monotonic())):
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{stage.name} stayed busy with a step")
            if stage.audit_record is None or stage.audit_record.step != request.step:  # a step began meanwhile
                stage.step_lock.release()
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"{stage.name} moved on from step {request.step}")
            return stage

        stage = serve(context, "AuditWeights", retained)
        yield from state_stream(stage, include_optimizer_state=False, include_buffers=False)

    def _audit_record(
        self, request: stage_pb2.AuditRequest, context: grpc.ServicerContext, method: str
    ) -> tuple[HostedStage, AuditRecord]:
        stage = self._driven(context, request.target, method)
        if not stage.step_lock.acquire(timeout=max(0.0, call_deadline(context) - time.monotonic())):
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{stage.name} stayed busy with a step")
        try:
            record = stage.audit_record
        finally:
            stage.step_lock.release()
        if record is None or record.step != request.step:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND,
                f"{stage.name} kept nothing of step {request.step}: it keeps only its last train step "
                "run with retain_for_audit",
            )
        return stage, record

    def VerifyForward(
        self, request_iterator: Iterator[stage_pb2.VerifyForwardRequest], context: grpc.ServicerContext
    ) -> stage_pb2.VerifyForwardReply:
        """Recompute layers of a model on an input with given weights (a spot check of another node): the
        weights arrive as a safetensors file in chunks, taken only up to what those layers' weights can
        be, and decoded only once whole."""

        def verify() -> stage_pb2.VerifyForwardReply:
            # Only a driver of a job hosted here, and only for that job's model: a spot check is never a way to
            # have an agent build whatever model a caller sends.
            guard = authorize(
                presented_digest(context), self._registry.guards(), target=None, allowed=DRIVER_ONLY,
                method="VerifyForward",
            )
            first = next(request_iterator, None)
            if first is None:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "VerifyForward needs a first message")
            try:
                config = json.loads(first.model_config_json)
                if not isinstance(config, dict):
                    raise ValueError("model_config_json is not a JSON object")
                if config != guard.model:
                    raise RpcFailure(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "VerifyForward recomputes only the model of the job whose driver calls it",
                    )
                spec = model_spec_from_config(config)
                if not 0 <= first.layer_start < first.layer_end <= spec.num_layers:
                    raise ValueError(
                        f"layer range [{first.layer_start}, {first.layer_end}) is not within the model's "
                        f"{spec.num_layers} layers"
                    )
                # An input the job's own stages could be given, checked before any weights are read.
                input_bytes = check_layout(
                    "input", first.input, spec.input_layout(first.layer_start), guard.max_micro_batch_size
                )
                params = sum(spec.layer_params()[first.layer_start : first.layer_end])
                # fp32 weights and a generous header: a longer file holds something else than those weights.
                limit = 4 * params + HEADER_ALLOWANCE
                weights_file = bytearray(first.weights_chunk)
                for message in request_iterator:
                    weights_file += message.weights_chunk
                    if len(weights_file) > limit:
                        raise ValueError(
                            f"the weights exceed the {limit:,} bytes that layers "
                            f"[{first.layer_start}, {first.layer_end}) of this model take"
                        )
                if len(weights_file) < 4 * params:  # before anything of that size is built
                    raise ValueError(
                        f"the weights hold {len(weights_file):,} bytes; layers [{first.layer_start}, "
                        f"{first.layer_end}) of this model need {4 * params:,}"
                    )
                weights = decode_checkpoint(bytes(weights_file))
                del weights_file
                x = from_proto(first.input, max_bytes=input_bytes)
                precision = check_precision(first.precision or "fp32", "precision")
                out = recompute_forward(config, first.layer_start, first.layer_end, weights, x, self._device, precision)
            except SpecError as exc:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from None
            except (ValueError, TensorValidationError) as exc:  # JSON, tensors, weights or input that do not fit
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"cannot verify: {exc}") from None
            return stage_pb2.VerifyForwardReply(output=to_proto(out))

        return serve(context, "VerifyForward", verify)


def _raise(exc: BaseException) -> None:
    raise exc


def state_stream(stage: HostedStage, **include: bool) -> Iterator[stage_pb2.StateChunk]:
    """The stage's state (`StageRuntime.state_items(**include)`) as one safetensors file in chunks of a few MiB. The
    caller holds the stage's step lock: released after the last chunk, or when the stream ends early."""
    try:
        _, chunks = state_chunks(dict(stage.runtime.state_items(**include)))
        for chunk in chunks:
            yield stage_pb2.StateChunk(data=bytes(chunk))
    finally:
        stage.step_lock.release()


def _gradient_chunks(flat: torch.Tensor) -> Iterator[stage_pb2.GradientChunk]:
    """A flattened gradient in chunks of at most one exchange shard each."""
    step = MAX_SHARD_BYTES // 4
    for start in range(0, flat.numel(), step):
        yield stage_pb2.GradientChunk(start=start, values=to_proto(flat[start : start + step]))


def add_stage_service(servicer: stage_pb2_grpc.StageServiceServicer, server: grpc.Server) -> None:
    """Register `servicer` with pushes parsed by `parse_push` instead of the generated FromString: their
    tensor payloads stay views of the received bytes (no copy on parsing nor on decoding)."""
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    # Registered again, these replace the generated handlers (a later registration wins).
    server.add_registered_method_handlers("arceus.v1.StageService", {
        "PushTensor": grpc.unary_unary_rpc_method_handler(
            servicer.PushTensor, parse_push, stage_pb2.PushTensorReply.SerializeToString
        ),
        "PushStream": grpc.stream_stream_rpc_method_handler(
            servicer.PushStream, parse_push, stage_pb2.PushAck.SerializeToString
        ),
    })
