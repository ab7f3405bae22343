"""Reads for the API and the agents."""

from __future__ import annotations

import hashlib
import math
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.db.models import Count, F, Q, QuerySet, Sum

from arceus.contracts.assignment import (
    Assignment,
    CheckpointRef,
    InitialWeightsRef,
    OptimizerConfig,
    TensorParallelConfig,
    TiedPeer,
    max_micro_batch_size,
)
from arceus.contracts.data_plane import DataPlane
from arceus.contracts.observed import ObservedState
from arceus.contracts.replica_sync import ReplicaSync
from arceus.contracts.status import HOSTED_STATUSES, JobStatus
from arceus.contracts.transfer import transfer_config_from_json
from arceus.model.registry import model_spec_from_config
from arceus.model.tied import stages_sharing
from arceus.training.plan import RankEndpoint, StageEndpoint
from controlplane.common.errors import one_by_id
from controlplane.jobs.credentials import job_stage_credentials
from controlplane.jobs.models import Job, LossPoint, Stage, StageCheckpoint, StageContribution
from controlplane.nodes.models import Node, ReadyStatus


def job_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Job]:
    return Job.objects.filter(owner=user).select_related("owner")


def job_get_for_user(*, user: AbstractBaseUser, job_id: str) -> Job:
    """The user's job with its stages; 404 for a malformed id and for another user's job alike, so ids
    of others' jobs cannot be probed."""
    return one_by_id(job_list_for_user(user=user).prefetch_related("epoch_metrics"), "job", job_id)


def job_counts_by_status() -> dict[str, int]:
    """How many jobs are in each status, every status named (0 for none)."""
    counts = dict(Job.objects.values_list("status").annotate(n=Count("pk")).order_by())
    return {status.value: counts.get(status.value, 0) for status in JobStatus}


def job_stages(*, job: Job) -> QuerySet[Stage]:
    """The job's stage rows (one per rank of a tensor-parallel stage), in stage then rank order."""
    return Stage.objects.filter(job=job).select_related("node").order_by("index", "rank", "replica")


def stage_activity(stage: Stage, *, running: bool) -> str:
    """What a stage row (a replica, a rank) does for its job now, in one word: `leaving` (its node is paused,
    leaving or not Ready, or its agent failed it: the reconciler drops the replica, or moves the stage), `joining`
    (placed while the job ran, it has neither copied a live replica's state, as the driver records in `joined`, nor
    taken a micro-batch), `fenced` (the driver took it off the step after failures between live replicas; it joins
    again, copying its state anew, from `fenced_until_step` on), `training` (its job is `running` and its agent
    reported it built), or else its agent's report for its generation (`pending`, `ready`)."""
    node = stage.node
    reported = stage.observed_state if stage.observed_generation == stage.generation else ObservedState.PENDING
    if node is not None and (node.paused or node.leaving_at is not None or node.ready_status != ReadyStatus.TRUE):
        return "leaving"
    if reported == ObservedState.FAILED:
        return "leaving"
    if stage.joining and stage.joined is None and stage.micro_batches == 0:
        return "joining"
    if stage.fenced_until_step is not None:
        return "fenced"
    if node is not None and reported == ObservedState.READY and running:
        return "training"
    return str(reported)


def stage_shares(rows: Sequence[Stage]) -> dict[Any, float | None]:
    """Each row's share of its stage's micro-batches per step (by primary key), from the micro-batches the driver
    routed to each replica in recent steps (`Stage.step_micro_batches`); None where the row has no measure yet, 0
    for a fenced replica (it takes none until it joins again)."""
    totals: dict[tuple[int, int], float] = defaultdict(float)
    for row in rows:
        if row.fenced_until_step is None:
            totals[(row.index, row.rank)] += row.step_micro_batches or 0.0
    return {
        row.pk: 0.0 if row.fenced_until_step is not None
        else row.step_micro_batches / totals[(row.index, row.rank)] if row.step_micro_batches else None
        for row in rows
    }


