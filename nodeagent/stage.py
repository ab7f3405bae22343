"""A stage hosted by this agent: its assignment, torch runtime, mailbox and links to its neighbours."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

import grpc
import torch

from arceus.contracts.assignment import Assignment, CheckpointRef, InitialWeightsRef
from arceus.contracts.credentials import REPLICA_METADATA_KEY
from arceus.model.build import build_layers
from arceus.model.hugging_face import initial_weights_slice_bytes
from arceus.model.registry import architecture_of
from arceus.model.tensor_parallel import build_parallel_layers, slice_state_tensors
from arceus.swarm.outer import OuterSync, sync_elements, synced_buffers
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2
from arceus.wire.channels import open_channel
from arceus.wire.push_stream import PushStream
from arceus.wire.transfer import TransferEncoder
from nodeagent.all_reduce import TensorParallelGroup
from nodeagent.callers import Guard
from nodeagent.inference import DecodeSessions
from nodeagent.lending import LendingGauge
from nodeagent.mailbox import Mailbox
from nodeagent.neighbour_stream import NeighbourStreams
from nodeagent.peer_streams import PeerStreams
from nodeagent.repair import HeldStep
from nodeagent.replicas import ReplicaExchange
from nodeagent.rpc import RpcFailure, neighbour_failure
from nodeagent.runtime import StageRuntime
from nodeagent.stage_io import StageIO
from nodeagent.tied import TiedGradients
from nodeagent.verify import AuditRecord

# How often a RunStep waiting for the step it is chained after looks whether its own call was cancelled.
CHAIN_POLL_SECONDS = 0.05


class NeighbourLink:
    """One channel to a neighbouring stage and one long-lived push stream on it, for this stage's
    lifetime."""

    def __init__(
        self, address: str, max_message_bytes: int, token: str, certificate: str, replica_token: str = ""
    ) -> None:
        """`token`: this stage's own (arceus.contracts.credentials), which the neighbour accepts; `certificate`: the
        one the neighbour's agent registered, the only one trusted at `address`; `replica_token`: a replica's own,
        which its pushes present too, so the replica they reach knows which replica sent them (nodeagent.membership)."""
        self.address = address
        self.channel = open_channel(
            address, token=token, certificate=certificate, max_message_bytes=max_message_bytes
        )
        metadata = ((REPLICA_METADATA_KEY, replica_token),) if replica_token else ()
        self.pushes = PushStream(self.channel, metadata=metadata)
        self.replicas = replica_pb2_grpc.ReplicaServiceStub(self.channel)  # used between siblings only

    def close(self) -> None:
        self.pushes.close()
        self.channel.close()


class HostedStage:
    def __init__(
        self,
        assignment: Assignment,
        runtime: StageRuntime,
        *,
        max_message_bytes: int,
        tensor_parallel: TensorParallelGroup | None = None,
        streams: PeerStreams | None = None,
        read_dataset: DatasetReader | None = None,
    ) -> None:
        """`streams`: the agent's exchange streams, which a replica of a replicated stage exchanges over;
        `read_dataset`: how stage 0 and the last stage read an uploaded dataset's rows (None: they cannot)."""
        self.assignment = assignment
        self.read_dataset = read_dataset
        # Samples of a chained step read while the step before computes, by its call id (nodeagent/step_samples.py).
        self.samples_ahead: dict[int, Future] = {}
        self.tensor_parallel = tensor_parallel
        self.runtime = runtime
        self.transfer = TransferEncoder(assignment.transfer)  # holds top-k error feedback
        spec = assignment.spec
        self.io = StageIO(
            input_layout=spec.input_layout(assignment.layer_start),
            output_layout=spec.output_layout(assignment.layer_end - 1),
            label_layout=spec.label_layout(),
            max_micro_batch_size=assignment.max_micro_batch_size,
            micro_batches=assignment.micro_batches,
            schedule=assignment.schedule,
            stage_index=assignment.stage_index,
            num_stages=assignment.num_stages,
            is_first=assignment.is_first,
            is_last=assignment.is_last,
        )
        # A step holds at most one activation, gradient and label per micro-batch; the rest is slack
        # for early arrivals of the next step. The cap bounds what a misbehaving peer can park here.
        # The tied weights' gradients it exchanges with the stages sharing them (nodeagent.tied), one a copy a step.
        self.tied = TiedGradients(assignment, spec)
        # With staleness 1 two steps overlap here (nodeagent.step): room for the second one's.
        self.mailbox: Mailbox[torch.Tensor] = Mailbox(
            capacity=(4 + 3 * assignment.staleness) * assignment.micro_batches + 8 + 2 * self.tied.mailbox_slots()
        )
        self.step_lock = threading.Lock()
        # The RunStep that ended here last (its call id, and whether it finished): what a step chained after it waits
        # for (`wait_for_step`). The RunSteps running under one hold of `step_lock` (two where staleness 1 overlaps
        # them, `step_join`), and the last whose forwards were all done (0 once it failed).
        self._ended = threading.Condition()
        self._last_step: tuple[int, bool] | None = None
        self._running: list[int] = []
        self._forwards_done = 0
        # A link to every rank of each neighbour: each rank of a tensor-parallel stage takes its inputs.
        token, certificates = assignment.credentials.token, assignment.certificates
        self.next_links = [
            NeighbourLink(address, max_message_bytes, token, certificates[address])
            for address in assignment.next_addresses
        ]
        self.prev_links = [
            NeighbourLink(address, max_message_bytes, token, certificates[address])
            for address in assignment.prev_addresses
        ]
        self.tied_links = {
            peer.stage_index: [
                NeighbourLink(address, max_message_bytes, token, certificates[address]) for address in peer.addresses
            ]
            for peer in assignment.tied
        }
        self._bytes_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        # The activations and gradients to and from one-agent neighbours travel on streams of their own
        # (nodeagent.neighbour_stream); the links above carry the rest.
        self.neighbours = NeighbourStreams(
            assignment, self.io, self.name, streams, self.next_links[0].channel if self.next_links else None,
            (self.add_bytes_sent, self.add_bytes_received),
        )
        # The last train step's activations and weights, kept for spot checks (retain_for_audit).
        self.audit_record: AuditRecord | None = None
        self.deferred_step: int | None = None  # the step whose optimizer step waits (StepRun), where one does
        # A replica's train step, kept until the next step commits it: what a repair after a loss resumes from.
        self.held_step: HeldStep | None = None
        self.lending = LendingGauge()  # whether borrowing idle cores pays, learnt from this stage's steps
        # Whose calls the stage accepts (nodeagent.callers): made once, read on every call.
        a = assignment
        self.guard = Guard(a.job_id, a.stage_index, a.generation, a.credentials, a.model, a.max_micro_batch_size)
        self.decoding = DecodeSessions(runtime)  # the sequences samplers decode through this stage
        # A replica of a replicated stage: links to the replicas its steps name, opened as they are first named
        # (address, certificate) -> link (its siblings' exchange runs over streams of its own: `exchange`).
        self._max_message_bytes = max_message_bytes
        self._replica_links: dict[tuple[str, str], NeighbourLink] = {}
        self._links_lock = threading.Lock()
        # Replicas that sync every H steps exchange their weight deltas and optimizer state (arceus.swarm.outer).
        # The exact exchange sums gradients and buffer changes (StageRuntime.gradient_vector).
        elements = runtime.exchange_elements()
        if not a.replica_sync.exact and runtime.optimizer_name is not None:
            buffers = sum(b.numel() for b in synced_buffers(runtime.buffers.buffers))
            elements = sync_elements(
                sum(p.numel() for p in runtime.layers.parameters()), runtime.optimizer_name, buffers
            )
        if a.replica is not None and streams is None:
            raise ValueError(f"{a.stage_id} is a replica: it needs the agent's exchange streams")
        self.exchange = None if a.replica is None or streams is None else ReplicaExchange(
            job_id=a.job_id, stage_index=a.stage_index, generation=a.generation, replica=a.replica,
            token=a.credentials.replica_token, total_elements=elements, max_replicas=a.micro_batches, streams=streams,
        )
        self.outer_sync: OuterSync | None = None  # made at the first train step of replicas syncing every H steps

    @property
    def name(self) -> str:
        a = self.assignment
        return f"stage {a.stage_index} of job {a.job_id} (generation {a.generation})"

    def ref(self, stage_index: int, replica: int = 0) -> stage_pb2.StageRef:
        """The StageRef of stage `stage_index` (its replica `replica`) of this stage's pipeline."""
        return stage_pb2.StageRef(
            job_id=self.assignment.job_id, stage_index=stage_index, generation=self.assignment.generation,
            replica=replica,
        )

    def replica_link(self, peer: stage_pb2.ReplicaPeer) -> NeighbourLink:
        """The link to a replica a step names (kept for the stage's lifetime: the same replicas serve step after
        step)."""
        key = (peer.address, peer.certificate)
        with self._links_lock:
            link = self._replica_links.get(key)
            if link is None:
                credentials = self.assignment.credentials
                link = NeighbourLink(peer.address, self._max_message_bytes, credentials.token, peer.certificate,
                                     credentials.replica_token)
                self._replica_links[key] = link
            return link

    def exchange_port(self, peer: stage_pb2.ReplicaPeer, deadline: float, epoch: int) -> int:
        """The port of the exchange listener of the sibling `peer` (ReplicaService.ExchangePort), answered once the
        sibling learnt membership `epoch`."""
        ref = self.ref(self.assignment.stage_index, peer.replica)
        try:
            reply = self.replica_link(peer).replicas.ExchangePort(
                replica_pb2.ExchangePortRequest(target=ref, epoch=epoch),
                timeout=max(0.05, deadline - time.monotonic()),
                metadata=((REPLICA_METADATA_KEY, self.assignment.credentials.replica_token),),
            )
        except grpc.RpcError as exc:
            raise neighbour_failure(exc, f"{self.name}: asking replica {peer.replica} for its exchange port") from None
        return reply.port

    def add_bytes_sent(self, n: int) -> None:
        with self._bytes_lock:
            self.bytes_sent += n

    def add_bytes_received(self, n: int) -> None:
        with self._bytes_lock:
            self.bytes_received += n

    def step_start(self, step: int, wait: float) -> None:
        """Take the step lock for RunStep `step`, within `wait` seconds (0: only if it is free); ABORTED if it stays
        taken. `step_end` gives it back."""
        acquired = self.step_lock.acquire(timeout=wait) if wait > 0 else self.step_lock.acquire(blocking=False)
        if not acquired:
            raise RpcFailure(grpc.StatusCode.ABORTED, f"{self.name} is already running a step")
        with self._ended:
            self._running.append(step)
            self._forwards_done = 0

    def step_join(self, step: int, after: int, deadline: float, abort: threading.Event) -> None:
        """Staleness 1: start RunStep `step`, chained after `after`, once `after`'s forwards are all done here (or it
        finished) and no other step runs here: beside `after`, under its hold of the step lock, or alone, taking it.
        Two steps at most run at once, so the weights have two versions at most (nodeagent.runtime). ABORTED if
        `after` failed here, CANCELLED once `abort` is set, DEADLINE_EXCEEDED at `deadline`."""
        with self._ended:
            while True:
                if self._last_step == (after, False):
                    raise RpcFailure(grpc.StatusCode.ABORTED,
                                     f"step {after} failed on {self.name}: the step chained after it does not run")
                started = self._last_step == (after, True) or self._forwards_done == after
                if started and (
                    self._running == [after] or not self._running and self.step_lock.acquire(blocking=False)
                ):
                    self._running.append(step)
                    self._forwards_done = 0
                    return
                if abort.is_set():
                    raise RpcFailure(grpc.StatusCode.CANCELLED, f"a step chained after step {after} was cancelled")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"{self.name} waited for the forwards of step {after}, which a step is chained "
                                     "after; they were never done")
                self._ended.wait(min(remaining, CHAIN_POLL_SECONDS))

    def forwards_done(self, step: int) -> None:
        """Every forward of train step `step` is done here: with staleness 1, the step chained after it may start."""
        with self._ended:
            self._forwards_done = step
            self._ended.notify_all()

    def step_end(self, step: int, finished: bool) -> None:
        """RunStep `step` ended here (`finished`: its update done; else it failed): a step chained after it may run.
        The last of the steps running gives the step lock back."""
        with self._ended:
            self._last_step = (step, finished)
            if not finished and self._forwards_done == step:
                self._forwards_done = 0
            self._running.remove(step)
            if not self._running:
                self.step_lock.release()
            self._ended.notify_all()

    def wait_for_step(self, step: int, deadline: float, abort: threading.Event) -> None:
        """Return once RunStep `step` finished here (for a step chained after it: `RunStepRequest.after_step`; call ids
        are a driver's own, so any other step that ran here says nothing of it). ABORTED if it failed here, CANCELLED
        once `abort` is set, DEADLINE_EXCEEDED at `deadline` (a time.monotonic() value)."""
        with self._ended:
            while True:
                last = self._last_step
                if last is not None and last[0] == step:
                    if last[1]:
                        return
                    raise RpcFailure(grpc.StatusCode.ABORTED,
                                     f"step {step} failed on {self.name}: the step chained after it does not run")
                if abort.is_set():
                    raise RpcFailure(grpc.StatusCode.CANCELLED, f"a step chained after step {step} was cancelled")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"{self.name} waited for step {step}, which a step is chained after; it never ran")
                self._ended.wait(min(remaining, CHAIN_POLL_SECONDS))

    def hold_between_steps(self, timeout: float) -> None:
        """Take the step lock (within `timeout` seconds) and apply any deferred optimizer step: the state is then
        the one after the last step, never half updated. The caller releases the lock."""
        if not self.step_lock.acquire(timeout=max(0.0, timeout)):
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name} stayed busy with a step")
        try:
            self.settle()
        except BaseException:
            self.step_lock.release()
            raise

    def settle(self) -> None:
        """Apply a deferred optimizer step (see StepRun): the weights move on, so what an audit of the
        last step would read is gone. Called with the step lock held, before anything reads or trains."""
        self.deferred_step = None
        self.drop_held_step()
        if self.runtime.settle():
            self.audit_record = None

    def drop_held_step(self) -> None:
        """Let go of a replica's held step (nodeagent.repair): committed, or abandoned. One that stopped unfinished
        takes its graphs and partial gradient with it (the driver runs the step again under another id)."""
        held, self.held_step = self.held_step, None
        if held is not None and not held.finished:
            self.runtime.abort_step()

    def counters(self) -> stage_pb2.StageCounters:
        c = self.runtime.counters
        with self._bytes_lock:
            return stage_pb2.StageCounters(
                samples=c.samples,
                micro_batches=c.micro_batches,
                compute_seconds=c.compute_seconds,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
            )

    def close(self) -> None:
        """Wake anyone waiting on this stage's mailbox and close its channels."""
        self.mailbox.close()
        self.neighbours.close()
        if self.exchange is not None:
            self.exchange.close()
        with self._links_lock:
            replica_links = list(self._replica_links.values())
        tied_links = [link for links in self.tied_links.values() for link in links]
        for link in (*self.next_links, *self.prev_links, *tied_links, *replica_links):
            link.close()


