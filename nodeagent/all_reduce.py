"""The all-reduce of a tensor-parallel stage over gRPC: this agent's rank, channels to its peers, and a
mailbox for the partial sums they push (`TensorParallelService.PushPartial`).

The torch side (`arceus.model.sharding`) only sees `TensorParallelGroup.all_reduce`. Every
all-reduce is keyed by (step, micro_batch, op): the step (`nodeagent.step.StepRun`) names the micro-batch around its
forward and backward (`group.micro_batch(...)`), and `op` counts that micro-batch's all-reduces, which
every rank runs in the same order because every rank runs the same code on the same schedule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import StageCredentials
from arceus.model.layout import TensorLayout
from arceus.model.registry import reduced_layout
from arceus.model.sharding import Shard
from arceus.v1 import stage_pb2, tensor_parallel_pb2, tensor_parallel_pb2_grpc
from arceus.wire import codec
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import from_proto, to_proto
from nodeagent.callers import Guard
from nodeagent.mailbox import Mailbox, MailboxCancelled, MailboxClosed, MailboxFull, MailboxTimeout
from nodeagent.rpc import RpcFailure, neighbour_failure

# A peer blocks on each all-reduce until it has every partial, so it runs at most one op ahead of us:
# a few partials per peer is all that can legitimately be waiting.
_PENDING_PER_PEER = 4


@dataclass
class _Current:
    step: int
    micro_batch: int
    deadline: float
    abort: threading.Event | None


class TensorParallelGroup:
    def __init__(
        self,
        *,
        job_id: str,
        stage_index: int,
        generation: int,
        rank: int,
        peers: Sequence[str],
        layout: TensorLayout,
        micro_batches: int,
        max_micro_batch_size: int,
        max_message_bytes: int,
        credentials: StageCredentials,
        model: dict[str, Any],
        certificates: Mapping[str, str],
    ) -> None:
        """`peers` are the addresses of every rank, this one's included (at `rank`); `layout` is the
        per-sample layout of what is reduced (the stage's hidden activations); `credentials`: the rank's
        token for its peers, and theirs it accepts; `certificates`: each peer's registered TLS certificate."""
        self.shard = Shard(rank, len(peers))
        if len(set(peers)) != len(peers):
            raise ValueError(f"tensor-parallel peers must be distinct addresses, got {list(peers)}")
        self.job_id, self.stage_index, self.generation = job_id, stage_index, generation
        self.guard = Guard(job_id, stage_index, generation, credentials, model, max_micro_batch_size)
        self.peers = list(peers)
        self._layout = layout
        self._micro_batches = micro_batches
        self._max_micro_batch_size = max_micro_batch_size
        self._mailbox: Mailbox[torch.Tensor] = Mailbox(_PENDING_PER_PEER * max(1, len(peers) - 1))
        self._channels = {
            r: open_channel(
                address, token=credentials.token, certificate=certificates[address], max_message_bytes=max_message_bytes
            )
            for r, address in enumerate(peers)
            if r != rank
        }
        self._stubs = {r: tensor_parallel_pb2_grpc.TensorParallelServiceStub(c) for r, c in self._channels.items()}
        self._current: _Current | None = None
        self._ops: dict[tuple[int, int], int] = {}

    @property
    def name(self) -> str:
        return f"{self.job_id} stage {self.stage_index} rank {self.shard.rank}/{self.shard.size}"

    @contextmanager
    def micro_batch(
        self, step: int, micro_batch: int, *, deadline: float, abort: threading.Event | None = None
    ) -> Iterator[None]:
        """All-reduces inside belong to (step, micro_batch) and must finish by `deadline` (monotonic)."""
        if any(s != step for s, _ in self._ops):  # a new step: earlier steps' counters and partials go
            self._ops = {key: n for key, n in self._ops.items() if key[0] == step}
            self._mailbox.retain_step(step)
        self._current = _Current(step, micro_batch, deadline, abort)
        try:
            yield
        finally:
            self._current = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor`, added in rank order so every rank gets the same bits."""
        current = self._current
        if current is None:
            raise RuntimeError(f"{self.name}: an all-reduce outside of group.micro_batch(...)")
        key = (current.step, current.micro_batch)
        op = self._ops.get(key, 0)
        self._ops[key] = op + 1
        request = tensor_parallel_pb2.PushPartialRequest(
            target=stage_pb2.StageRef(job_id=self.job_id, stage_index=self.stage_index, generation=self.generation),
            step=current.step,
            micro_batch=current.micro_batch,
            op=op,
            source_rank=self.shard.rank,
        )
        request.tensor.CopyFrom(to_proto(tensor.detach().float().cpu()))
        # Peers may still be starting or building the stage: wait for them, within the deadline.
        sends = {
            r: stub.PushPartial.future(request, timeout=_remaining(current), wait_for_ready=True)
            for r, stub in self._stubs.items()
        }
        partials = {self.shard.rank: tensor}
        for r in sorted(self._stubs):
            partials[r] = self._receive(current, op, r).to(tensor.device)
            if partials[r].shape != tensor.shape:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.name}: all-reduce {op} of step {current.step} micro-batch {current.micro_batch}: "
                    f"rank {r} sent shape {list(partials[r].shape)}, this rank has {list(tensor.shape)}",
                )
        for r, sent in sends.items():
            try:
                sent.result()
            except grpc.RpcError as exc:
                raise neighbour_failure(exc, f"{self.name}: pushing a partial to rank {r} ({self.peers[r]})") from None
        # Summed in float32 whatever the compute dtype: under bf16 autocast this rank's own partial is
        # bfloat16 while its peers' arrive as float32 (exactly the same values), and an in-place sum that
        # started from a bfloat16 partial would round where a rank starting from a peer's would not. In
        # float32, in rank order, every rank adds the same numbers in the same order: the same bits.
        total = partials[0].to(torch.float32, copy=True)
        for r in range(1, self.shard.size):
            total += partials[r]
        return total.to(tensor.dtype)

    def _receive(self, current: _Current, op: int, source: int) -> torch.Tensor:
        try:
            return self._mailbox.get(
                _mail_key(current.step, current.micro_batch, op, source), _remaining(current), current.abort
            )
        except MailboxTimeout:
            raise RpcFailure(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{self.name}: rank {source} ({self.peers[source]}) sent no partial for all-reduce {op} of "
                f"step {current.step} micro-batch {current.micro_batch}",
            ) from None
        except MailboxClosed:
            raise RpcFailure(grpc.StatusCode.ABORTED, f"{self.name} was removed mid-step") from None
        except MailboxCancelled:
            raise RpcFailure(grpc.StatusCode.CANCELLED, f"{self.name}: the step was cancelled") from None

    def accept(self, request: tensor_parallel_pb2.PushPartialRequest) -> None:
        """Validate a peer's partial (before torch sees it) and park it for `all_reduce`."""
        tensor = self._decode(request)
        try:
            self._mailbox.put(_mail_key(request.step, request.micro_batch, request.op, request.source_rank), tensor)
        except MailboxFull as exc:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name}: {exc}") from None
        except MailboxClosed:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"{self.name} was just removed from this agent") from None

    def _decode(self, request: tensor_parallel_pb2.PushPartialRequest) -> torch.Tensor:
        size, rank = self.shard.size, self.shard.rank
        if request.step < 0 or request.op < 0:
            raise _invalid(f"step and op must be >= 0, got step {request.step}, op {request.op}")
        if not 0 <= request.micro_batch < self._micro_batches:
            raise _invalid(f"micro_batch must be in [0, {self._micro_batches}), got {request.micro_batch}")
        if not 0 <= request.source_rank < size or request.source_rank == rank:
            raise _invalid(f"source_rank must be another rank of [0, {size}) than {rank}, got {request.source_rank}")
        if not request.HasField("tensor"):
            raise _invalid("the request carries no tensor")
        message, layout = request.tensor, self._layout
        if message.encoding or message.dtype != layout.dtype:
            raise _invalid(f"partials are uncompressed {layout.dtype}, got {message.dtype!r} {message.encoding!r}")
        shape = list(message.shape)
        if len(shape) != 1 + len(layout.shape) or shape[1:] != list(layout.shape):
            wanted = ", ".join(str(d) for d in layout.shape)
            raise _invalid(f"a partial must have shape [batch, {wanted}], got {shape}")
        if not 1 <= shape[0] <= self._max_micro_batch_size:
            raise _invalid(f"batch dimension must be in [1, {self._max_micro_batch_size}], got {shape[0]}")
        try:
            return from_proto(message, max_bytes=self._max_micro_batch_size * layout.nbytes)
        except codec.TensorValidationError as exc:
            raise _invalid(f"partial rejected: {exc}") from exc

    def close(self) -> None:
        self._mailbox.close()
        for channel in self._channels.values():
            channel.close()


def stage_group(assignment: Assignment, *, max_message_bytes: int) -> TensorParallelGroup | None:
    """The group of a tensor-parallel stage's assignment (None for a one-agent stage)."""
    config = assignment.tensor_parallel
    if config is None:
        return None
    return TensorParallelGroup(
        job_id=assignment.job_id,
        stage_index=assignment.stage_index,
        generation=assignment.generation,
        rank=config.rank,
        peers=config.peers,
        layout=reduced_layout(assignment.spec),
        micro_batches=assignment.micro_batches,
        max_micro_batch_size=assignment.max_micro_batch_size,
        max_message_bytes=max_message_bytes,
        credentials=assignment.credentials,
        model=assignment.model,
        certificates=assignment.certificates,
    )


class TensorParallelGroups:
    """The groups of the tensor-parallel stages this agent hosts, by (job_id, stage_index)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, int], TensorParallelGroup] = {}

    def add(self, group: TensorParallelGroup) -> None:
        """Host `group`, replacing (and closing) one of another generation of the same stage."""
        with self._lock:
            old = self._groups.get((group.job_id, group.stage_index))
            self._groups[(group.job_id, group.stage_index)] = group
        if old is not None and old is not group:
            old.close()

    def remove(self, group: TensorParallelGroup) -> None:
        with self._lock:
            if self._groups.get((group.job_id, group.stage_index)) is group:
                del self._groups[(group.job_id, group.stage_index)]
        group.close()

    def resolve(self, target: stage_pb2.StageRef) -> TensorParallelGroup:
        with self._lock:
            group = self._groups.get((target.job_id, target.stage_index))
        if group is None:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND,
                f"no tensor-parallel group of job {target.job_id!r} stage {target.stage_index} here",
            )
        if group.generation != target.generation:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{group.name} is at generation {group.generation}, not {target.generation}",
            )
        return group

    def guards(self) -> list[Guard]:
        with self._lock:
            return [group.guard for group in self._groups.values()]

    def close(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.close()


def _mail_key(step: int, micro_batch: int, op: int, source: int) -> tuple[int, str, int]:
    return (step, f"partial {op} from rank {source}", micro_batch)


def _remaining(current: _Current) -> float:
    return max(0.0, current.deadline - time.monotonic())


def _invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)