def job_stage_endpoints(*, job: Job) -> tuple[StageEndpoint, ...]:
    """Where the driver and samplers reach each stage, as its active rows stand: a tensor-parallel stage is its
    rank 0's endpoint, listing the other ranks in rank order (a served stage is one rank); a replicated stage its
    lowest replica's (`job_replica_endpoints` lists them all)."""
    groups: dict[int, list[Stage]] = defaultdict(list)
    for row in job_stages(job=job).filter(active=True):
        if not job.replicated or not groups[row.index]:
            groups[row.index].append(row)
    return tuple(
        StageEndpoint(
            index=index,
            address=rank0.node.dial_address if rank0.node else "",
            node_id=str(rank0.node_id),
            layer_start=rank0.layer_start,
            layer_end=rank0.layer_end,
            certificate=rank0.node.tls_certificate if rank0.node else "",
            public_key=rank0.node.public_key if rank0.node else "",
            owner_id=str(rank0.node.owner_id) if rank0.node else "",
            tensor_parallel_ranks=tuple(
                RankEndpoint(
                    address=r.node.dial_address if r.node else "",
                    node_id=str(r.node_id),
                    certificate=r.node.tls_certificate if r.node else "",
                )
                for r in others
            ),
        )
        for index, (rank0, *others) in sorted(groups.items())
    )


def job_replica_endpoints(*, job: Job, joining: bool) -> tuple[StageEndpoint, ...]:
    """A replicated job's replicas at its generation, in stage then replica order: those placed with the job
    (`joining` False: they built from its checkpoint), or those added while it ran whose agents report them ready
    (`joining` True: each copies a live replica's state before it takes micro-batches)."""
    rows = job_stages(job=job).filter(active=True, joining=joining, generation=job.generation, node__isnull=False)
    if joining:
        rows = rows.filter(observed_generation=job.generation, observed_state=ObservedState.READY)
    return tuple(
        StageEndpoint(
            index=row.index, address=row.node.dial_address, node_id=str(row.node_id), layer_start=row.layer_start,
            layer_end=row.layer_end, certificate=row.node.tls_certificate, public_key=row.node.public_key,
            owner_id=str(row.node.owner_id), replica=row.replica, samples_per_second=row.step_samples_per_second,
            exchange_address=row.node.exchange_dial_address,
        )
        for row in rows.order_by("index", "replica")
    )


def job_replicas_placed(*, job_id: str, generation: int) -> frozenset[tuple[int, int]]:
    """(stage index, replica id) of each replica the control plane places for the job at `generation`."""
    rows = Stage.objects.filter(job_id=job_id, active=True, generation=generation, node__isnull=False)
    return frozenset(rows.values_list("index", "replica"))


def job_contributions(*, job: Job) -> list[dict[str, Any]]:
    """Each node's work on each stage of the job, summed over generations (moves and rewinds)."""
    return list(
        StageContribution.objects.filter(job=job)
        .values("node_id", "stage_index")
        .annotate(
            node_name=F("node__name"),
            node_owner_id=F("node__owner_id"),
            samples=Sum("samples"),
            micro_batches=Sum("micro_batches"),
            compute_seconds=Sum("compute_seconds"),
            bytes_sent=Sum("bytes_sent"),
            bytes_received=Sum("bytes_received"),
        )
        .order_by("stage_index", "node_name")
    )


def job_loss_curve(*, job: Job, max_points: int | None = None) -> list[dict[str, Any]]:
    """The recorded losses, thinned to about `max_points` evenly spaced steps (the newest always kept)
    so a long job's detail stays small."""
    max_points = max_points or settings.ARCEUS_LOSS_CURVE_MAX_POINTS
    points = LossPoint.objects.filter(job=job)
    stride = math.ceil(job.step / max_points) if job.step > max_points else 1
    if stride > 1:
        points = points.annotate(offset=F("step") % stride).filter(Q(offset=0) | Q(step=job.step))
    return list(points.order_by("step").values("step", "epoch", "loss"))


