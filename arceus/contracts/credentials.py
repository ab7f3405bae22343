"""Data-plane credentials: who may call which method of which stage, per job and generation.

The control plane mints one bearer token per principal of a job generation: the driver (the control plane's
own calls: steps, state, audits, sampling, a pipeline's inputs and labels) and every rank of every stage.
A token is an HMAC-SHA256 of the principal's name under the control plane's secret: nothing is stored, and
a new generation's tokens share nothing with the last one's, so a rewound or moved stage's old callers are
strangers at once. An assignment carries its stage's own token (presented to its neighbours and peers) and
the SHA-256 digests of the tokens it accepts, by role: an agent never learns another principal's token.

A replica of a replicated stage (arceus/swarm) also holds a token of its own, per replica id: the stage's token
says "a replica of this stage", its replica token says which one. Replica tokens derive from the driver's token,
so the driver (the control plane) names every replica's digest in each RunStep and grants a named joiner the
copy of a live replica's state (`join_grant`) without asking the control plane, and no replica can mint another's.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from arceus.errors import SpecError

# gRPC metadata key and scheme the token travels under (as grpc.access_token_call_credentials sends it).
METADATA_KEY = "authorization"
SCHEME = "Bearer "
# gRPC metadata key a replica's own token travels under on ReplicaService calls, beside its stage's bearer token.
REPLICA_METADATA_KEY = "arceus-replica"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("token", "accepts", "replica_token")


class Role(StrEnum):
    DRIVER = "driver"  # the control plane's calls on the stage
    PREV = "prev"  # a rank of the previous stage: activations
    NEXT = "next"  # a rank of the next stage: gradients
    PEER = "peer"  # another rank of this tensor-parallel stage: partial sums
    SIBLING = "sibling"  # another replica of this replicated stage (arceus/swarm): the gradient exchange
    TIED = "tied"  # a rank of another stage holding a copy of a tied weight this stage holds (arceus.model.tied)


DRIVER = "driver"
# Where an agent finds its node token (nodeagent.node_token): what `arceus nodes create` tells the owner to set.
NODE_TOKEN_ENV = "ARCEUS_NODE_TOKEN"


def stage_principal(stage_index: int, rank: int = 0) -> str:
    return f"stage-{stage_index}-rank-{rank}"


def mint_token(secret: bytes, job_id: str, generation: int, principal: str) -> str:
    """The bearer token of `principal` (DRIVER or a stage_principal) in this job generation."""
    if len(secret) < 32:
        raise ValueError(f"the credential secret must hold at least 32 bytes, got {len(secret)}")
    return hmac.new(secret, f"{job_id}/{generation}/{principal}".encode(), hashlib.sha256).hexdigest()


def replica_token(driver_token: str, stage_index: int, replica: int) -> str:
    """The token of replica `replica` of stage `stage_index`, derived from the job generation's driver token:
    only the control plane (which holds that) mints it; the replica presents it to its siblings."""
    return hmac.new(driver_token.encode(), f"replica/{stage_index}/{replica}".encode(), hashlib.sha256).hexdigest()


def join_grant(source_replica_token: str, joiner_digest: str, epoch: int) -> str:
    """The driver's leave for the replica whose token digest is `joiner_digest` to copy the state of the replica
    holding `source_replica_token`, at the roster's membership epoch `epoch`: that replica checks it with its own
    token, so no other replica can forge one, and refuses it once a step of a later epoch has named its members
    (a grant is not replayed by a replica that left, or one that never joined)."""
    if epoch < 0:
        raise ValueError(f"a membership epoch is >= 0, got {epoch}")
    return hmac.new(
        source_replica_token.encode(), f"join/{epoch}/{joiner_digest}".encode(), hashlib.sha256
    ).hexdigest()


def token_digest(token: str) -> str:
    """The SHA-256 (hex) a bearer token is known by where it is checked: data-plane tokens in assignments and
    by agents, node tokens in the control plane's database."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class StageCredentials:
    """A stage rank's own token and the digests of the tokens it accepts, by role; a role's digests are in rank
    order (PEER: every rank of this stage, this one's included), so a digest also says which rank calls.
    `replica_token`: a replica's own (`replica_token`), "" for an unreplicated stage."""

    token: str
    accepts: Mapping[Role, tuple[str, ...]]
    replica_token: str = ""

    def roles_of(self, digest: str) -> frozenset[Role]:
        return frozenset(role for role, digests in self.accepts.items() if digest in digests)

    def rank_of(self, role: Role, digest: str) -> int | None:
        digests = self.accepts.get(role, ())
        return digests.index(digest) if digest in digests else None

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"token": self.token, "accepts": {r.value: list(d) for r, d in self.accepts.items()}}
        return value | ({"replica_token": self.replica_token} if self.replica_token else {})

    @classmethod
    def from_json(cls, value: Any, field: str = "assignment.credentials") -> StageCredentials:
        if not isinstance(value, dict) or not {"token", "accepts"} <= set(value) <= {*_FIELDS}:
            raise SpecError(field, "must be an object with `token`, `accepts` and, for a replica, `replica_token`")
        for key in ("token", "replica_token"):
            if key in value and not (isinstance(value[key], str) and _HEX64.fullmatch(value[key])):
                raise SpecError(f"{field}.{key}", "must be 64 lowercase hex digits")
        token = value["token"]
        accepts = value["accepts"]
        if not isinstance(accepts, dict):
            raise SpecError(f"{field}.accepts", "must be an object of role: [token digest, ...]")
        parsed: dict[Role, tuple[str, ...]] = {}
        for name, digests in accepts.items():
            try:
                role = Role(name)
            except ValueError:
                raise SpecError(
                    f"{field}.accepts.{name}", f"is no role; roles: {', '.join(r.value for r in Role)}"
                ) from None
            if not isinstance(digests, list) or not all(isinstance(d, str) and _HEX64.fullmatch(d) for d in digests):
                raise SpecError(f"{field}.accepts.{name}", "must be a list of SHA-256 digests (64 lowercase hex)")
            parsed[role] = tuple(digests)
        if not parsed.get(Role.DRIVER):
            raise SpecError(f"{field}.accepts.driver", "is required: a stage nobody may drive cannot train")
        return cls(token=token, accepts=parsed, replica_token=value.get("replica_token", ""))


