"""`PushTracker`: the outstanding sends of one step, each to every rank of a neighbour. The first failure
sets the step's `abort` so its waits stop early; the step ends only once every send is delivered."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc
import torch

from arceus.v1 import stage_pb2
from arceus.wire.compression import Encoded
from arceus.wire.push_stream import PushError, outgoing_push
from nodeagent.rpc import RpcFailure, neighbour_failure_code
from nodeagent.stage import HostedStage, NeighbourLink

log = logging.getLogger(__name__)

MIN_CALL_TIMEOUT = 0.05
# How often a wait for sends looks whether its step was aborted (the abort wakes no condition of its own).
ABORT_POLL_SECONDS = 0.05


class PushTracker:
    """Outstanding pushes of one step. The first failure sets `abort` so waits stop early."""

    def __init__(self, stage: HostedStage, step: int, deadline: float, abort: threading.Event, *, epoch: int) -> None:
        """`epoch`: a replica's membership epoch in this step, which its pushes name (0: the stage is not
        replicated)."""
        self._stage = stage
        self._step = step
        self._epoch = epoch
        self._deadline = deadline
        self._abort = abort
        self._futures: list[Future[None]] = []
        self._cond = threading.Condition()
        self._pending = 0  # pushes whose completion has not been accounted for yet
        self.failure: RpcFailure | None = None

    def send(
        self,
        links: Sequence[NeighbourLink],
        target_index: int,
        kind: int,
        micro_batch: int,
        tensor: torch.Tensor,
        *,
        replica: int = 0,
        delivered: Callable[[], None] | None = None,
        ack_later: bool = False,
    ) -> Encoded:
        """Start the push to every rank of the neighbour (`links`; `replica`: which replica of it, where the
        stage is replicated); returns the payload as encoded (what the receivers will decode). `delivered`: called
        once the neighbour accepted it. `ack_later`: a later push of this step to the same links follows
        (arceus.wire.push_stream.outgoing_push)."""
        # Encoded once, per the job's transfer setting; top-k error feedback is kept per micro-batch slot.
        encoded = self._stage.transfer.encode(tensor, gradient=kind == stage_pb2.GRADIENT, stream=micro_batch)
        self.send_encoded(
            links, target_index, kind, micro_batch, encoded, replica=replica, delivered=delivered, ack_later=ack_later
        )
        return encoded

    def send_encoded(
        self,
        links: Sequence[NeighbourLink],
        target_index: int,
        kind: int,
        micro_batch: int,
        encoded: Encoded,
        *,
        replica: int = 0,
        delivered: Callable[[], None] | None = None,
        ack_later: bool = False,
    ) -> None:
        """`send` of a payload already encoded (a kept tensor sent again)."""
        push = outgoing_push(
            self._stage.ref(target_index, replica), kind, self._step, micro_batch, encoded, epoch=self._epoch,
            ack_later=ack_later,
        )
        timeout = max(MIN_CALL_TIMEOUT, self._deadline - time.monotonic())
        nbytes = encoded.nbytes
        for link in links:
            what = (
                f"the {stage_pb2.TensorKind.Name(kind)} of step {self._step} micro-batch {micro_batch} "
                f"to stage {target_index}{f' replica {replica}' if replica else ''} at {link.address}"
            )
            with self._cond:
                self._pending += 1
            future = link.pushes.push(push, timeout)
            with self._cond:
                self._futures.append(future)
            future.add_done_callback(lambda f, what=what: self._done(f, what, nbytes, delivered))

    def _done(self, future: Future[None], what: str, nbytes: int, delivered: Callable[[], None] | None) -> None:
        try:
            if future.cancelled():
                return
            error = future.exception()
            if error is None:
                self._stage.add_bytes_sent(nbytes)
                if delivered is not None:
                    delivered()
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
                # A finished future keeps its callbacks, and they this tracker and `delivered` (a replica's HeldStep):
                # kept in the list, they would make a cycle that only Python's cycle collector frees.
                self._futures.remove(future)
                self._cond.notify_all()

    def raise_if_failed(self) -> None:
        with self._cond:
            failure = self.failure
        if failure is not None:
            raise failure

    def wait_all(self) -> None:
        """Wait until every push is delivered and counted (each has its own deadline); raise the first
        failure, or CANCELLED once the step is aborted (a push to a peer that went silent would hold it until the
        deadline)."""
        give_up = self._deadline + 1
        with self._cond:
            while self._pending and not self._abort.is_set() and time.monotonic() < give_up:
                self._cond.wait(min(ABORT_POLL_SECONDS, max(0.0, give_up - time.monotonic())))
            pending = self._pending
        self.raise_if_failed()
        if pending and self._abort.is_set():
            raise RpcFailure(grpc.StatusCode.CANCELLED, f"{self._stage.name}: the step was cancelled")
        if pending:
            raise RpcFailure(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{self._stage.name}: {pending} pushes did not finish by the deadline",
            )

    def settle(self, seconds: float) -> None:
        """After a failed step: wait up to `seconds` for the pushes in flight to be delivered or refused, then
        cancel the rest (a replica reports what it holds only once none of its sends is in flight)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout=max(0.0, seconds)):
                # a peer that went silent, or a connection nobody closed: what held this replica's report that long
                log.warning("%s: %d pushes still in flight %.1f s after the step failed; cancelled", self._stage.name,
                            self._pending, seconds)
        self.cancel_all()

    def cancel_all(self) -> None:
        with self._cond:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
