"""One reusable gRPC channel per stage, and the calls the driver makes on it (each with a deadline)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from arceus.contracts.credentials import join_grant, replica_token, token_digest
from arceus.safetensors_file import CHUNK_BYTES
from arceus.training.plan import StageEndpoint
from arceus.v1 import replica_pb2, replica_pb2_grpc, stage_pb2, stage_pb2_grpc
from arceus.wire import codec
from arceus.wire.channels import MAX_MESSAGE_BYTES, open_channel
from arceus.wire.proto_tensor import from_proto, to_proto
from arceus.wire.push_stream import PushStream, raw_push


@dataclass(frozen=True)
class AuditedStep:
    """What a stage kept of one micro-batch of a retained train step (its weights: `save_audit_weights`)."""

    received: torch.Tensor | None
    sent: torch.Tensor | None
    gradient: torch.Tensor | None = None  # a replica's: the gradient its output received (None on the last stage)


class StageClient:
    def __init__(
        self, endpoint: StageEndpoint, *, job_id: str, generation: int, credential: str, timeout: float
    ) -> None:
        """`credential`: the driver's token of this job generation (arceus.contracts.credentials)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.ref = stage_pb2.StageRef(
            job_id=job_id, stage_index=endpoint.index, generation=generation, replica=endpoint.replica
        )
        self._credential = credential
        self._channel = open_channel(endpoint.address, token=credential, certificate=endpoint.certificate)
        self._stub = stage_pb2_grpc.StageServiceStub(self._channel)
        self._replicas = replica_pb2_grpc.ReplicaServiceStub(self._channel)
        self._pushes = PushStream(self._channel)

    def describe(self) -> str:
        e = self.endpoint
        replica = f" replica {e.replica}" if e.replica else ""
        return f"stage {e.index}{replica} (node {e.node_id} at {e.address})"

    def push(self, kind: int, step: int, micro_batch: int, tensor: torch.Tensor) -> Future[None]:
        """Send over this stage's push stream; the future fails with a PushError (a grpc.RpcError)."""
        dtype, shape, data = codec.encode(tensor)
        push = raw_push(self.ref, kind, step, micro_batch, dtype, shape, data)
        return self._pushes.push(push, self.timeout)

    def step_request(
        self,
        *,
        step: int,
        mode: int,
        num_micro_batches: int,
        schedule: str,
        batch_size: int,
        learning_rate: float,
        retain_for_audit: bool = False,
        replicas: stage_pb2.ReplicaStep | None = None,
        train_step: int = 0,
        data: stage_pb2.StepData | None = None,
        after_step: int = 0,
    ) -> stage_pb2.RunStepRequest:
        """`data`: the step's samples by position, for a first or last stage that reads them itself; `after_step`: the
        step this one is chained after (RunStepRequest.after_step)."""
        return stage_pb2.RunStepRequest(
            target=self.ref,
            step=step,
            mode=mode,
            num_micro_batches=num_micro_batches,
            schedule=schedule,
            batch_size=batch_size,
            learning_rate=learning_rate,
            retain_for_audit=retain_for_audit,
            replicas=replicas,
            train_step=train_step,
            data=data,
            after_step=after_step,
        )

    def run_step(self, **request: object) -> grpc.Future:
        """RunStep of `step_request(**request)`."""
        return self._stub.RunStep.future(self.step_request(**request), timeout=self.timeout)  # type: ignore[arg-type]

    def run_steps(
        self, first: stage_pb2.RunStepRequest, following: list[stage_pb2.WindowStep], *, behind: int = 0
    ) -> grpc.Call:
        """RunSteps of a window (arceus.contracts.step_window): `first`, then `following`, back to back on the agent,
        after the `behind` steps of earlier windows still to run there (`first.after_step` names their last); the call
        (an iterator of each step's reply) may take this client's timeout for each of those steps, and each of its
        own its timeout from when it starts."""
        request = stage_pb2.RunStepsRequest(first=first, next=following, step_seconds=self.timeout)
        return self._stub.RunSteps(request, timeout=self.timeout * (1 + len(following) + behind))

    def copy_state(self, source: StageEndpoint, epoch: int) -> tuple[str, int, str]:
        """Have this (joining) replica copy its stage's state from the live replica `source`, peer to peer; (the
        SHA-256 in hex, the size) of what it copied, and the SHA-256 of the state it then holds. The request carries
        the driver's grant for the roster's membership `epoch`, which `source` checks against the joiner's replica
        token (no other replica may copy it) and against the newest epoch its steps named (a grant of an older
        membership is spent)."""
        peer = stage_pb2.ReplicaPeer(
            stage_index=source.index, replica=source.replica, address=source.address, certificate=source.certificate
        )
        joiner = token_digest(replica_token(self._credential, self.endpoint.index, self.endpoint.replica))
        grant = join_grant(replica_token(self._credential, source.index, source.replica), joiner, epoch)
        request = replica_pb2.CopyStateRequest(target=self.ref, source=peer, grant=grant, epoch=epoch)
        reply = self._replicas.CopyState(request, timeout=self.timeout)
        return reply.sha256, reply.size_bytes, reply.state_sha256

    def holdings(self, step: int, epoch: int) -> grpc.Future:
        """What this replica holds of `step` (a future of its HoldingsReply), answered once its step stopped; from
        the call on it takes nothing of a membership epoch before `epoch` (the roster's, after the loss)."""
        return self._replicas.Holdings.future(replica_pb2.HoldingsRequest(target=self.ref, step=step, epoch=epoch),
                                              timeout=self.timeout)

    def save_state(self, destination: Path, *, include_optimizer_state: bool = True) -> tuple[str, int]:
        """Stream this stage's state into the safetensors file `destination`, a chunk at a time; (its
        SHA-256 in hex, its size). The whole stream shares the call's deadline."""
        request = stage_pb2.GetStateRequest(target=self.ref, include_optimizer_state=include_optimizer_state)
        return _write_chunks(self._stub.GetState(request, timeout=self.timeout), destination)

    def upload_state(self, upload_path: str, *, include_optimizer_state: bool = True) -> tuple[str, int]:
        """Have this stage's agent upload its state to `upload_path` on its control plane itself; (the SHA-256
        in hex, the size) it reports having sent."""
        request = stage_pb2.SaveStateRequest(
            target=self.ref, include_optimizer_state=include_optimizer_state, upload_path=upload_path
        )
        reply = self._stub.SaveState(request, timeout=self.timeout)
        return reply.sha256, reply.size_bytes

    def audit(self, step: int, micro_batch: int) -> AuditedStep:
        """The activations this stage received (None on the first stage) and sent (None on the last) for
        `micro_batch` of `step`."""
        request = stage_pb2.AuditRequest(target=self.ref, step=step, micro_batch=micro_batch)
        reply = self._stub.Audit(request, timeout=self.timeout)
        received = from_proto(reply.received, max_bytes=MAX_MESSAGE_BYTES) if reply.HasField("received") else None
        sent = from_proto(reply.sent, max_bytes=MAX_MESSAGE_BYTES) if reply.HasField("sent") else None
        gradient = from_proto(reply.gradient, max_bytes=MAX_MESSAGE_BYTES) if reply.HasField("gradient") else None
        return AuditedStep(received, sent, gradient)

    def audit_partial(self, step: int, elements: int) -> torch.Tensor:
        """This replica's partial gradient of retained step `step`, before its exchange: `elements` float32
        values (ValueError for chunks that do not tile exactly that many)."""
        request = stage_pb2.AuditRequest(target=self.ref, step=step)
        return _gradient(self._stub.AuditPartial(request, timeout=self.timeout), elements)

    def verify_partial(
        self, step: int, batch_size: int, micro_batches: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
        elements: int, *, last: bool,
    ) -> torch.Tensor:
        """This (sibling) replica recomputes, with its own weights and buffers of retained step `step`, the partial
        vector (gradients, and buffer changes where the layers have buffers) of `micro_batches` ((index, input, the
        gradient its output received) each; (index, input, labels) on the `last` stage) of a step of `batch_size`
        samples: `elements` float32 values."""

        def requests() -> Iterator[stage_pb2.VerifyPartialRequest]:
            yield stage_pb2.VerifyPartialRequest(target=self.ref, step=step, batch_size=batch_size)
            for micro_batch, x, target in micro_batches:
                yield stage_pb2.VerifyPartialRequest(
                    micro_batch=micro_batch, input=to_proto(x), **{"labels" if last else "gradient": to_proto(target)}
                )

        return _gradient(self._stub.VerifyPartial(requests(), timeout=self.timeout), elements)

    def save_audit_weights(self, step: int, destination: Path) -> tuple[str, int]:
        """Stream the weights this stage's forwards used in `step` into a safetensors file, a chunk at a
        time; (its SHA-256 in hex, its size)."""
        request = stage_pb2.AuditRequest(target=self.ref, step=step)
        return _write_chunks(self._stub.AuditWeights(request, timeout=self.timeout), destination)

    def verify_forward(
        self,
        model_json: str,
        layer_start: int,
        layer_end: int,
        weights: Path,
        x: torch.Tensor,
        precision: str = "fp32",
    ) -> torch.Tensor:
        """This stage's agent recomputes layers [layer_start, layer_end) with the weights in the safetensors
        file `weights` (streamed to it a chunk at a time) on `x`."""

        def requests() -> Iterator[stage_pb2.VerifyForwardRequest]:
            yield stage_pb2.VerifyForwardRequest(
                model_config_json=model_json, layer_start=layer_start, layer_end=layer_end, input=to_proto(x),
                precision=precision,
            )
            with weights.open("rb") as handle:
                while chunk := handle.read(CHUNK_BYTES):
                    yield stage_pb2.VerifyForwardRequest(weights_chunk=chunk)

        reply = self._stub.VerifyForward(requests(), timeout=self.timeout)
        return from_proto(reply.output, max_bytes=MAX_MESSAGE_BYTES)

    def infer(self, session: str, start: int, x: torch.Tensor) -> torch.Tensor:
        """This stage's output for positions [start, start + t) of `session`'s sequence (see `Infer`)."""
        request = stage_pb2.InferRequest(target=self.ref, session=session, start=start, input=to_proto(x))
        reply = self._stub.Infer(request, timeout=self.timeout)
        return from_proto(reply.output, max_bytes=MAX_MESSAGE_BYTES)

    def close(self) -> None:
        self._pushes.close()
        self._channel.close()


def _write_chunks(chunks: Iterable[stage_pb2.StateChunk], destination: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with destination.open("wb") as out:
        for chunk in chunks:
            out.write(chunk.data)
            digest.update(chunk.data)
            size += len(chunk.data)
    return digest.hexdigest(), size


def _gradient(chunks: Iterable[stage_pb2.GradientChunk], elements: int) -> torch.Tensor:
    """A flattened gradient of `elements` float32 values from its chunks, in order and without gaps."""
    out = torch.empty(elements, dtype=torch.float32)
    filled = 0
    for chunk in chunks:
        if chunk.start != filled or list(chunk.values.shape)[:1] == [] or chunk.values.dtype != "float32":
            raise ValueError(f"a gradient chunk at element {chunk.start}; expected one at {filled}")
        length = chunk.values.shape[0]
        if filled + length > elements:
            raise ValueError(f"gradient chunks hold more than the stage's {elements} elements")
        out[filled : filled + length] = from_proto(chunk.values, max_bytes=4 * length).reshape(-1)
        filled += length
    if filled != elements:
        raise ValueError(f"gradient chunks hold {filled} of the stage's {elements} elements")
    return out
