"""Posted prices and the contribution ledger. Money is integer micro-dollars (1e-6 $), so credits plus
fees add up to charges exactly."""

from __future__ import annotations

from django.db import models

from controlplane.common.models import BaseModel
from controlplane.jobs.models import Job
from controlplane.nodes.models import Node


class PriceChange(BaseModel):
    """Append-only: every posted price, with the demand and supply it was computed from. The newest
    row of a class is the price in force."""

    device_class = models.CharField(max_length=40, db_index=True)
    price_per_hour = models.FloatField(help_text="US dollars per hour of a device of this class")
    demand = models.FloatField(help_text="devices wanted by queued and active jobs")
    supply = models.FloatField(help_text="Ready devices offered (not paused)")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.device_class} ${self.price_per_hour:.4f}/h"


class LedgerEntry(BaseModel):
    """Append-only work done by one node on one stage generation of a job since the previous entry,
    priced when it was recorded: the job pays for each second it held the device (`held_seconds`, since the
    node's previous entry on the job or since its stage was placed there) at the price in force. `samples_total`
    (the stage's cumulative count at this entry) is in the unique key, so a retried report of the same counters
    never counts twice.

    A reversal (`reverses` set) undoes the money of an entry whose steps the job rolled back
    (`controlplane.market.services.ledger_roll_back`): it refunds the charge and, unless the node caused the
    rollback, leaves the node its credit (the platform pays it: the reversal's fee is minus the charge). It
    moves money only; its work columns are zero."""

    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="ledger_entries")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="ledger_entries")
    stage_index = models.PositiveIntegerField()
    generation = models.BigIntegerField()
    step = models.BigIntegerField(default=0, help_text="the job's training step this work reached")
    samples_total = models.BigIntegerField()
    samples = models.BigIntegerField()
    micro_batches = models.BigIntegerField()
    compute_seconds = models.FloatField(help_text="what the agent measured computing (metered, not billed)")
    held_seconds = models.FloatField(
        default=0.0, help_text="seconds the job held the device since its previous entry: what is billed"
    )
    held_until = models.DateTimeField(null=True, blank=True, help_text="when this entry's held time ends")
    flops = models.FloatField(help_text="estimated: forward + backward FLOPs of the samples on this stage")
    bytes_sent = models.BigIntegerField()
    bytes_received = models.BigIntegerField()
    device_class = models.CharField(max_length=40)
    price_per_hour = models.FloatField()
    charge_micros = models.BigIntegerField(help_text="what the job's owner pays for this work")
    fee_micros = models.BigIntegerField(help_text="the platform's share")
    credit_micros = models.BigIntegerField(help_text="what the node's owner earns: charge - fee")
    # A spot check caught this node's work on this job wrong: the credit is not paid out.
    withheld = models.BooleanField(default=False, db_index=True)
    reverses = models.OneToOneField(
        "self", on_delete=models.PROTECT, null=True, blank=True, related_name="reversal",
        help_text="the entry whose rolled-back steps this one refunds",
    )

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "stage_index", "generation", "node", "samples_total"],
                condition=models.Q(reverses__isnull=True),
                name="ledger_unique_report",
            ),
            models.CheckConstraint(
                condition=models.Q(credit_micros=models.F("charge_micros") - models.F("fee_micros")),
                name="ledger_credit_is_charge_minus_fee",
            ),
        ]


class LedgerHourly(BaseModel):
    """The ledger summed per node, job and hour (UTC), rebuilt from the entries by a Celery task."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="+")
    hour = models.DateTimeField()
    samples = models.BigIntegerField()
    compute_seconds = models.FloatField()
    charge_micros = models.BigIntegerField()
    fee_micros = models.BigIntegerField()
    credit_micros = models.BigIntegerField(help_text="credit paid out (entries not withheld)")
    withheld_micros = models.BigIntegerField(default=0, help_text="credit withheld: credit + fee + withheld = charge")

    class Meta:
        ordering = ["-hour"]
        constraints = [models.UniqueConstraint(fields=["job", "node", "hour"], name="ledgerhourly_unique")]


class SpotCheck(BaseModel):
    """Append-only: one check of a node's work by the training driver (arceus.training.audit): a forward
    recomputed on another node and compared within tolerance, or the receipts a node signed; of a replicated
    stage, the replica's (`replica`) on its node."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="spot_checks")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="spot_checks")
    verifier = models.ForeignKey(Node, on_delete=models.PROTECT, null=True, blank=True, related_name="+")
    generation = models.BigIntegerField()
    step = models.BigIntegerField(help_text="the driver's RunStep id within its run")
    train_step = models.BigIntegerField(
        default=0, help_text="the training step checked (the job's step once it ran): what a rollback trusts"
    )
    micro_batch = models.IntegerField(help_text="-1: a receipt check of the whole step")
    stage_index = models.PositiveIntegerField()
    passed = models.BooleanField(db_index=True)
    max_abs_diff = models.FloatField(default=0.0)
    receipt_sha256 = models.CharField(max_length=64, blank=True, help_text="the receiver's signed digest")
    receipt_signature = models.CharField(max_length=128, blank=True)
    sent_sha256 = models.CharField(max_length=64, blank=True, help_text="the producer's signed digest of what it sent")
    sent_signature = models.CharField(max_length=128, blank=True)
    # Replicated stages (arceus/swarm): the checked replica of `stage_index`, and the replicas the compared output
    # went from and to, as the receipts name them; 0 where the job's stages are not replicated.
    replica = models.PositiveIntegerField(default=0, help_text="the replica of the stage whose work was checked")
    producer_replica = models.PositiveIntegerField(default=0, help_text="the replica that produced the output")
    receiver_replica = models.PositiveIntegerField(default=0, help_text="the replica that received the output")
    kind = models.CharField(
        max_length=16, default="forward",
        help_text="forward: a recomputed forward or receipts; partial: a replica's partial gradient",
    )
    detail = models.TextField()

    class Meta:
        ordering = ["-created_at"]
