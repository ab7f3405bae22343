"""Spot checks of the pipeline's forwards (Django-free; the driver runs them between steps).

Every audited train step, each stage that received activations returns one signed receipt per
micro-batch; all are checked against the receiving node's public key. With probability
`plan.audit_rate` a step is sampled: one producing stage i and one micro-batch m, chosen only after
the step ran (every stage retained the step, so none could tell what would be checked). The driver
fetches stage i's weights and input of that step, the output stage i+1 received (both matched against
their receipts), has a node other than stage i's recompute the forward from the declarative spec,
and compares the two within `audit_rtol` / `audit_atol`.
"""

from __future__ import annotations

import json
import random

import torch

from arceus.training.plan import SpotCheck, TrainPlan
from arceus.training.stage_client import StageClient
from arceus.v1 import stage_pb2
from arceus.verify.receipts import ReceiptError, ReceiptFields, tensor_digest, verify_receipt
from arceus.wire.compression import decode_payload, encode
from arceus.wire.transfer import TransferConfig


class Auditor:
    def __init__(self, plan: TrainPlan, clients: list[StageClient], rng: random.Random | None = None) -> None:
        self.plan = plan
        self.clients = clients
        self.rng = rng or random.SystemRandom()  # unpredictable to the stages
        self._model_json = json.dumps(plan.model)

    def check(
        self, step: int, replies: list[stage_pb2.RunStepReply], inputs: list[torch.Tensor]
    ) -> list[SpotCheck]:
        """Check the receipts of a train step, and recompute one sampled forward with probability
        `audit_rate`. Stage calls that fail raise grpc.RpcError (the driver's usual error path)."""
        receipts: list[dict[int, stage_pb2.Receipt]] = [{} for _ in self.clients]
        checks = []
        for j in range(1, len(self.clients)):
            receipts[j], failure = self._receipts(step, j, replies[j], len(inputs))
            if failure is not None:
                checks.append(failure)
        # A recomputation needs a node other than the producer's; a failed receipt check is news enough.
        nodes = {c.endpoint.node_id for c in self.clients}
        if len(nodes) > 1 and self.rng.random() < self.plan.audit_rate and not checks:
            i, m = self.rng.randrange(len(self.clients) - 1), self.rng.randrange(len(inputs))
            checks.append(self._recompute(step, i, m, inputs[m], receipts))
        return checks

    def _receipts(
        self, step: int, j: int, reply: stage_pb2.RunStepReply, num_micro_batches: int
    ) -> tuple[dict[int, stage_pb2.Receipt], SpotCheck | None]:
        endpoint = self.clients[j].endpoint
        by_micro_batch: dict[int, stage_pb2.Receipt] = {}
        try:
            for r in reply.receipts:
                fields = ReceiptFields(self.plan.job_id, j, self.plan.generation, step, r.micro_batch, r.sha256)
                if (r.stage.job_id, r.stage.stage_index, r.stage.generation, r.step) != (
                    self.plan.job_id, j, self.plan.generation, step
                ):
                    raise ReceiptError(f"a receipt names stage {r.stage.stage_index} step {r.step}, not this one")
                verify_receipt(endpoint.public_key, fields, r.signature)
                by_micro_batch[r.micro_batch] = r
            if sorted(by_micro_batch) != list(range(num_micro_batches)):
                raise ReceiptError(
                    f"receipts cover micro-batches {sorted(by_micro_batch)} of {num_micro_batches}"
                )
        except ReceiptError as exc:
            return by_micro_batch, SpotCheck(step, -1, j, endpoint.node_id, False, f"bad receipts: {exc}")
        return by_micro_batch, None

    def _recompute(
        self, step: int, i: int, m: int, driver_input: torch.Tensor, receipts: list[dict[int, stage_pb2.Receipt]]
    ) -> SpotCheck:
        producer, receiver = self.clients[i], self.clients[i + 1]
        node = producer.endpoint.node_id
        weights, x = producer.audit(step, m)
        if i == 0:
            x = driver_input
        elif x is None or tensor_digest(x) != receipts[i][m].sha256:
            return SpotCheck(step, m, i, node, False, "returned an input other than the one it signed for")
        _, received = receiver.audit(step, m)
        receipt = receipts[i + 1][m]
        if received is None or tensor_digest(received) != receipt.sha256:
            # The receiver kept something else than it signed for: its word is worthless, not the producer's.
            return SpotCheck(step, m, i + 1, receiver.endpoint.node_id, False,
                             "returned an activation other than the one it signed for")
        verifier = self._verifier(node, receiver.endpoint.node_id)
        e = producer.endpoint
        expected = verifier.verify_forward(self._model_json, e.layer_start, e.layer_end, weights, x)
        signed = {"receipt_sha256": receipt.sha256.hex(), "receipt_signature": receipt.signature.hex()}
        if expected.shape != received.shape:
            return SpotCheck(step, m, i, node, False,
                             f"sent shape {list(received.shape)}; the recomputed forward is {list(expected.shape)}",
                             verifier.endpoint.node_id, float("inf"), **signed)
        expected, slack = _as_sent(expected, self.plan.transfer)
        diff = float((expected - received).abs().max()) if received.numel() else 0.0
        passed = torch.allclose(received, expected, rtol=self.plan.audit_rtol, atol=self.plan.audit_atol + slack)
        detail = (
            f"step {step} micro-batch {m}: output matches the recomputation on node "
            f"{verifier.endpoint.node_id} (max |diff| {diff:.3g})"
            if passed
            else f"step {step} micro-batch {m}: output differs from the recomputation on node "
            f"{verifier.endpoint.node_id} by up to {diff:.3g} (rtol {self.plan.audit_rtol}, "
            f"atol {self.plan.audit_atol})"
        )
        return SpotCheck(step, m, i, node, bool(passed), detail, verifier.endpoint.node_id, diff, **signed)

    def _verifier(self, producer_node: str, receiver_node: str) -> StageClient:
        """A stage on another node: preferably neither the producer's nor the receiver's."""
        others = [c for c in self.clients if c.endpoint.node_id not in (producer_node, receiver_node)]
        others = others or [c for c in self.clients if c.endpoint.node_id != producer_node]
        return self.rng.choice(others)


def _as_sent(expected: torch.Tensor, transfer: TransferConfig) -> tuple[torch.Tensor, float]:
    """The recomputed activation as the job's transfer encoding delivers it, and the slack that rounding
    needs: the producer's output may differ from the recomputation in the last float bits, which can
    put a value on the other side of a rounding boundary (one int8/fp16/bf16 step at most)."""
    if transfer.activations == "fp32" or not expected.numel():
        return expected, 0.0
    sent = decode_payload(encode(expected, transfer.activations, block_size=transfer.block_size))
    return sent, 2 * float((sent - expected).abs().max())