def stage_credentials(
    secret: bytes,
    job_id: str,
    generation: int,
    stage_index: int,
    rank: int,
    ranks: Sequence[int],
    *,
    replica: int | None = None,
    tied: Sequence[int] = (),
) -> StageCredentials:
    """The credentials of rank `rank` of stage `stage_index` in a pipeline whose stage i has `ranks[i]`
    ranks: it accepts the driver, every rank of its neighbours, and the ranks of its own stage (if split).
    The replicas of a stage share its principal (a newcomer needs no new token, and a neighbour accepts every
    replica); a replicated stage's replicas accept each other as SIBLING, and replica `replica` (None: the stage
    is not replicated) also holds its own replica token, which says which sibling calls. `tied`: the other stages
    holding a copy of a tied weight this one holds, whose ranks it accepts as TIED (their copies' gradients)."""

    def digests(index: int) -> tuple[str, ...]:
        if not 0 <= index < len(ranks):
            return ()
        return tuple(
            token_digest(mint_token(secret, job_id, generation, stage_principal(index, r))) for r in range(ranks[index])
        )

    accepts = {
        Role.DRIVER: (token_digest(mint_token(secret, job_id, generation, DRIVER)),),
        Role.PREV: digests(stage_index - 1),
        Role.NEXT: digests(stage_index + 1),
        Role.PEER: digests(stage_index) if ranks[stage_index] > 1 else (),
        Role.SIBLING: digests(stage_index) if replica is not None else (),
        Role.TIED: tuple(d for index in tied for d in digests(index)),
    }
    token = mint_token(secret, job_id, generation, stage_principal(stage_index, rank))
    own = "" if replica is None else replica_token(mint_token(secret, job_id, generation, DRIVER), stage_index, replica)
    return StageCredentials(token=token, accepts={role: d for role, d in accepts.items() if d}, replica_token=own)