def neighbour_nodes_by_address(*, node: Node) -> dict[str, Any]:
    """Dialled address (as `node`'s agent dials it: `Node.address_for`) → id of each node hosting the stage before or
    after one of `node`'s active stages: the links its heartbeat may report (controlplane/nodes/links.py)."""
    hosted = Stage.objects.filter(node=node, active=True).values_list("job_id", "index")
    around = Q()
    for job_id, index in hosted:
        around |= Q(job_id=job_id, index__in=(index - 1, index + 1))
    if not around:
        return {}
    neighbours = Stage.objects.filter(around, active=True, node__isnull=False).exclude(node=node).select_related("node")
    return {s.node.address_for(node): s.node_id for s in neighbours}  # where its agent dialled them


# What an assignments version digests (`assignments_version`): each hosted stage row's columns, the join that
# finds them from a node id column, and their order. Raw SQL, like the node's authentication: composing the ORM's
# query cost more CPU than running it. The quiet heartbeat (controlplane/agents/heartbeat.py) joins the same rows
# to its node lookup.
VERSION_COLUMNS = "s.id, s.generation, j.generation, j.status, j.resume_checkpoint_id"
# Read beside them, not digested (a grant moves every few steps; agents hear it in every reply): each hosted row's
# job and its step grant (controlplane/jobs/step_grant.py).
GRANT_COLUMNS = "s.job_id, j.step_grant"


def step_grants(rows: Sequence[tuple[Any, int | None]]) -> dict[str, int]:
    """The step grant of each job of `rows` ((job id, grant) of the hosted rows, `GRANT_COLUMNS`) that has one, by
    the job's id as assignments name it: the heartbeat answer's `step_grants`."""
    job_id = Stage._meta.get_field("job").to_python  # a UUID from PostgreSQL, its hex from SQLite
    return {str(job_id(job)): grant for job, grant in rows if grant is not None}


def version_rows_join(node_column: str) -> str:
    """`(stages s JOIN jobs j) ON s.node_id = <node_column>`: the hosted stage rows (`hosted_jobs`, `withheld`). The
    statuses are written in (our own constants), so the only parameter is the node's."""
    assert all(status.isidentifier() for status in HOSTED_STATUSES)  # noqa: S101 (safe to write into SQL)
    statuses = ", ".join(f"'{status}'" for status in HOSTED_STATUSES)
    hosted = f"(j.status IN ({statuses}) OR (j.status = '{JobStatus.SUCCEEDED}' AND j.serving))"
    return (f"({Stage._meta.db_table} s JOIN {Job._meta.db_table} j ON j.id = s.job_id AND {hosted}) "
            f"ON s.node_id = {node_column} AND s.active "
            "AND (s.restarted_generation IS NULL OR s.restarted_generation <> s.generation)")


def hosted_jobs() -> Q:
    """The jobs whose active stages agents host: placing or running ones, and succeeded ones being served."""
    return Q(job__status__in=HOSTED_STATUSES) | Q(job__status=JobStatus.SUCCEEDED, job__serving=True)


def withheld() -> Q:
    """Stages whose node's agent restarted at their generation: not sent to it until the reconciler rewinds the job
    (a new generation), or the fresh process would rebuild a stage the others trained past, under credentials
    the driver still accepts."""
    return Q(restarted_generation=F("generation"))


def version_order() -> str:
    return f"s.job_id, s.{connection.ops.quote_name('index')}, s.rank, s.replica"  # "index": reserved in SQLite


def version_digest(rows: list[tuple[Any, ...]]) -> str:
    return hashlib.sha256(repr([tuple(map(str, row)) for row in rows]).encode()).hexdigest()[:32]


class HostedVersion(NamedTuple):
    version: str  # `assignments_version`
    step_grants: dict[str, int]  # job id → the last training step its agents may run (`step_grants`)


def assignments_version(*, node: Node) -> HostedVersion:
    """A digest of everything the node's assignments are built from that can change while it hosts them: its
    stage rows and their generations, and each job's generation, status and resume checkpoint (a neighbour's
    address or certificate changes only with a new generation: a node that registers again while hosting
    rewinds its job); with the step grants of its jobs, read in the same indexed query. The agent sends back the
    version it holds, and an unchanged one is answered without building the assignments."""
    return hosted_versions(node_ids=[node.pk])[node.pk]


