"""Static pipelines for tests and benchmarks: the assignments of a model cut into consecutive stages,
one agent each, for agents started with `--static-assignment` (no control plane).

With no control plane to mint the pipeline's data-plane credentials, this process mints them, under a key
of its own (STATIC_SECRET): `pipeline_assignments` carries each stage's, `driver_token` is the driver's. With
no control plane to register agents' TLS certificates, this process keeps them too: `identity_for(address)`
is the identity of the agent at that address (made here, for agents this process starts with it; or recorded
with `remember_identity` by one that started an agent of its own)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from arceus.contracts.assignment import Assignment, OptimizerConfig, TiedPeer
from arceus.contracts.credentials import DRIVER, StageCredentials, mint_token, stage_credentials
from arceus.contracts.data_plane import SPOKEN, DataPlane
from arceus.contracts.replica_sync import replica_sync_from_json
from arceus.contracts.stage_key import stage_key
from arceus.contracts.transfer import transfer_config_from_json
from arceus.model.registry import model_spec_from_config
from arceus.model.tied import stages_sharing
from arceus.training.plan import StageEndpoint
from arceus.wire.tls import TlsIdentity, new_identity

STATIC_SECRET = secrets.token_bytes(32)
_IDENTITIES: dict[str, TlsIdentity] = {}


def identity_for(address: str) -> TlsIdentity:
    """The TLS identity of the agent at `address` in this process's static pipelines."""
    if address not in _IDENTITIES:
        _IDENTITIES[address] = new_identity()
    return _IDENTITIES[address]


def remember_identity(address: str, identity: TlsIdentity) -> None:
    """Record an agent's own identity (one started in this process, on a port it chose) under its address."""
    _IDENTITIES[address] = identity


def certificates_for(addresses: Sequence[str | None]) -> dict[str, str]:
    return {a: identity_for(a).certificate for a in addresses if a is not None}


