"""What a step signs and keeps for spot checks: a receipt for every activation the stage accepts from its
previous stage (role "received"), and, on a retained train step, one for every activation it sends on
(role "sent", as the receiver decodes it) plus the activations an audit may ask for. A replicated stage's receipts
name the producing and the receiving replica of each activation, as the step's routes give them. A repaired step
(nodeagent.repair) goes on with its first attempt's StepAudit (`resume`): its reply signs for the whole step, and a
tensor signed again (sent again to another replica, or exchanged again among the survivors) replaces its receipt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from arceus.contracts.assignment import Assignment
from arceus.swarm.exchange import Chunk
from arceus.v1 import stage_pb2
from arceus.verify.receipts import (
    GRADIENT,
    PARTIAL,
    RECEIVED,
    REDUCED,
    SENT,
    ReceiptFields,
    ReceiptSigner,
    ShardFields,
)
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.compression import Encoded, decode_payload
from nodeagent.verify import AuditRecord


class AuditedStage(Protocol):
    """What a step's audit reads and resets of its stage (nodeagent.stage.HostedStage): named here, not imported,
    as the stage holds a repaired step's audit (nodeagent.repair) and would import this module back."""

    assignment: Assignment
    audit_record: AuditRecord | None

    def ref(self, stage_index: int, replica: int = 0) -> stage_pb2.StageRef: ...


