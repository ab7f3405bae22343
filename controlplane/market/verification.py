"""Verified work: store the driver's spot checks, and flag a node caught wrong and withhold its credit.

Receipts carried by a check are verified again here, the receiver's against the receiving node's
registered key and the producer's ("sent") against the producing node's, so a check is stored only
when the evidence it rests on is signed by the nodes whose accounts it weighs.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import transaction

from arceus.contracts.spot_check import SpotCheckResult
from arceus.verify.receipts import RECEIVED, SENT, ReceiptError, ReceiptFields, verify_receipt
from controlplane.common.errors import ApplicationError
from controlplane.jobs.leases import held, job_driver_distrust
from controlplane.jobs.models import Job, Stage
from controlplane.market.models import SpotCheck
from controlplane.market.services import ledger_withhold
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_flag


@transaction.atomic
def spot_checks_record(
    *, job_id: Any, lease_owner: str, generation: int, checks: Sequence[SpotCheckResult], now: datetime
) -> list[SpotCheck]:
    """Store the checks of the driver holding the job's lease; each failed one flags its node and withholds
    that node's credit for the job, and ends this driver's lease (`job_driver_distrust`): the failed checks are the
    facts from which the reconciler rolls the job back to before the caught work. ApplicationError, with nothing
    stored, if the caller lost the lease or a receipt does not verify against the receiving node's key."""
    job = held(job_id, lease_owner).filter(generation=generation).first()
    if job is None:
        raise ApplicationError.conflict(
            f"job {job_id}: the caller does not hold the driver lease of generation {generation}"
        )
    ids = {c.node_id for c in checks} | {c.verifier_node_id for c in checks if c.verifier_node_id}
    nodes = {str(n.id): n for n in Node.objects.filter(id__in=ids)}
    rows = []
    for c in checks:
        if c.node_id not in nodes or (c.verifier_node_id and c.verifier_node_id not in nodes):
            raise ApplicationError.invalid("checks", f"spot check of step {c.step} names an unknown node")
        if c.receipt_signature:
            _verify_receipt(job, generation, c, RECEIVED, c.receipt_sha256, c.receipt_signature)
        if c.sent_signature:
            _verify_receipt(job, generation, c, SENT, c.sent_sha256, c.sent_signature)
        rows.append(
            SpotCheck(
                job=job,
                node=nodes[c.node_id],
                verifier=nodes.get(c.verifier_node_id),
                generation=generation,
                step=c.step,
                micro_batch=c.micro_batch,
                train_step=c.train_step,
                stage_index=c.stage_index,
                passed=c.passed,
                max_abs_diff=c.max_abs_diff,
                receipt_sha256=c.receipt_sha256,
                receipt_signature=c.receipt_signature,
                sent_sha256=c.sent_sha256,
                sent_signature=c.sent_signature,
                replica=c.replica,
                producer_replica=c.producer_replica,
                receiver_replica=c.receiver_replica,
                kind=c.kind,
                detail=c.detail,
            )
        )
    SpotCheck.objects.bulk_create(rows)
    failed = [c for c in checks if not c.passed]
    for c in failed:
        node_flag(node=nodes[c.node_id], reason=f"job {job.id}: stage {c.stage_index}: {c.detail}", now=now)
        ledger_withhold(job_id=job.id, node=nodes[c.node_id])
    if failed:
        # Its perturbed activations already went into every stage's weights: no more steps or checkpoints on them.
        job_driver_distrust(job_id=job.id, owner=lease_owner, now=now)
    return rows


def _verify_receipt(job: Job, generation: int, c: SpotCheckResult, role: str, sha256: str, signature: str) -> None:
    """The compared output of stage `producer` (for stage `producer + 1`) carries the receiver's receipt
    and the producer's "sent" one: check the one of `role` against its signer's key (a replicated stage's: the
    key of the node holding the replica the receipt names)."""
    producer = c.stage_index if c.producer_index is None else c.producer_index
    signer = producer + 1 if role == RECEIVED else producer
    replica = c.receiver_replica if role == RECEIVED else c.producer_replica
    stage = (
        Stage.objects.filter(job=job, index=signer, rank=0, replica=replica, active=True).select_related("node").first()
    )
    if stage is None or stage.node is None:
        where = f" replica {replica}" if job.replicated else ""
        raise ApplicationError.invalid("checks", f"job {job.id} has no placed stage {signer}{where}")
    try:
        fields = ReceiptFields(
            str(job.id), producer + 1, generation, c.step, c.micro_batch, bytes.fromhex(sha256), role,
            producer_replica=c.producer_replica, receiver_replica=c.receiver_replica,
        )
        verify_receipt(stage.node.public_key, fields, bytes.fromhex(signature))
    except (ReceiptError, ValueError) as exc:
        raise ApplicationError.invalid("checks", f"spot check of step {c.step}: {exc}") from None
