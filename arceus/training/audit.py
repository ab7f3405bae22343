"""Spot checks of the pipeline's forwards (Django-free; the driver runs them between steps).

Every audited train step, each stage that received activations returns one signed receipt per
micro-batch (role "received"), and each stage that sent activations one per micro-batch of what it
sent (role "sent"); all are checked against the signing node's public key, and every receiver's digest
is compared with its producer's. Where they differ, that micro-batch's forward is recomputed and the
party whose account the recomputation contradicts is failed, so a lying receiver cannot frame an
honest producer. Otherwise, with probability `plan.audit_rate` a step is sampled: one producing
stage i and one micro-batch m, chosen only after the step ran (every stage retained the step, so none
could tell what would be checked). The driver fetches stage i's weights, input and output of that
step, the output stage i+1 received (each matched against its receipt), has a node other than stage
i's recompute the forward from the declarative spec, and compares within `audit_rtol` / `audit_atol`.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path

import grpc
import torch

from arceus.contracts.spot_check import SpotCheckResult
from arceus.contracts.transfer import TransferConfig
from arceus.model.precision import BF16_TOLERANCE
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.stage_client import StageClient
from arceus.v1 import stage_pb2
from arceus.verify.receipts import RECEIVED, SENT, ReceiptError, ReceiptFields, verify_receipt
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.compression import decode_payload, encode

log = logging.getLogger(__name__)


class Auditor:
    def __init__(self, plan: TrainPlan, clients: list[StageClient], rng: random.Random | None = None) -> None:
        self.plan = plan
        self.clients = clients
        self.rng = rng or random.SystemRandom()  # unpredictable to the stages
        self._model_json = json.dumps(plan.model)

    def check(
        self, step: int, replies: list[stage_pb2.RunStepReply], inputs: list[torch.Tensor]
    ) -> list[SpotCheckResult]:
        """Check the receipts of a train step (each receiver's against its producer's: hashes only, every
        micro-batch), recompute a forward where the two disagree, else one sampled forward with
        probability `audit_rate`. A producer or receiver that answers its audit with an error fails the
        check; a stage out of reach, or the verifier failing, raises grpc.RpcError (the driver's usual error
        path)."""
        n = len(self.clients)
        received: list[dict[int, stage_pb2.Receipt]] = [{} for _ in self.clients]  # by receiving stage
        sent: list[dict[int, stage_pb2.Receipt]] = [{} for _ in self.clients]  # by producing stage
        checks = []
        for j in range(1, n):
            received[j], failure = self._receipts(step, j, j, RECEIVED, replies[j].receipts, len(inputs))
            checks += [failure] if failure is not None else []
            sent[j - 1], failure = self._receipts(step, j - 1, j, SENT, replies[j - 1].sent_receipts, len(inputs))
            checks += [failure] if failure is not None else []
        if checks:
            return checks  # a receipt that does not verify is news enough
        nodes = {c.endpoint.node_id for c in self.clients}
        disputes = [(i, m) for i in range(n - 1) for m in range(len(inputs))
                    if sent[i][m].sha256 != received[i + 1][m].sha256]
        if disputes:
            # The producer and the receiver give different accounts: the recomputation says who is right.
            i, m = disputes[0]
            return [c for c in [self._recompute(step, i, m, inputs[m], received, sent)] if c is not None]
        # A recomputation needs a node other than the producer's.
        if len(nodes) > 1 and self.rng.random() < self.plan.audit_rate:
            i, m = self.rng.randrange(n - 1), self.rng.randrange(len(inputs))
            check = self._recompute(step, i, m, inputs[m], received, sent)
            checks += [check] if check is not None else []
        return checks

    def _receipts(
        self, step: int, signer: int, receiver: int, role: str, signed: Iterable[stage_pb2.Receipt], count: int
    ) -> tuple[dict[int, stage_pb2.Receipt], SpotCheckResult | None]:
        """Stage `signer`'s receipts (role `role`) for the activations stage `receiver` got, one per
        micro-batch, verified against the signer's key; else a failed check of the signer."""
        endpoint = self.clients[signer].endpoint
        by_micro_batch: dict[int, stage_pb2.Receipt] = {}
        try:
            for r in signed:
                fields = ReceiptFields(self.plan.job_id, receiver, self.plan.generation, step, r.micro_batch, r.sha256,
                                       role)
                if (r.stage.job_id, r.stage.stage_index, r.stage.generation, r.step) != (
                    self.plan.job_id, receiver, self.plan.generation, step
                ):
                    raise ReceiptError(f"a receipt names stage {r.stage.stage_index} step {r.step}, not this one")
                verify_receipt(endpoint.public_key, fields, r.signature)
                by_micro_batch[r.micro_batch] = r
            if sorted(by_micro_batch) != list(range(count)):
                raise ReceiptError(f"{role} receipts cover micro-batches {sorted(by_micro_batch)} of {count}")
        except ReceiptError as exc:
            bad = "bad receipts" if role == RECEIVED else "bad sent receipts"
            return by_micro_batch, SpotCheckResult(step, -1, signer, endpoint.node_id, False, f"{bad}: {exc}")
        return by_micro_batch, None

    def _recompute(
        self,
        step: int,
        i: int,
        m: int,
        driver_input: torch.Tensor,
        received: list[dict[int, stage_pb2.Receipt]],
        sent: list[dict[int, stage_pb2.Receipt]],
    ) -> SpotCheckResult | None:
        """Recompute stage i's forward of micro-batch m on an independent node; None where there is none."""
        producer, receiver = self.clients[i], self.clients[i + 1]
        node, receiver_node = producer.endpoint.node_id, receiver.endpoint.node_id
        try:
            kept = producer.audit(step, m)
        except grpc.RpcError as exc:
            return _refused(exc, step, m, i, node)
        x = driver_input if i == 0 else kept.received
        if i > 0 and (x is None or tensor_digest(x) != received[i][m].sha256):
            return SpotCheckResult(step, m, i, node, False, "returned an input other than the one it signed for")
        if kept.sent is None or tensor_digest(kept.sent) != sent[i][m].sha256:
            return SpotCheckResult(
                step, m, i, node, False, "returned a sent activation other than the one it signed for"
            )
        try:
            got = receiver.audit(step, m).received
        except grpc.RpcError as exc:
            return _refused(exc, step, m, i + 1, receiver_node)
        receipt, sent_receipt = received[i + 1][m], sent[i][m]
        if got is None or tensor_digest(got) != receipt.sha256:
            # The receiver kept something else than it signed for: its word is worthless, not the producer's.
            return SpotCheckResult(step, m, i + 1, receiver_node, False,
                             "returned an activation other than the one it signed for")
        verifier = self._verifier(producer.endpoint, receiver.endpoint)
        if verifier is None:
            log.warning("step %d: no node of another owner than stage %d's can recompute its forward", step, i)
            return None
        e = producer.endpoint
        # The producer's weights go from it to the verifier through a file: no message or buffer here
        # holds the stage.
        with tempfile.TemporaryDirectory(prefix="arceus-audit-") as directory:
            weights = Path(directory) / "weights.safetensors"
            try:
                producer.save_audit_weights(step, weights)
            except grpc.RpcError as exc:
                return _refused(exc, step, m, i, node)
            expected = verifier.verify_forward(
                self._model_json, e.layer_start, e.layer_end, weights, x, self.plan.precision
            )
        signed = {"receipt_sha256": receipt.sha256.hex(), "receipt_signature": receipt.signature.hex(),
                  "sent_sha256": sent_receipt.sha256.hex(), "sent_signature": sent_receipt.signature.hex(),
                  "verifier_node_id": verifier.endpoint.node_id, "producer_index": i}
        where = f"step {step} micro-batch {m}"
        if expected.shape != kept.sent.shape:
            return SpotCheckResult(step, m, i, node, False,
                             f"{where}: sent shape {list(kept.sent.shape)}; the recomputed forward is "
                             f"{list(expected.shape)}", max_abs_diff=float("inf"), **signed)
        expected, slack = _as_sent(expected, self.plan.transfer)
        diff = float((expected - kept.sent).abs().max()) if expected.numel() else 0.0
        rtol, atol = self.plan.audit_rtol, self.plan.audit_atol
        if self.plan.precision == "bf16":  # another summation order moves bf16 results by a few roundings
            rtol, atol = max(rtol, BF16_TOLERANCE), max(atol, BF16_TOLERANCE)
        honest = torch.allclose(kept.sent, expected, rtol=rtol, atol=atol + slack)
        tolerance = f"(rtol {rtol}, atol {atol})"
        if receipt.sha256 != sent_receipt.sha256 and honest:
            # The producer's account holds up against the recomputation: the receiver's does not.
            return SpotCheckResult(step, m, i + 1, receiver_node, False,
                             f"{where}: signed for an activation other than the one stage {i} sent, which matches "
                             f"the recomputation on node {verifier.endpoint.node_id} (max |diff| {diff:.3g})",
                             max_abs_diff=diff, **signed)
        detail = (
            f"{where}: output matches the recomputation on node {verifier.endpoint.node_id} (max |diff| {diff:.3g})"
            if honest
            else f"{where}: output differs from the recomputation on node {verifier.endpoint.node_id} by up to "
            f"{diff:.3g} {tolerance}"
            + (f"; stage {i + 1} signed for another activation" if receipt.sha256 != sent_receipt.sha256 else "")
        )
        return SpotCheckResult(step, m, i, node, bool(honest), detail, max_abs_diff=diff, **signed)

    def _verifier(self, producer: StageEndpoint, receiver: StageEndpoint) -> StageClient | None:
        """A stage on a node of another owner than the producer's (no contributor checks its own work),
        preferably of neither the producer's nor the receiver's; None where every other node is the producer's
        owner's."""
        independent = [c for c in self.clients if not _same_party(c.endpoint, producer)]
        preferred = [c for c in independent if not _same_party(c.endpoint, receiver)]
        pool = preferred or independent
        return self.rng.choice(pool) if pool else None