class StepAudit:
    def __init__(
        self, stage: AuditedStage, step: int, signer: ReceiptSigner, *, retain: bool, train_step: int,
        replica_of: Callable[[int, int], int] | None = None,
    ) -> None:
        """`train_step`: the training step the call `step` runs (a retained record keeps it: it seeds the draws).
        `replica_of(stage_index, micro_batch)`: which replica of a neighbouring stage the step's routes give the
        micro-batch (replicated stages; None: stages that are not replicated, replica 0 each)."""
        self._stage, self._step, self._signer = stage, step, signer
        self._replica_of = replica_of or (lambda _stage, _m: 0)
        self._own = stage.assignment.replica or 0
        self.receipts: list[stage_pb2.Receipt] = []
        self.sent_receipts: list[stage_pb2.Receipt] = []
        # Replicated stages on a retained step: the partial gradient's receipt, the signed shards siblings pushed
        # here (the exchange fills it), and a receipt per gradient sent upstream.
        self.partial_receipt: stage_pb2.Receipt | None = None
        self.shard_receipts: list[stage_pb2.ShardReceipt] | None = [] if retain else None
        self.gradient_receipts: list[stage_pb2.Receipt] = []
        self.reduced_receipts: list[stage_pb2.Receipt] = []
        self.record = AuditRecord(step, train_step) if retain else None
        stage.audit_record = None  # the previous step's is no longer auditable

    def resume(self, replica_of: Callable[[int, int], int], *, keep_exchange: bool) -> None:
        """Go on signing for the same step, repaired on new routes (`replica_of` theirs): what the earlier attempts
        signed and kept stays, so the repaired reply accounts for all the replica did in the step; the evidence of
        an exchange too where its stage keeps it (`keep_exchange`), else the survivors exchange anew (or not at all,
        one left alone)."""
        self._replica_of = replica_of
        self._stage.audit_record = None  # auditable again once the repaired step ends (`keep`)
        if not keep_exchange and self.record is not None:
            self.record.partial, self.partial_receipt = None, None
            self.shard_receipts, self.reduced_receipts = [], []

    def received(self, micro_batch: int, x: torch.Tensor) -> None:
        """An activation accepted from the previous stage."""
        index = self._stage.assignment.stage_index
        producer = self._replica_of(index - 1, micro_batch)
        self.receipts.append(self._receipt(micro_batch, x, index, RECEIVED, producer, self._own))
        if self.record is not None:
            self.record.received[micro_batch] = x

    def sent(self, micro_batch: int, out: torch.Tensor, encoded: Encoded) -> None:
        """An activation sent on to the next stage, as `encoded` for the wire."""
        if self.record is None:
            return
        delivered = out.detach() if encoded.encoding == "fp32" else decode_payload(encoded)
        self.record.sent[micro_batch] = delivered
        receiver = self._stage.assignment.stage_index + 1
        _replace(self.sent_receipts, self._receipt(
            micro_batch, delivered, receiver, SENT, self._own, self._replica_of(receiver, micro_batch)
        ))

    def gradient_received(self, micro_batch: int, grad: torch.Tensor) -> None:
        """The gradient the output of `micro_batch` received from the next stage (kept for an audit of the partial
        gradient it went into)."""
        if self.record is not None:
            self.record.gradients[micro_batch] = grad

    def gradient_sent(self, micro_batch: int, grad: torch.Tensor, encoded: Encoded) -> None:
        """A gradient sent upstream, as `encoded` for the wire: a retained replicated step signs what the
        receiving replica decodes, naming both replicas."""
        if self.record is None or self._stage.assignment.replica is None:
            return
        delivered = grad.detach() if encoded.encoding == "fp32" else decode_payload(encoded)
        receiver = self._stage.assignment.stage_index - 1
        a = self._stage.assignment
        fields = ReceiptFields(
            a.job_id, receiver, a.generation, self._step, micro_batch, tensor_digest(delivered), GRADIENT,
            producer_replica=self._own, receiver_replica=self._replica_of(receiver, micro_batch),
        )
        _replace(self.gradient_receipts, stage_pb2.Receipt(
            stage=self._stage.ref(receiver, fields.receiver_replica), step=self._step, micro_batch=micro_batch,
            sha256=fields.sha256, signature=self._signer.sign(fields), producer_replica=self._own,
        ))

    def partial(self, flat: torch.Tensor) -> None:
        """A replica's partial gradient of a retained step, before the exchange: kept, and its digest signed (an
        exchange of a repaired step, among the survivors, replaces the evidence of an earlier attempt's)."""
        if self.record is None:
            return
        a = self._stage.assignment
        self.record.partial = flat
        self.shard_receipts, self.reduced_receipts = [], []
        fields = ReceiptFields(
            a.job_id, a.stage_index, a.generation, self._step, -1, tensor_digest(flat), PARTIAL,
            producer_replica=self._own, receiver_replica=self._own,
        )
        self.partial_receipt = stage_pb2.Receipt(
            stage=self._stage.ref(a.stage_index, self._own), step=self._step, micro_batch=-1, sha256=fields.sha256,
            signature=self._signer.sign(fields), producer_replica=self._own,
        )

    def reduced(self, reduced: torch.Tensor, chunks: Sequence[Chunk]) -> None:
        """The summed gradient a replica applies after its exchange, on a retained step: a signed digest of each
        chunk, naming the chunk's owner (which summed it)."""
        if self.record is None:
            return
        a = self._stage.assignment
        for c, chunk in enumerate(chunks):
            fields = ReceiptFields(
                a.job_id, a.stage_index, a.generation, self._step, c, tensor_digest(reduced[chunk.start : chunk.end]),
                REDUCED, producer_replica=chunk.owner, receiver_replica=self._own,
            )
            self.reduced_receipts.append(stage_pb2.Receipt(
                stage=self._stage.ref(a.stage_index, self._own), step=self._step, micro_batch=c, sha256=fields.sha256,
                signature=self._signer.sign(fields), producer_replica=chunk.owner,
            ))

    def sign_shard(self, fields: ShardFields) -> bytes:
        return self._signer.sign(fields)

    def keep(self) -> bool:
        """The step ran: keep it for an audit if it is retained (its weights are read in place: the
        runtime defers its optimizer step); whether it is."""
        if self.record is None:
            return False
        self._stage.audit_record = self.record
        return True

    def _receipt(
        self, micro_batch: int, x: torch.Tensor, receiver: int, role: str, producer_replica: int,
        receiver_replica: int,
    ) -> stage_pb2.Receipt:
        """A signed receipt of activation `x` of `micro_batch`, from replica `producer_replica` of stage
        `receiver - 1` to replica `receiver_replica` of stage `receiver`."""
        a = self._stage.assignment
        fields = ReceiptFields(
            a.job_id, receiver, a.generation, self._step, micro_batch, tensor_digest(x), role,
            producer_replica=producer_replica, receiver_replica=receiver_replica,
        )
        return stage_pb2.Receipt(
            stage=self._stage.ref(receiver, receiver_replica),
            step=self._step,
            micro_batch=micro_batch,
            sha256=fields.sha256,
            signature=self._signer.sign(fields),
            producer_replica=producer_replica,
        )


def _replace(receipts: list[stage_pb2.Receipt], receipt: stage_pb2.Receipt) -> None:
    """Add `receipt` to `receipts`, in place of one of its micro-batch signed before (a repair sent it again)."""
    receipts[:] = [r for r in receipts if r.micro_batch != receipt.micro_batch]
    receipts.append(receipt)