# An exported model's layer documents: (the assignment's program path, layer_start, layer_end) -> one document
# per layer, in order (checked against their hashes when the layers are built).
ProgramLoader = Callable[[str, int, int], list[str]]

# A stage's checkpoint by its reference: a mapping that may load each tensor only when asked (StateFile).
CheckpointLoader = Callable[[CheckpointRef], Mapping[str, torch.Tensor]]

# Layers [layer_start, layer_end) of a job's uploaded weights under the pipeline's names, each layer checked against
# its digest in the reference: (reference, layer_start, layer_end, the most bytes the slice may take). Lazy as above.
InitialWeightsLoader = Callable[[InitialWeightsRef, int, int, int], Mapping[str, torch.Tensor]]


# Byte ranges of the uploaded dataset of a job, read through the control plane for a stage that reads its samples
# (nodeagent/step_samples.py): (job id, [(start, stop), ...]) → each range's bytes, as the reader got them (checked by
# the caller). Raises DatasetReadError.
DatasetReader = Callable[[str, list[tuple[int, int]]], list[bytes]]


class DatasetReadError(RuntimeError):
    """A dataset's byte ranges could not be read (the message says why)."""


class StateUploadError(RuntimeError):
    """A stage's state could not be uploaded to the control plane (the message says why)."""


