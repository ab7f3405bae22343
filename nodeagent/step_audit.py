"""What a step signs and keeps for spot checks: a receipt for every activation the stage accepts from its
previous stage (role "received"), and, on a retained train step, one for every activation it sends on
(role "sent", as the receiver decodes it) plus the activations an audit may ask for."""

from __future__ import annotations

import torch

from arceus.v1 import stage_pb2
from arceus.verify.receipts import RECEIVED, SENT, ReceiptFields, ReceiptSigner
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.compression import Encoded, decode_payload
from nodeagent.stage import HostedStage
from nodeagent.verify import AuditRecord


class StepAudit:
    def __init__(self, stage: HostedStage, step: int, signer: ReceiptSigner, *, retain: bool) -> None:
        self._stage, self._step, self._signer = stage, step, signer
        self.receipts: list[stage_pb2.Receipt] = []
        self.sent_receipts: list[stage_pb2.Receipt] = []
        self.record = AuditRecord(step) if retain else None
        stage.audit_record = None  # the previous step's is no longer auditable

    def received(self, micro_batch: int, x: torch.Tensor) -> None:
        """An activation accepted from the previous stage."""
        index = self._stage.assignment.stage_index
        self.receipts.append(self._receipt(micro_batch, x, index, RECEIVED))
        if self.record is not None:
            self.record.received[micro_batch] = x

    def sent(self, micro_batch: int, out: torch.Tensor, encoded: Encoded) -> None:
        """An activation sent on to the next stage, as `encoded` for the wire."""
        if self.record is None:
            return
        delivered = out.detach() if encoded.encoding == "fp32" else decode_payload(encoded)
        self.record.sent[micro_batch] = delivered
        self.sent_receipts.append(
            self._receipt(micro_batch, delivered, self._stage.assignment.stage_index + 1, SENT)
        )

    def keep(self) -> bool:
        """The step ran: keep it for an audit if it is retained (its weights are read in place: the
        runtime defers its optimizer step); whether it is."""
        if self.record is None:
            return False
        self._stage.audit_record = self.record
        return True

    def _receipt(self, micro_batch: int, x: torch.Tensor, receiver: int, role: str) -> stage_pb2.Receipt:
        a = self._stage.assignment
        fields = ReceiptFields(a.job_id, receiver, a.generation, self._step, micro_batch, tensor_digest(x), role)
        return stage_pb2.Receipt(
            stage=self._stage.ref(receiver),
            step=self._step,
            micro_batch=micro_batch,
            sha256=fields.sha256,
            signature=self._signer.sign(fields),
        )
