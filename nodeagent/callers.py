"""Who may call this agent: every data-plane call presents a bearer token (arceus.contracts.credentials), and
a method runs only for a caller whose token a stage hosted here accepts in a role that method allows.

Authentication comes before anything else is looked at: a caller whose token no hosted stage accepts (a
stranger, another job's node, last generation's driver) gets UNAUTHENTICATED with the same words whatever it
addressed, so it learns no job, stage or generation. A known caller addressing another stage than its
credential's, or a method its role may not call, gets PERMISSION_DENIED.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from arceus.contracts.credentials import (
    METADATA_KEY,
    REPLICA_METADATA_KEY,
    SCHEME,
    Role,
    StageCredentials,
    token_digest,
)
from arceus.v1 import stage_pb2
from nodeagent.rpc import RpcFailure

DRIVER_ONLY = frozenset({Role.DRIVER})
NOT_AUTHENTICATED = "the call carries no credential this agent accepts"
_STAGE, _TP, _PROBE = "/arceus.v1.StageService/", "/arceus.v1.TensorParallelService/", "/arceus.v1.LinkProbeService/"
_REPLICA = "/arceus.v1.ReplicaService/"
# The roles that may call each method at all, as a call's metadata shows them (its message may narrow them: a
# push's kind and target, a partial's rank): a known caller in none of them is refused before its message is read.
METHOD_ROLES: dict[str, frozenset[Role]] = {
    _STAGE + "PushTensor": frozenset({Role.DRIVER, Role.PREV, Role.NEXT, Role.TIED}),
    _STAGE + "PushStream": frozenset({Role.DRIVER, Role.PREV, Role.NEXT, Role.TIED}),
    _STAGE + "NeighbourStreamPort": frozenset({Role.PREV}),
    **{_STAGE + name: DRIVER_ONLY for name in (
        "RunStep", "RunSteps", "GetState", "SaveState", "Audit", "AuditWeights", "VerifyForward", "Infer",
        "AuditPartial", "VerifyPartial",
    )},
    _TP + "PushPartial": frozenset({Role.PEER}),
    _REPLICA + "ExchangePort": frozenset({Role.SIBLING}),
    _REPLICA + "Snapshot": frozenset({Role.SIBLING}),
    _REPLICA + "CopyState": DRIVER_ONLY,
    _REPLICA + "Holdings": DRIVER_ONLY,
    _PROBE + "Probe": frozenset(Role),  # any principal of a job hosted here may time its link
}
# A token is 64 hex digits; anything much longer is not worth hashing.
_MAX_TOKEN_CHARS = 256


@dataclass(frozen=True)
class Guard:
    """A stage (or tensor-parallel rank) hosted here, and whose calls it accepts."""

    job_id: str
    stage_index: int
    generation: int
    credentials: StageCredentials
    model: dict[str, Any]  # the job's model config (a spot check recomputes no other)
    max_micro_batch_size: int  # the job's largest micro-batch (nor on a larger input)

    def covers(self, target: stage_pb2.StageRef) -> bool:
        return (target.job_id, target.stage_index, target.generation) == (
            self.job_id,
            self.stage_index,
            self.generation,
        )


def presented_digest(context: grpc.ServicerContext) -> str | None:
    """The SHA-256 (hex) of the bearer token the call presents, or None."""
    return metadata_digest(context.invocation_metadata())


def replica_digest(context: grpc.ServicerContext) -> str | None:
    """The SHA-256 (hex) of the replica token (arceus.contracts.credentials.replica_token) the call presents beside
    its bearer token, or None: which replica of its stage a sibling or neighbour is."""
    return metadata_digest(context.invocation_metadata(), key=REPLICA_METADATA_KEY, scheme="")


def metadata_digest(
    metadata: Iterable[tuple[str, str | bytes]] | None, *, key: str = METADATA_KEY, scheme: str = SCHEME
) -> str | None:
    """The SHA-256 (hex) of the bearer token in a call's metadata (or of the token under `key` after `scheme`),
    or None."""
    for name, value in metadata or ():
        if name == key and isinstance(value, str) and value.startswith(scheme):
            token = value[len(scheme) :]
            if 0 < len(token) <= _MAX_TOKEN_CHARS:
                return token_digest(token)
    return None


def caller_roles(digest: str | None, guards: Iterable[Guard]) -> frozenset[Role]:
    """Every role the bearer of `digest` has on any stage hosted here (none: a stranger)."""
    if digest is None:
        return frozenset()
    return frozenset().union(*(guard.credentials.roles_of(digest) for guard in guards))


def not_allowed(method: str) -> str:
    """Why a known caller is refused `method` (PERMISSION_DENIED): the same words whatever it addressed."""
    return f"the call's credential does not allow {method} on the stage it addresses"


def authorize(
    digest: str | None,
    guards: Iterable[Guard],
    *,
    target: stage_pb2.StageRef | None,
    allowed: Collection[Role],
    method: str,
) -> Guard:
    """The guard under which the caller may call `method` on `target` (None: any stage hosted here) in one of
    the `allowed` roles; RpcFailure UNAUTHENTICATED or PERMISSION_DENIED otherwise."""
    known = [(guard, guard.credentials.roles_of(digest)) for guard in guards] if digest is not None else []
    known = [(guard, roles) for guard, roles in known if roles]
    if not known:
        raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, NOT_AUTHENTICATED)
    for guard, roles in known:
        if (target is None or guard.covers(target)) and not roles.isdisjoint(allowed):
            return guard
    raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, not_allowed(method))


def push_roles(kind_name: str, stage_index: int) -> frozenset[Role]:
    """Who may push a tensor of this kind to stage `stage_index`: the first stage's inputs and the labels come
    from the driver, other activations from the previous stage, gradients from the next, a tied weight's copy's
    gradient from a stage sharing that weight."""
    if kind_name == "ACTIVATION":
        return frozenset({Role.DRIVER if stage_index == 0 else Role.PREV})
    if kind_name == "GRADIENT":
        return frozenset({Role.NEXT})
    if kind_name == "LABELS":
        return frozenset({Role.DRIVER})
    if kind_name == "TIED_GRADIENT":
        return frozenset({Role.TIED})
    return frozenset()
