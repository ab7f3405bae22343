"""Verified work in the control plane: receipts re-verified against the registered key, a failed spot
check flags the node (no new stages, reason in the API) and withholds its credit, bad evidence stores
nothing; agents report their key, fp16/bf16 rates and link on register and heartbeat."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from arceus.contracts.counters import StageCounters
from arceus.contracts.spot_check import VERIFICATION, SpotCheckResult
from arceus.contracts.status import JobStatus
from arceus.verify.receipts import SENT, ReceiptFields, ReceiptSigner
from arceus.verify.tensor_digest import tensor_digest
from controlplane.common.errors import ApplicationError
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Stage
from controlplane.market.models import LedgerEntry, SpotCheck
from controlplane.market.services import ledger_record_work
from controlplane.market.verification import spot_checks_record
from controlplane.nodes.models import Node
from controlplane.nodes.selectors import node_unavailable_reason
from controlplane.nodes.services import node_create
from devtools.pipeline import identity_for
from tests.controlplane.conftest import agent_register

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(ready_node, queued_job):  # noqa: ANN001, ANN201 - fixtures from conftest
    """A running job with stage 0 on `producer`, stage 1 on `receiver` (whose agent key is `signer`)."""
    signer = ReceiptSigner()
    producer, receiver = ready_node("producer", port=50061), ready_node("receiver", port=50062)
    receiver.public_key = signer.public_key_hex
    receiver.save()
    job = queued_job()
    job.status, job.generation, job.driver_lease_owner = JobStatus.RUNNING, 2, "driver-1"
    job.save()
    for index, node in enumerate((producer, receiver)):
        Stage.objects.create(job=job, index=index, layer_start=index, layer_end=index + 1, node=node, generation=2)
    return job, producer, receiver, signer


def report(job, signer: ReceiptSigner, producer: Node, *, passed: bool, digest_of: torch.Tensor) -> SpotCheckResult:  # noqa: ANN001
    digest = tensor_digest(digest_of)
    signature = signer.sign(ReceiptFields(str(job.id), 1, 2, 7, 0, digest))
    return SpotCheckResult(
        step=7, micro_batch=0, stage_index=0, node_id=str(producer.id), passed=passed,
        detail="step 7 micro-batch 0: output differs from the recomputation" if not passed else "matches",
        max_abs_diff=0.5 if not passed else 0.0, receipt_sha256=digest.hex(), receipt_signature=signature.hex(),
    )


def work(job, node: Node, samples: int) -> None:  # noqa: ANN001
    now = timezone.now()
    ledger_record_work(job_id=job.id, generation=2, node=node, flops_per_sample=1e3, step=7,
                       counters=StageCounters(0, samples, samples // 8, samples / 10, 100, 100),
                       held_since=now - timedelta(seconds=samples / 10), now=now)


def test_a_failed_spot_check_flags_the_node_and_withholds_its_credit(placed) -> None:  # noqa: ANN001
    job, producer, receiver, signer = placed
    work(job, producer, 64)
    spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                       checks=[report(job, signer, producer, passed=True, digest_of=torch.ones(2, 3))])
    producer.refresh_from_db()
    assert producer.flagged_at is None and not LedgerEntry.objects.filter(withheld=True).exists()

    spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                       checks=[report(job, signer, producer, passed=False, digest_of=torch.ones(2, 3))])
    reconcile_once()  # the pass the failed check nudged
    producer.refresh_from_db()
    assert "differs from the recomputation" in producer.flag_reason
    assert node_unavailable_reason(producer, timezone.now()).startswith("flagged: ")
    # The job rolled back to step 0: the caught step 7 is refunded to the job's owner and not credited.
    [reversal] = LedgerEntry.objects.filter(node=producer, reverses__isnull=False)
    assert reversal.charge_micros == -reversal.reverses.charge_micros and reversal.withheld
    work(job, producer, 128)  # recorded after the flag: withheld at once
    entries = LedgerEntry.objects.filter(node=producer)
    assert entries.count() == 3 and all(e.withheld for e in entries)
    # Money still adds up: credits paid + fees + withheld = charges.
    totals = LedgerEntry.objects.aggregate(c=Sum("charge_micros"), f=Sum("fee_micros"), k=Sum("credit_micros"))
    assert totals["k"] + totals["f"] == totals["c"] > 0
    assert SpotCheck.objects.filter(node=producer).count() == 2


def test_a_verifier_overruled_by_another_owners_node_is_flagged_and_the_checked_producer_is_not(
    placed, ready_node  # noqa: ANN001
) -> None:
    # The receiver's node verified the producer's forward and failed it; a third owner's node recomputed it too and
    # agreed with the output (arceus.training.audit's votes): the producer's check passed, the verifier's failed.
    job, producer, receiver, signer = placed
    third = ready_node("third", port=50063)
    work(job, producer, 64)
    work(job, receiver, 64)
    passed = replace(report(job, signer, producer, passed=True, digest_of=torch.ones(2, 3)),
                     verifier_node_id=str(third.id))
    overruled = SpotCheckResult(
        step=7, micro_batch=0, stage_index=1, node_id=str(receiver.id), passed=False, kind=VERIFICATION,
        detail=f"as the verifier of step 7 micro-batch 0's forward, recomputed what node {third.id} and the checked "
        "output contradict (failed it; max |diff| 0.01)", verifier_node_id=str(third.id), max_abs_diff=0.01,
    )
    spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                       checks=[passed, overruled])
    producer.refresh_from_db()
    receiver.refresh_from_db()
    assert producer.flagged_at is None and not LedgerEntry.objects.filter(node=producer, withheld=True).exists()
    assert "as the verifier of step 7" in receiver.flag_reason
    assert LedgerEntry.objects.filter(node=receiver).exists()
    assert all(e.withheld for e in LedgerEntry.objects.filter(node=receiver))
    assert SpotCheck.objects.get(node=receiver).kind == VERIFICATION


def test_a_receipt_that_does_not_verify_stores_nothing(placed) -> None:  # noqa: ANN001
    job, producer, _, _ = placed
    forged = report(job, ReceiptSigner(), producer, passed=False, digest_of=torch.ones(2, 3))
    with pytest.raises(ApplicationError, match="does not verify against the node's public key"):
        spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(), checks=[forged])
    malformed = SpotCheckResult(**{**forged.__dict__, "receipt_sha256": "zz"})
    with pytest.raises(ApplicationError, match="spot check of step 7"):
        spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(), checks=[malformed])
    with pytest.raises(ApplicationError, match="does not hold the driver lease"):
        spot_checks_record(job_id=job.id, lease_owner="someone", generation=2, now=timezone.now(), checks=[forged])
    producer.refresh_from_db()
    assert producer.flagged_at is None and not SpotCheck.objects.exists()


def test_a_replicas_check_is_verified_against_the_key_of_the_replica_its_receipt_names(
    ready_node, queued_job  # noqa: ANN001 - fixtures from conftest
) -> None:
    """Stage 1 of a replicated job has replicas 0 and 3 on two nodes: the receipt of replica 3 verifies only against
    its own node's key, and the stored check names the producing and receiving replicas and the checked one."""
    producer = ready_node("producer-1", port=50071)
    receivers = {0: ready_node("receiver-0", port=50072), 3: ready_node("receiver-3", port=50073)}
    signers = {replica: ReceiptSigner() for replica in receivers}
    for replica, node in receivers.items():
        node.public_key = signers[replica].public_key_hex
        node.save()
    job = queued_job()
    job.status, job.generation, job.driver_lease_owner, job.replicas_max = JobStatus.RUNNING, 2, "driver-1", 2
    job.save()
    Stage.objects.create(job=job, index=0, replica=1, layer_start=0, layer_end=1, node=producer, generation=2)
    for replica, node in receivers.items():
        Stage.objects.create(job=job, index=1, replica=replica, layer_start=1, layer_end=2, node=node, generation=2)
    digest = tensor_digest(torch.ones(2, 3))

    def check(signed_by: int, named: int) -> SpotCheckResult:
        fields = ReceiptFields(str(job.id), 1, 2, 7, 0, digest, producer_replica=1, receiver_replica=named)
        return SpotCheckResult(
            step=7, micro_batch=0, stage_index=0, node_id=str(producer.id), passed=False,
            detail="step 7 micro-batch 0 (stage 0 replica 1): output differs from the recomputation",
            receipt_sha256=digest.hex(), receipt_signature=signers[signed_by].sign(fields).hex(),
            replica=1, producer_replica=1, receiver_replica=named,
        )

    # Signed by replica 0's node but naming replica 3 (or the reverse): no key verifies it, nothing is stored.
    for signed_by, named in ((0, 3), (3, 0)):
        with pytest.raises(ApplicationError, match="does not verify against the node's public key"):
            spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                               checks=[check(signed_by, named)])
    assert not SpotCheck.objects.exists()
    [row] = spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                               checks=[check(3, 3)])
    assert (row.stage_index, row.replica, row.producer_replica, row.receiver_replica) == (0, 1, 1, 3)
    assert row.node_id == producer.id
    producer.refresh_from_db()
    assert "(stage 0 replica 1)" in producer.flag_reason  # flagged through the usual path


