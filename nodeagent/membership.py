"""The membership epochs a replica knows (arceus/swarm): the newest epoch its driver's RunSteps named, with the token
digest of every member of its stage and of its neighbours in it, by (stage, replica).

Whatever a replica takes from another replica names the sender's epoch and is judged here before it costs memory: a
sibling's shard of the gradient exchange (nodeagent.replicas) and a neighbour's boundary tensor, an activation or an
input gradient (nodeagent.servicer). An epoch older than the newest (a RunStep's, or the one the driver's call for a
repair names) is over: its sender was taken off the job (fenced: stopped, then woken with its epoch gone) or its step
abandoned, and what it sends is refused. An epoch after the newest is one a sibling or neighbour may start a moment
before this replica's own RunStep names it (the driver sends its RunSteps side by side, and may skip epochs here: a
replica that leaves and one that joins before the same step make two): a call naming it waits for that RunStep at
most `EPOCH_WAIT_SECONDS`, and at most as many calls wait at once as its siblings and neighbours may legitimately
send ahead of it (`Membership.waiting_calls`, nodeagent.replicas.epoch_waits; beyond: refused at once), so a holder
of the stage's token naming epochs that never come holds no more than that many server threads for that long, and
never its caller's share of the agent's calls (nodeagent.call_limits), which its siblings' own calls need."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterable

import grpc

from arceus.v1 import stage_pb2
from nodeagent.callers import not_allowed
from nodeagent.rpc import RpcFailure

# How long a call naming an epoch after the newest known here waits for the RunStep that names it: far longer than
# the driver's RunSteps to two replicas take to arrive apart (each replica learns its epoch before it waits for its
# step lock), far shorter than the threads a hostile sender could hold with it are worth.
EPOCH_WAIT_SECONDS = 2.0


class Membership:
    """The newest membership epoch of one replica (`name` in errors) and its members; at most `waiting_calls` calls
    wait at once for an epoch no RunStep named yet."""

    def __init__(self, name: str, *, waiting_calls: int) -> None:
        self._name = name
        self.waiting_calls = waiting_calls
        self._known = threading.Condition()
        self.newest = -1  # the newest membership epoch a RunStep named here (-1: none yet)
        self._members: dict[tuple[int, int], str] = {}  # (stage, replica) -> token digest, in epoch `newest`
        self._floor = 0  # the driver's newest epoch as a repair told it (`fence`): every earlier one is over
        self._waiting = 0

    def _over(self) -> int:
        """Every epoch before this is over."""
        return max(self.newest, self._floor)

    def learn(self, epoch: int, peers: Iterable[stage_pb2.ReplicaPeer]) -> None:
        """Remember the members a RunStep of membership `epoch` names, with their token digests (a membership never
        shrinks within an epoch: an evaluation step names only some of them), and wake the calls waiting for it.
        FAILED_PRECONDITION for an epoch that is over: the driver's epochs only grow."""
        with self._known:
            if epoch < self._over():
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self._name}: the step names membership epoch {epoch}, which is over (epoch {self._over()} is "
                    "the newest here)",
                )
            if epoch > self.newest:
                self.newest, self._members = epoch, {}
            self._members.update({(p.stage_index, p.replica): p.token_digest for p in peers})
            self._known.notify_all()

    def fence(self, epoch: int) -> None:
        """The driver moved on to membership `epoch` (it asks what this replica holds of a step that lost replicas,
        before its RunStep of that epoch comes): from now on nothing of an earlier epoch is taken, so what this
        replica reports holding is all it will ever hold of that step."""
        with self._known:
            self._floor = max(self._floor, epoch)

    def digest(self, epoch: int, stage: int, replica: int) -> str | None:
        """The token digest of `replica` of `stage` as a member of `epoch`; None if it is none (or the epoch is
        over)."""
        with self._known:
            return self._members.get((stage, replica)) if epoch == self.newest else None

    def check(
        self, epoch: int, stage: int, replica: int | None, sender: str | None, *, what: str, method: str, wait: float
    ) -> None:
        """Whether `sender` (the digest of the replica token a call presents) is a member of `stage` in `epoch`
        (`replica` of it, where the call names one): PERMISSION_DENIED if not; FAILED_PRECONDITION, naming the
        epoch, for an epoch that is over (older than the newest a RunStep or a repair named here); an epoch no
        RunStep named yet waits for one at most `wait` seconds (capped at EPOCH_WAIT_SECONDS), then is refused
        alike, and UNAVAILABLE at once while `waiting_calls` calls wait. `what`: the refused message, for its error."""
        if sender is None:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, not_allowed(method))
        with self._known:
            if epoch > self.newest and epoch >= self._floor:  # a RunStep naming it may be on its way
                self._await(epoch, min(wait, EPOCH_WAIT_SECONDS), what)
            if epoch < self._over():
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self._name}: {what} names membership epoch {epoch}, which is over (epoch {self._over()} is the "
                    "newest here): its sender was taken off the job or its step abandoned; refused",
                )
            members = [d for (i, k), d in self._members.items() if i == stage and replica in (None, k)]
        if not any(hmac.compare_digest(d, sender) for d in members):
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, not_allowed(method))

    def wait_for(self, epoch: int, *, wait: float, what: str) -> None:
        """Return once a RunStep named `epoch` (or a later one) here, waiting at most `wait` seconds (capped at
        EPOCH_WAIT_SECONDS) as `check` does; FAILED_PRECONDITION if none did, UNAVAILABLE while too many wait."""
        with self._known:
            if epoch > self.newest and epoch >= self._floor:
                self._await(epoch, min(wait, EPOCH_WAIT_SECONDS), what)

    def _await(self, epoch: int, wait: float, what: str) -> None:
        """Wait (the condition held) up to `wait` seconds for a RunStep to name `epoch`, one of `waiting_calls`."""
        if self._waiting >= self.waiting_calls:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE,
                f"{self._name}: {what} names membership epoch {epoch}, which no step named here yet, and "
                f"{self.waiting_calls} calls already wait for it, the most that may; retry once its step started",
            )
        self._waiting += 1
        try:
            self._known.wait_for(lambda: self.newest >= epoch, timeout=max(0.0, wait))
        finally:
            self._waiting -= 1
        if self.newest < epoch:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self._name}: {what} names membership epoch {epoch}, which no step named here within "
                f"{wait:.1f} s (newest: {self.newest}): its members are unknown; refused",
            )