# Upload a stage's state file for a checkpoint upload at a path on the agent's control plane: (path, size in bytes,
# a function giving the file's chunks afresh on each call (an upload the server failed is sent again), seconds
# allowed) → the SHA-256 (hex) of the bytes sent. Raises StateUploadError.
StateUploader = Callable[[str, int, Callable[[], Iterable[bytes | memoryview]], float], str]


def build_hosted_stage(
    assignment: Assignment,
    device: torch.device,
    *,
    max_message_bytes: int,
    load_checkpoint: CheckpointLoader | None = None,
    tensor_parallel: TensorParallelGroup | None = None,
    load_program: ProgramLoader | None = None,
    load_initial_weights: InitialWeightsLoader | None = None,
    streams: PeerStreams | None = None,
    read_dataset: DatasetReader | None = None,
) -> HostedStage:
    """Build the stage from its declarative spec only: layers [start, end) initialised from the seed,
    then, if the assignment names a checkpoint, its weights and optimizer state loaded from it, else, if it
    names the job's uploaded initial weights, the stage's layers of those (fetched alone). A stage served for
    inference (`assignment.inference`) has no optimizer and loads only the checkpoint's weights. A rank of
    a tensor-parallel stage (`tensor_parallel`) builds, and loads, its shard of the layers. An exported model's
    layers are built from their documents (`load_program`), each checked, operators included, before anything
    of it is built."""
    spec = assignment.spec
    start, end = assignment.layer_start, assignment.layer_end
    if architecture_of(spec).ships_program:
        if assignment.program is None or load_program is None:
            missing = "its assignment names no program" if load_program else "this agent cannot fetch programs"
            raise ValueError(f"{assignment.stage_id} is a stage of an exported model, but {missing}")
        documents = load_program(assignment.program, start, end)
        spec = spec.with_documents(dict(zip(range(start, end), documents, strict=True)))
    if tensor_parallel is None:
        layers = build_layers(spec, assignment.layer_start, assignment.layer_end, assignment.seed)
    else:
        layers = build_parallel_layers(
            spec,
            assignment.layer_start,
            assignment.layer_end,
            assignment.seed,
            tensor_parallel.shard,
            tensor_parallel.all_reduce,
        )
    runtime = StageRuntime(
        layers,
        optimizer=None if assignment.inference else assignment.optimizer,
        is_first=assignment.is_first,
        is_last=assignment.is_last,
        input_layout=spec.input_layout(assignment.layer_start),
        max_micro_batch_size=assignment.max_micro_batch_size,
        device=device,
        precision=assignment.precision,
        activation_checkpointing=assignment.activation_checkpointing,
        seed=assignment.seed,
    )
    tensors: Mapping[str, torch.Tensor] | None = None
    uploaded = False  # the job's uploaded weights, which may be a Hugging Face checkpoint's bf16 or fp16
    if assignment.checkpoint is not None:
        if load_checkpoint is None:
            raise ValueError(f"{assignment.stage_id} resumes from a checkpoint, but this agent cannot fetch one")
        tensors = load_checkpoint(assignment.checkpoint)
    elif assignment.initial_weights is not None:
        if load_initial_weights is None:
            raise ValueError(f"{assignment.stage_id} starts from uploaded weights, but this agent cannot fetch them")
        bound = initial_weights_slice_bytes(spec, start, end)
        tensors, uploaded = load_initial_weights(assignment.initial_weights, start, end, bound), True
    if tensors is not None:  # both are of the unsplit stage
        if tensor_parallel is not None:
            tensors = slice_state_tensors(spec, tensor_parallel.shard, tensors)
        runtime.load_state_tensors(tensors, widen=uploaded)
    return HostedStage(assignment, runtime, max_message_bytes=max_message_bytes, tensor_parallel=tensor_parallel,
                       streams=streams, read_dataset=read_dataset)