def test_agents_report_key_low_precision_rates_and_link(api: APIClient, user) -> None:  # noqa: ANN001
    node, token = node_create(owner=user, name="laptop")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    caps = {"device_type": "cpu", "memory_bytes": 2**30, "flops_fp32": 1e10, "flops_fp16": 2e10, "flops_bf16": None,
            "link": {"rtt_seconds": 0.02, "bandwidth_bytes_per_second": 1e7}}
    certificate = identity_for("127.0.0.1:5").certificate
    bad = agent_register(agent, {"grpc_address": "127.0.0.1:5", "capabilities": caps,
                                 "public_key": "not-a-key", "tls_certificate": certificate})
    assert bad.status_code == 400 and "public_key" in bad.json()["errors"]
    key = ReceiptSigner().public_key_hex
    ok = agent_register(agent, {"grpc_address": "127.0.0.1:5", "capabilities": caps, "public_key": key,
                                "tls_certificate": certificate})
    assert ok.status_code == 200, ok.json()
    shown = api.get(f"/api/nodes/{node.id}").json()
    assert (shown["public_key"], shown["flops_fp16"], shown["flops_bf16"], shown["flag"]) == (key, 2e10, None, None)
    assert shown["link"]["rtt_seconds"] == 0.02

    beat = agent.post("/api/agent/heartbeat", {"link": {"rtt_seconds": 0.5, "bandwidth_bytes_per_second": 2e6}},
                      format="json")
    assert beat.status_code == 200
    assert api.get(f"/api/nodes/{node.id}").json()["link"]["bandwidth_bytes_per_second"] == 2e6
    probe = agent.post("/api/agent/probe", b"x" * 1000, content_type="application/octet-stream")
    assert probe.json() == {"bytes": 1000}