def assignments_versions(*, node_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
    """`assignments_version` of each of these nodes, in one query."""
    return {node_id: hosted.version for node_id, hosted in hosted_versions(node_ids=node_ids).items()}


def hosted_versions(*, node_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, HostedVersion]:
    """`assignments_version` of each of these nodes, and their jobs' step grants, in one query."""
    if not node_ids:
        return {}
    pk = Node._meta.pk
    rows: dict[uuid.UUID, list[tuple[Any, ...]]] = {node_id: [] for node_id in node_ids}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT n.id, {VERSION_COLUMNS}, {GRANT_COLUMNS} FROM {Node._meta.db_table} n "  # noqa: S608
            f"JOIN {version_rows_join('n.id')} "
            f"WHERE n.id IN ({', '.join(['%s'] * len(rows))}) ORDER BY n.id, {version_order()}",
            [pk.get_db_prep_value(node_id, connection) for node_id in rows],
        )
        for node_id, *row in cursor.fetchall():
            rows[pk.to_python(node_id)].append(tuple(row))
    return {
        node_id: HostedVersion(version_digest([row[:5] for row in hosted]), step_grants([row[5:] for row in hosted]))
        for node_id, hosted in rows.items()
    }


def assignments_for_node(*, node: Node) -> list[dict[str, Any]]:
    """The node's desired state (docs/architecture.md, "Assignment"): every stage it hosts for a job
    that is placing or running, with the checkpoint each resumes from; a tensor-parallel rank's with
    its group (`tensor_parallel`), and a tensor-parallel neighbour's address as the list of its ranks'; a
    served job's stage for inference, from its final checkpoint."""
    return assignments_for_nodes(nodes=[node])[node.pk]


def assignments_for_nodes(*, nodes: Sequence[Node]) -> dict[uuid.UUID, list[dict[str, Any]]]:
    """`assignments_for_node` of each of these nodes, built from three queries for them all."""
    by_node: dict[uuid.UUID, list[dict[str, Any]]] = {node.pk: [] for node in nodes}
    hosted = list(
        Stage.objects.filter(hosted_jobs(), node__in=list(by_node), active=True)
        .exclude(withheld())
        .select_related("job")
        .order_by("job__created_at", "index")
    )
    if not hosted:  # most nodes most of the time (a first heartbeat)
        return by_node
    siblings: dict[uuid.UUID, dict[int, list[Stage]]] = defaultdict(lambda: defaultdict(list))
    rows = Stage.objects.filter(job_id__in={s.job_id for s in hosted}, active=True).select_related("node")
    for stage in rows.order_by("index", "rank", "replica"):
        siblings[stage.job_id][stage.index].append(stage)
    checkpoints = {
        (sc.checkpoint_id, sc.stage_index): sc
        for sc in StageCheckpoint.objects.filter(
            checkpoint_id__in={s.job.resume_checkpoint_id for s in hosted if s.job.resume_checkpoint_id}
        ).select_related("checkpoint")
    }
    viewers = {node.pk: node for node in nodes}
    for stage in hosted:
        checkpoint = checkpoints.get((stage.job.resume_checkpoint_id, stage.index))
        by_node[stage.node_id].append(_assignment(stage, siblings[stage.job_id], checkpoint, viewers[stage.node_id]))
    return by_node