def _same_party(a: StageEndpoint, b: StageEndpoint) -> bool:
    """One node, or two nodes of one owner (an unknown owner, "", is no one's in particular)."""
    return a.node_id == b.node_id or (bool(a.owner_id) and a.owner_id == b.owner_id)


# Codes that say the agent could not be reached or ran out of time: the driver's usual failure path (the node
# may be gone; the reconciler decides). Any other answer to an audit is a refusal, and fails the check.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _refused(error: grpc.RpcError, step: int, m: int, stage: int, node: str) -> SpotCheckResult:
    """A stage that will not show what it kept of an audited step fails the check; one out of reach raises."""
    code = error.code() if isinstance(error, grpc.Call) else None
    if code is None or code in _UNREACHABLE:
        raise error
    return SpotCheckResult(
        step, m, stage, node, False, f"refused its audit of step {step} micro-batch {m}: {code.name}: {error.details()}"
    )


def _as_sent(expected: torch.Tensor, transfer: TransferConfig) -> tuple[torch.Tensor, float]:
    """The recomputed activation as the job's transfer encoding delivers it, and the slack that rounding
    needs: the producer's output may differ from the recomputation in the last float bits, which can
    put a value on the other side of a rounding boundary (one int8/fp16/bf16 step at most)."""
    if transfer.activations == "fp32" or not expected.numel():
        return expected, 0.0
    sent = decode_payload(encode(expected, transfer.activations, block_size=transfer.block_size))
    return sent, 2 * float((sent - expected).abs().max())