def test_a_disagreement_is_stored_only_with_both_parties_signatures(placed) -> None:  # noqa: ANN001
    job, producer, receiver, receiver_signer = placed
    producer_signer = ReceiptSigner()
    producer.public_key = producer_signer.public_key_hex
    producer.save()
    claimed, sent = tensor_digest(torch.zeros(2, 3)), tensor_digest(torch.ones(2, 3))
    blame_receiver = SpotCheckResult(
        step=7, micro_batch=0, stage_index=1, producer_index=0, node_id=str(receiver.id), passed=False,
        detail="signed for an activation other than the one stage 0 sent", train_step=7,
        receipt_sha256=claimed.hex(),
        receipt_signature=receiver_signer.sign(ReceiptFields(str(job.id), 1, 2, 7, 0, claimed)).hex(),
        sent_sha256=sent.hex(),
        sent_signature=producer_signer.sign(ReceiptFields(str(job.id), 1, 2, 7, 0, sent, SENT)).hex(),
    )
    # A producer's "received" signature, or one by another key, is no "sent" receipt.
    for forged in (producer_signer.sign(ReceiptFields(str(job.id), 1, 2, 7, 0, sent)),
                   receiver_signer.sign(ReceiptFields(str(job.id), 1, 2, 7, 0, sent, SENT))):
        with pytest.raises(ApplicationError, match="does not verify"):
            spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(),
                               checks=[replace(blame_receiver, sent_signature=forged.hex())])
    assert not SpotCheck.objects.exists()

    spot_checks_record(job_id=job.id, lease_owner="driver-1", generation=2, now=timezone.now(), checks=[blame_receiver])
    stored = SpotCheck.objects.get()
    assert (stored.node_id, stored.stage_index, stored.sent_sha256) == (receiver.id, 1, sent.hex())
    receiver.refresh_from_db()
    producer.refresh_from_db()
    assert receiver.flagged_at is not None and producer.flagged_at is None
