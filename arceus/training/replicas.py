"""The driver's book of replicated stages (arceus/swarm): who the members of each stage are, how fast each
replica ran its last steps, each step's routes from those speeds, and what RunStep tells a replica about them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

from arceus.contracts.credentials import replica_token, token_digest
from arceus.swarm.routing import Routes, route_step, speeds_update
from arceus.training.plan import StageEndpoint
from arceus.v1 import stage_pb2

# How much one step's measured speed moves a replica's routing speed (an EWMA): a replica that slows down
# sheds micro-batches within a few steps, one noisy step moves little.
SPEED_ALPHA = 0.5

ReplicaKey = tuple[int, int]  # (stage index, replica id)


class ReplicaRoster:
    """The members of every stage and their speeds; `epoch` counts membership changes (every exchange message
    names it, so a message of an older membership is never summed)."""

    def __init__(self, endpoints: Iterable[StageEndpoint], num_stages: int, *, credential: str) -> None:
        """`credential`: the driver's token of the job generation, from which every replica's own derives; the
        replicas' speeds start from those the endpoints carry."""
        self.credential = credential
        self.endpoints: dict[ReplicaKey, StageEndpoint] = {(e.index, e.replica): e for e in endpoints}
        self.num_stages = num_stages
        # What an earlier driver measured, where it is known (finite and positive, as `measured` keeps).
        self.speeds: dict[ReplicaKey, float] = {
            key: e.samples_per_second for key, e in self.endpoints.items()
            if e.samples_per_second is not None and math.isfinite(e.samples_per_second) and e.samples_per_second > 0
        }
        self.epoch = 0
        # When each member joined (0: placed with the roster): the newest is the first suspect of a failure between
        # live replicas (`newest`).
        self._joined: dict[ReplicaKey, int] = dict.fromkeys(self.endpoints, 0)
        self._joins = 0
        # Replicas lost (`remove`): never let in again, their agents did not answer (a silent one would hold up the
        # copy of a join). Live ones fenced after failures nobody could be blamed for (`fence`): how often, and the
        # first train step each may join again at.
        self._lost: set[ReplicaKey] = set()
        self._fenced: dict[ReplicaKey, tuple[int, int]] = {}
        self._fenced_endpoints: dict[ReplicaKey, StageEndpoint] = {}

    def add(self, endpoint: StageEndpoint, most: int) -> None:
        """Let a replica that copied its stage's state take micro-batches from the next step (a new epoch);
        ValueError if it is a member already or its stage already has `most` replicas. A former member may join
        again (a fenced live one, `may_join`): it copied the state anew, and the new epoch refuses whatever its
        earlier membership still sends."""
        key = (endpoint.index, endpoint.replica)
        if key in self.endpoints:
            raise ValueError(f"stage {key[0]} replica {key[1]} is a member already")
        if len(self.members()[endpoint.index]) >= most:
            raise ValueError(f"stage {endpoint.index} already has {most} replicas, one per micro-batch")
        self.endpoints[key] = endpoint
        self._joins += 1
        self._joined[key] = self._joins
        self.epoch += 1

    def may_join(self, key: ReplicaKey, train_step: int) -> bool:
        """Whether `key` may join before train step `train_step` (0: an evaluation, when none joins after a
        fence): not while it is a member, nor before its fence's wait is over."""
        if key in self.endpoints or key in self._lost:
            return False
        _, after = self._fenced.get(key, (0, 0))
        return train_step >= after and (train_step > 0 or key not in self._fenced)

    def newest(self, stages: Iterable[int]) -> ReplicaKey | None:
        """The member of `stages` that joined last (among those placed together, the highest id) whose stage keeps
        another member; None where no such stage has two."""
        members = self.members()
        candidates = [(i, k) for i in stages if 0 <= i < self.num_stages and len(members[i]) > 1 for k in members[i]]
        return max(candidates, key=lambda key: (self._joined[key], key[1]), default=None)

    def fence(self, key: ReplicaKey, train_step: int) -> int:
        """Take a live member off the roster (a new epoch) after failures between live replicas: it may join
        again (copying its state anew) from train step `train_step + 2**(n-1)` on, the n-th time it is fenced: a
        newcomer that failed by a passing fault comes back a step later, one that keeps failing ever more rarely.
        Returns that step."""
        times = self._fenced.get(key, (0, 0))[0] + 1
        self._fenced_endpoints[key] = self.endpoints[key]
        self.remove([key])
        self._lost.discard(key)
        self._fenced[key] = (times, train_step + 2 ** (times - 1))
        return self._fenced[key][1]

    def fenced(self) -> list[StageEndpoint]:
        """The fenced live replicas that are not members now (each may join again: `may_join`)."""
        return [e for key, e in self._fenced_endpoints.items() if key not in self.endpoints]

    def renew(self) -> None:
        """A new membership epoch with the same members: every message of the older one is refused."""
        self.epoch += 1

    def members(self) -> list[tuple[int, ...]]:
        return [tuple(sorted(k for i, k in self.endpoints if i == stage)) for stage in range(self.num_stages)]

    def remove(self, lost: Iterable[ReplicaKey]) -> None:
        """Take lost replicas out of every later step (a new membership epoch); ValueError naming the stage when
        one would be left without any (its state is gone: the job rewinds to its checkpoint)."""
        lost = set(lost)
        for stage, ids in enumerate(self.members()):
            if ids and all((stage, k) in lost for k in ids):
                raise ValueError(f"stage {stage} lost every replica ({list(ids)}): its state is gone")
        for key in lost:
            self.endpoints.pop(key, None)
            self.speeds.pop(key, None)
            self._joined.pop(key, None)
        self._lost |= lost
        self.epoch += 1

    def routes(self, num_micro_batches: int) -> Routes:
        """This step's routes: each stage's micro-batches shared by its replicas' measured speeds."""
        return route_step(num_micro_batches, self.members(), self.speeds)

    def replica_step(self, stage: int, routes: Routes, failed: Sequence[int] = ()) -> stage_pb2.ReplicaStep:
        """What RunStep tells a replica of `stage`: the routes and where its siblings and neighbours listen;
        `failed`: the driver's failed attempts at this step (their deferred updates are discarded)."""
        peers = [
            stage_pb2.ReplicaPeer(
                stage_index=i, replica=k, address=e.address, certificate=e.certificate,
                token_digest=token_digest(replica_token(self.credential, i, k)), public_key=e.public_key,
                exchange_address=e.exchange_address,
            )
            for (i, k), e in sorted(self.endpoints.items())
            if abs(i - stage) <= 1 and k in routes.members[i]
        ]
        return stage_pb2.ReplicaStep(
            routes_json=json.dumps(routes.to_json()), epoch=self.epoch, peers=peers, discard_steps=failed
        )

    def measured(self, replies: Sequence[tuple[ReplicaKey, int, float]]) -> None:
        """Learn from one train step: (replica, samples it ran, its compute seconds) each."""
        measured = {
            key: samples / seconds
            for key, samples, seconds in replies
            if samples > 0 and math.isfinite(seconds) and seconds > 0
        }
        self.speeds = speeds_update(self.speeds, measured, SPEED_ALPHA)