def _assignment(
    stage: Stage, stages: dict[int, list[Stage]], checkpoint: StageCheckpoint | None, viewer: Node
) -> dict[str, Any]:
    """`viewer`: the node the assignment is for; its neighbours' addresses are where it dials them (`address_for`).
    A replica of a replicated stage learns its neighbours and siblings from each RunStep (arceus/swarm), so its
    assignment names none; one joining a running job is built without the checkpoint (it copies a live replica's
    state)."""
    job = stage.job
    replicated = job.replicated
    group = [] if replicated else stages[stage.index]
    previous = () if replicated else _addresses(stages.get(stage.index - 1), viewer)
    following = () if replicated else _addresses(stages.get(stage.index + 1), viewer)
    if stage.joining:
        checkpoint = None
    # The stages holding a copy of a tied weight this one holds a copy of (arceus.model.tied) and their ranks.
    ranges = [(g[0].layer_start, g[0].layer_end) if (g := stages.get(i)) else (0, 0) for i in range(len(stages))]
    tied = () if replicated else stages_sharing(model_spec_from_config(job.model_config), ranges, stage.index)
    tied_ranks = {i: stages[i] for i in tied}  # in rank order
    return Assignment(
        stage_id=stage.stage_id,
        job_id=str(job.id),
        stage_index=stage.index,
        num_stages=len(stages),
        generation=stage.generation,
        model=job.model_config,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        seed=job.seed,
        optimizer=OptimizerConfig(job.optimizer, job.learning_rate, job.momentum, job.weight_decay),
        micro_batches=job.micro_batches,
        # The driver splits each batch (training or validation) into `micro_batches` parts.
        max_micro_batch_size=max_micro_batch_size(job.dataset_config, job.micro_batches),
        prev_address=previous[0] if previous else None,
        next_address=following[0] if following else None,
        prev_ranks=previous if len(previous) > 1 else (),
        next_ranks=following if len(following) > 1 else (),
        credentials=job_stage_credentials(
            job_id=str(job.id),
            generation=stage.generation,
            stage_index=stage.index,
            rank=stage.rank,
            ranks=[len({s.rank for s in stages[i]}) for i in range(len(stages))],
            replica=stage.replica if replicated else None,
            tied=tied,
        ),
        certificates={} if replicated else _certificates(
            viewer, stages.get(stage.index - 1), stages.get(stage.index + 1), [s for s in group if s.pk != stage.pk],
            *tied_ranks.values(),
        ),
        checkpoint=None
        if checkpoint is None
        else CheckpointRef(
            step=checkpoint.checkpoint.step, url=f"/api/agent/checkpoints/{checkpoint.id}", sha256=checkpoint.sha256
        ),
        initial_weights=InitialWeightsRef(
            url=f"/api/agent/jobs/{job.id}/initial-weights",
            layer_sha256=tuple(job.initial_weights_layer_sha256[stage.layer_start : stage.layer_end]),
        )
        if job.initial_weights
        else None,
        program=f"/api/agent/jobs/{job.id}/program" if job.program else None,
        transfer=transfer_config_from_json(job.transfer),
        precision=job.precision,
        activation_checkpointing=job.activation_checkpointing,
        schedule=job.schedule,
        staleness=0 if job.status == JobStatus.SUCCEEDED else job.staleness,  # a served stage trains no step
        tensor_parallel=TensorParallelConfig(rank=stage.rank, peers=_addresses(group, viewer))
        if len(group) > 1
        else None,
        inference=job.status == JobStatus.SUCCEEDED,
        replica=stage.replica if replicated else None,
        replica_sync=job.replica_sync_config if replicated else ReplicaSync(),
        tied=tuple(
            TiedPeer(i, ranks[0].layer_start, ranks[0].layer_end, _addresses(ranks, viewer))
            for i, ranks in tied_ranks.items()
        ),
        data_plane=DataPlane(
            tuple(viewer.data_plane), _one_agent_features(stages.get(stage.index - 1)),
            _one_agent_features(stages.get(stage.index + 1)),
        ) if not replicated and len(group) == 1 else DataPlane(),
    ).to_json()


def _certificates(viewer: Node, *groups: list[Stage] | None) -> dict[str, str]:
    """The registered TLS certificate of the agent at each address (as `viewer` dials it) of these stages' rows."""
    return {s.node.address_for(viewer): s.node.tls_certificate for g in groups for s in g or () if s.node is not None}


def _one_agent_features(group: list[Stage] | None) -> tuple[str, ...]:
    """The data-plane features the agent of a one-agent stage declared; none for a stage of several agents (a
    tensor-parallel one: its links take PushStream) or of no node."""
    if group is None or len(group) != 1 or group[0].node is None:
        return ()
    return tuple(group[0].node.data_plane)


def _addresses(group: list[Stage] | None, viewer: Node) -> tuple[Any, ...]:
    """The "host:port" where `viewer` dials each rank of a stage (one, unless it is tensor-parallel), in rank order;
    null for a rank whose node was deleted (the reconciler moves it)."""
    return tuple(s.node.address_for(viewer) if s.node is not None else None for s in group or ())