def pipeline_assignments(
    *,
    job_id: str,
    model_config: dict[str, Any],
    boundaries: Sequence[int],
    addresses: Sequence[str],
    optimizer: dict[str, Any],
    seed: int,
    micro_batches: int,
    max_micro_batch_size: int,
    generation: int = 1,
    transfer: dict[str, Any] | None = None,
    precision: str = "fp32",
    staleness: int = 0,
    features: Sequence[Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """Assignments (JSON) for stages [boundaries[i], boundaries[i+1]) hosted at addresses[i]; `staleness` the
    job's (arceus.pipeline.schedule.STALENESS); `features[i]`: the data-plane features stage i's agent declares
    (arceus.contracts.data_plane; default: this version's, `SPOKEN`, for every agent; () as an older agent's)."""
    _check_boundaries(boundaries, addresses)
    n = len(addresses)
    declared = [tuple(sorted(f)) for f in features] if features is not None else [SPOKEN] * n
    if len(declared) != n:
        raise ValueError(f"features names {len(declared)} agents' features for {n} stages")
    shared = dict(job_id=job_id, model_config=model_config, boundaries=boundaries, optimizer=optimizer, seed=seed,
                  micro_batches=micro_batches, max_micro_batch_size=max_micro_batch_size, generation=generation)
    assignments = []
    ranges = list(zip(boundaries, boundaries[1:], strict=False))
    spec = model_spec_from_config(model_config)
    for i in range(n):
        prev, next_ = addresses[i - 1] if i > 0 else None, addresses[i + 1] if i < n - 1 else None
        tied = stages_sharing(spec, ranges, i)  # the stages it shares tied weights with (arceus.model.tied)
        assignments.append(_stage_assignment(
            **shared, stage_index=i, stage_id=stage_key(job_id, i), prev_address=prev,
            next_address=next_,
            credentials=stage_credentials(STATIC_SECRET, job_id, generation, i, 0, [1] * n, tied=tied),
            certificates=certificates_for([prev, next_, *(addresses[j] for j in tied)]),
            transfer=transfer_config_from_json(transfer), precision=precision,
            tied=tuple(TiedPeer(j, *ranges[j], (addresses[j],)) for j in tied), staleness=staleness,
            data_plane=DataPlane(declared[i], declared[i - 1] if i > 0 else (), declared[i + 1] if i < n - 1 else ()),
        ))
    return assignments


def replicated_pipeline_assignments(
    *,
    job_id: str,
    model_config: dict[str, Any],
    boundaries: Sequence[int],
    addresses: Sequence[Sequence[str]],
    optimizer: dict[str, Any],
    seed: int,
    micro_batches: int,
    max_micro_batch_size: int,
    generation: int = 1,
    schedule: str = "gpipe",
    replica_sync: dict[str, Any] | None = None,
) -> list[list[dict[str, Any]]]:
    """Assignments (JSON) for replicated stages (arceus/swarm): stage i's replica r hosted at addresses[i][r],
    replica ids 0, 1, ... per stage; a replica's neighbours and siblings are named by each RunStep, not here.
    `replica_sync`: how often the replicas agree (arceus.contracts.replica_sync; None: every step, exactly)."""
    _check_boundaries(boundaries, addresses)
    n = len(addresses)
    shared = dict(job_id=job_id, model_config=model_config, boundaries=boundaries, optimizer=optimizer, seed=seed,
                  micro_batches=micro_batches, max_micro_batch_size=max_micro_batch_size, generation=generation)
    return [
        [
            _stage_assignment(
                **shared, stage_index=i, stage_id=f"{stage_key(job_id, i)}-replica-{r}",
                prev_address=None, next_address=None,
                credentials=replica_credentials(job_id, i, r, n, generation),
                certificates={}, schedule=schedule, replica=r,
                replica_sync=replica_sync_from_json(replica_sync),
            )
            for r in range(len(addresses[i]))
        ]
        for i in range(n)
    ]


def _stage_assignment(
    *,
    job_id: str,
    model_config: dict[str, Any],
    boundaries: Sequence[int],
    optimizer: dict[str, Any],
    seed: int,
    micro_batches: int,
    max_micro_batch_size: int,
    generation: int,
    stage_index: int,
    **fields: Any,
) -> dict[str, Any]:
    """Stage `stage_index`'s assignment (JSON): what every stage of a static pipeline shares, and `fields` (the
    Assignment's own: its id, neighbours, credentials, certificates and options)."""
    return Assignment(
        job_id=job_id,
        stage_index=stage_index,
        num_stages=len(boundaries) - 1,
        generation=generation,
        model=model_config,
        layer_start=boundaries[stage_index],
        layer_end=boundaries[stage_index + 1],
        seed=seed,
        optimizer=_optimizer(optimizer),
        micro_batches=micro_batches,
        max_micro_batch_size=max_micro_batch_size,
        **fields,
    ).to_json()


def _check_boundaries(boundaries: Sequence[int], stages: Sequence[object]) -> None:
    if len(boundaries) != len(stages) + 1:
        raise ValueError(f"{len(stages)} stages need {len(stages) + 1} boundaries, got {len(boundaries)}")


def replica_endpoints(
    addresses: Sequence[Sequence[str]], boundaries: Sequence[int]
) -> tuple[tuple[StageEndpoint, ...], tuple[StageEndpoint, ...]]:
    """The driver's view of `replicated_pipeline_assignments`' pipeline: (each stage's replica 0, every replica),
    for TrainPlan's `stages` and `replicas`."""
    replicas = tuple(
        StageEndpoint(index=i, address=address, node_id=f"agent-{i}-{r}", layer_start=boundaries[i],
                      layer_end=boundaries[i + 1], certificate=identity_for(address).certificate, replica=r)
        for i, stage in enumerate(addresses)
        for r, address in enumerate(stage)
    )
    return tuple(e for e in replicas if e.replica == 0), replicas


def _optimizer(optimizer: dict[str, Any]) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer["name"], optimizer["lr"], optimizer.get("momentum", 0.0), optimizer.get("weight_decay", 0.0)
    )


def driver_token(job_id: str, generation: int = 1) -> str:
    """The driver's token for the pipelines `pipeline_assignments` builds."""
    return mint_token(STATIC_SECRET, job_id, generation, DRIVER)


def replica_credentials(
    job_id: str, stage_index: int, replica: int, num_stages: int, generation: int = 1
) -> StageCredentials:
    """What `replicated_pipeline_assignments` gives replica `replica` of stage `stage_index`."""
    return stage_credentials(STATIC_SECRET, job_id, generation, stage_index, 0, [1] * num_stages, replica=replica)


def rank_credentials(
    job_id: str, generation: int, stage_index: int, rank: int, ranks: Sequence[int]
) -> StageCredentials:
    """A rank's credentials in a pipeline of `ranks[i]` ranks per stage (tensor-parallel static pipelines)."""
    return stage_credentials(STATIC_SECRET, job_id, generation, stage_index, rank, ranks)


def stage_endpoints(addresses: Sequence[str], boundaries: Sequence[int]) -> tuple[StageEndpoint, ...]:
    """The driver's view of the same pipeline: stage i at addresses[i] (node "agent-i"), layers
    [boundaries[i], boundaries[i+1])."""
    _check_boundaries(boundaries, addresses)
    return tuple(
        StageEndpoint(index=i, address=address, node_id=f"agent-{i}", layer_start=boundaries[i],
                      layer_end=boundaries[i + 1], certificate=identity_for(address).certificate)
        for i, address in enumerate(addresses)
    )
