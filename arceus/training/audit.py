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

Replicated stages (arceus/swarm) are checked the same way, replica by replica: each replica signs for the
micro-batches its route gave it, naming the replica each activation came from and went to, so a receipt names
the producing replica (stage, replica id and, by its key, node); the sampled micro-batch is checked on the
replicas that took it, recomputed preferably by a sibling of the producer on another owner's node.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import grpc
import torch

from arceus.contracts.spot_check import SpotCheckResult
from arceus.contracts.transfer import TransferConfig
from arceus.model.precision import BF16_TOLERANCE
from arceus.swarm.routing import Routes
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.stage_client import StageClient
from arceus.v1 import stage_pb2
from arceus.verify.receipts import RECEIVED, SENT, ReceiptError, ReceiptFields, verify_receipt
from arceus.verify.tensor_digest import tensor_digest
from arceus.wire.compression import decode_payload, encode

log = logging.getLogger(__name__)


Parties = Mapping[tuple[int, int], tuple[StageClient, stage_pb2.RunStepReply]]  # (stage, replica) -> agent, reply


class Auditor:
    def __init__(self, plan: TrainPlan, rng: random.Random | None = None) -> None:
        self.plan = plan
        self.rng = rng or random.SystemRandom()  # unpredictable to the stages
        self._model_json = json.dumps(plan.model)

    def check(
        self, step: int, parties: Parties, inputs: list[torch.Tensor], routes: Routes | None = None
    ) -> list[SpotCheckResult]:
        """Check the receipts of a train step (each receiver's against its producer's: hashes only, every
        micro-batch), recompute a forward where the two disagree, else one sampled forward with
        probability `audit_rate`. `parties`: every agent that took the step, by (stage, replica), with its reply;
        `routes`: which replica of each stage took each micro-batch (None: one agent per stage, replica 0). A
        producer or receiver that answers its audit with an error fails the check; a stage out of reach, or the
        verifier failing, raises grpc.RpcError (the driver's usual error path)."""
        n = len(self.plan.stages)
        routes = routes or Routes.single(n, len(inputs))
        received: list[dict[int, stage_pb2.Receipt]] = [{} for _ in range(n)]  # by receiving stage
        sent: list[dict[int, stage_pb2.Receipt]] = [{} for _ in range(n)]  # by producing stage
        checks = []
        for (i, k), (client, reply) in sorted(parties.items()):
            if i > 0:
                got, failure = self._receipts(step, client, k, RECEIVED, reply.receipts, routes)
                received[i].update(got)
                checks += [failure] if failure is not None else []
            if i < n - 1:
                got, failure = self._receipts(step, client, k, SENT, reply.sent_receipts, routes)
                sent[i].update(got)
                checks += [failure] if failure is not None else []
        if checks:
            return checks  # a receipt that does not verify is news enough
        nodes = {client.endpoint.node_id for client, _ in parties.values()}
        disputes = [(i, m) for i in range(n - 1) for m in range(len(inputs))
                    if sent[i][m].sha256 != received[i + 1][m].sha256]
        if disputes:
            # The producer and the receiver give different accounts: the recomputation says who is right.
            i, m = disputes[0]
            return [c for c in [self._recompute(step, i, m, inputs[m], received, sent, parties, routes)] if c]
        # A recomputation needs a node other than the producer's.
        if n > 1 and len(nodes) > 1 and self.rng.random() < self.plan.audit_rate:
            i, m = self.rng.randrange(n - 1), self.rng.randrange(len(inputs))
            check = self._recompute(step, i, m, inputs[m], received, sent, parties, routes)
            checks += [check] if check is not None else []
        return checks

    def _receipts(
        self, step: int, signer: StageClient, replica: int, role: str, signed: Iterable[stage_pb2.Receipt],
        routes: Routes,
    ) -> tuple[dict[int, stage_pb2.Receipt], SpotCheckResult | None]:
        """The receipts of role `role` of replica `replica` of stage `signer.endpoint.index`, one per micro-batch its
        route gave it, each naming the replicas the routes say the activation went from and to, verified against
        the signer's key; else a failed check of the signer."""
        endpoint = signer.endpoint
        receiver = endpoint.index + (1 if role == SENT else 0)
        own = routes.micro_batches_of(endpoint.index, replica)
        by_micro_batch: dict[int, stage_pb2.Receipt] = {}
        try:
            for r in signed:
                if (r.stage.job_id, r.stage.stage_index, r.stage.generation, r.step) != (
                    self.plan.job_id, receiver, self.plan.generation, step
                ):
                    raise ReceiptError(f"a receipt names stage {r.stage.stage_index} step {r.step}, not this one")
                if r.micro_batch not in own:
                    raise ReceiptError(
                        f"a receipt names micro-batch {r.micro_batch}, not one of its route's {list(own)}"
                    )
                route = routes.of[r.micro_batch]
                if (r.producer_replica, r.stage.replica) != (route[receiver - 1], route[receiver]):
                    raise ReceiptError(
                        f"the receipt of micro-batch {r.micro_batch} names replicas {r.producer_replica} -> "
                        f"{r.stage.replica}; its route went {route[receiver - 1]} -> {route[receiver]}"
                    )
                fields = ReceiptFields(
                    self.plan.job_id, receiver, self.plan.generation, step, r.micro_batch, r.sha256, role,
                    producer_replica=r.producer_replica, receiver_replica=r.stage.replica,
                )
                verify_receipt(endpoint.public_key, fields, r.signature)
                by_micro_batch[r.micro_batch] = r
            if tuple(sorted(by_micro_batch)) != own:
                raise ReceiptError(f"{role} receipts cover micro-batches {sorted(by_micro_batch)} of {list(own)}")
        except ReceiptError as exc:
            bad = "bad receipts" if role == RECEIVED else "bad sent receipts"
            return by_micro_batch, SpotCheckResult(
                step, -1, endpoint.index, endpoint.node_id, False, f"{bad}: {exc}", replica=replica
            )
        return by_micro_batch, None

    def _recompute(
        self,
        step: int,
        i: int,
        m: int,
        driver_input: torch.Tensor,
        received: list[dict[int, stage_pb2.Receipt]],
        sent: list[dict[int, stage_pb2.Receipt]],
        parties: Parties,
        routes: Routes,
    ) -> SpotCheckResult | None:
        """Recompute the forward of micro-batch m by the replica of stage i that took it, on an independent node (a
        sibling replica of the producer's where one is); None where there is none."""
        k, k_next = routes.of[m][i], routes.of[m][i + 1]
        (producer, _), (receiver, _) = parties[(i, k)], parties[(i + 1, k_next)]
        node, receiver_node = producer.endpoint.node_id, receiver.endpoint.node_id
        of_producer = {"replica": k, "producer_replica": k, "receiver_replica": k_next}
        of_receiver = {"replica": k_next, "producer_replica": k, "receiver_replica": k_next}
        try:
            kept = producer.audit(step, m)
        except grpc.RpcError as exc:
            return _refused(exc, step, m, i, node, of_producer)
        x = driver_input if i == 0 else kept.received
        if i > 0 and (x is None or tensor_digest(x) != received[i][m].sha256):
            return SpotCheckResult(step, m, i, node, False, "returned an input other than the one it signed for",
                                   **of_producer)
        if kept.sent is None or tensor_digest(kept.sent) != sent[i][m].sha256:
            return SpotCheckResult(
                step, m, i, node, False, "returned a sent activation other than the one it signed for", **of_producer
            )
        try:
            got = receiver.audit(step, m).received
        except grpc.RpcError as exc:
            return _refused(exc, step, m, i + 1, receiver_node, of_receiver)
        receipt, sent_receipt = received[i + 1][m], sent[i][m]
        if got is None or tensor_digest(got) != receipt.sha256:
            # The receiver kept something else than it signed for: its word is worthless, not the producer's.
            return SpotCheckResult(step, m, i + 1, receiver_node, False,
                                   "returned an activation other than the one it signed for", **of_receiver)
        verifier = self._verifier(producer.endpoint, receiver.endpoint, [c for c, _ in parties.values()])
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
                return _refused(exc, step, m, i, node, of_producer)
            expected = verifier.verify_forward(
                self._model_json, e.layer_start, e.layer_end, weights, x, self.plan.precision
            )
        signed = {"receipt_sha256": receipt.sha256.hex(), "receipt_signature": receipt.signature.hex(),
                  "sent_sha256": sent_receipt.sha256.hex(), "sent_signature": sent_receipt.signature.hex(),
                  "verifier_node_id": verifier.endpoint.node_id, "producer_index": i}
        where = f"step {step} micro-batch {m}" + (f" (stage {i} replica {k})" if self.plan.replicas else "")
        if expected.shape != kept.sent.shape:
            return SpotCheckResult(step, m, i, node, False,
                                   f"{where}: sent shape {list(kept.sent.shape)}; the recomputed forward is "
                                   f"{list(expected.shape)}", max_abs_diff=float("inf"), **signed, **of_producer)
        expected, slack = _as_sent(expected, self.plan.transfer)
        diff = float((expected - kept.sent).abs().max()) if expected.numel() else 0.0
        rtol, atol = self.plan.audit_rtol, self.plan.audit_atol
        if self.plan.precision == "bf16":  # another summation order moves bf16 results by a few roundings
            rtol, atol = max(rtol, BF16_TOLERANCE), max(atol, BF16_TOLERANCE)
        honest = torch.allclose(kept.sent, expected, rtol=rtol, atol=atol + slack)
        tolerance = f"(rtol {rtol}, atol {atol})"
        on = f"node {verifier.endpoint.node_id}" + (
            f" (stage {verifier.endpoint.index} replica {verifier.endpoint.replica})" if self.plan.replicas else ""
        )
        if receipt.sha256 != sent_receipt.sha256 and honest:
            # The producer's account holds up against the recomputation: the receiver's does not.
            return SpotCheckResult(step, m, i + 1, receiver_node, False,
                                   f"{where}: signed for an activation other than the one stage {i} sent, which "
                                   f"matches the recomputation on {on} (max |diff| {diff:.3g})",
                                   max_abs_diff=diff, **signed, **of_receiver)
        detail = (
            f"{where}: output matches the recomputation on {on} (max |diff| {diff:.3g})"
            if honest
            else f"{where}: output differs from the recomputation on {on} by up to "
            f"{diff:.3g} {tolerance}"
            + (f"; stage {i + 1} signed for another activation" if receipt.sha256 != sent_receipt.sha256 else "")
        )
        return SpotCheckResult(step, m, i, node, bool(honest), detail, max_abs_diff=diff, **signed, **of_producer)

    def _verifier(
        self, producer: StageEndpoint, receiver: StageEndpoint, clients: Sequence[StageClient]
    ) -> StageClient | None:
        """A stage on a node of another owner than the producer's (no contributor checks its own work): a sibling
        replica of the producer's where one is (it holds the same stage), else preferably of neither the producer's
        nor the receiver's owner; None where every other node is the producer's owner's."""
        independent = [c for c in clients if not _same_party(c.endpoint, producer)]
        siblings = [c for c in independent if c.endpoint.index == producer.index]
        preferred = [c for c in independent if not _same_party(c.endpoint, receiver)]
        pool = siblings or preferred or independent
        return self.rng.choice(pool) if pool else None


def _same_party(a: StageEndpoint, b: StageEndpoint) -> bool:
    """One node, or two nodes of one owner (an unknown owner, "", is no one's in particular)."""
    return a.node_id == b.node_id or (bool(a.owner_id) and a.owner_id == b.owner_id)


# Codes that say the agent could not be reached or ran out of time: the driver's usual failure path (the node
# may be gone; the reconciler decides). Any other answer to an audit is a refusal, and fails the check.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _refused(
    error: grpc.RpcError, step: int, m: int, stage: int, node: str, replicas: Mapping[str, int]
) -> SpotCheckResult:
    """A stage that will not show what it kept of an audited step fails the check; one out of reach raises."""
    code = error.code() if isinstance(error, grpc.Call) else None
    if code is None or code in _UNREACHABLE:
        raise error
    return SpotCheckResult(
        step, m, stage, node, False,
        f"refused its audit of step {step} micro-batch {m}: {code.name}: {error.details()}", **replicas,
    )


def _as_sent(expected: torch.Tensor, transfer: TransferConfig) -> tuple[torch.Tensor, float]:
    """The recomputed activation as the job's transfer encoding delivers it, and the slack that rounding
    needs: the producer's output may differ from the recomputation in the last float bits, which can
    put a value on the other side of a rounding boundary (one int8/fp16/bf16 step at most)."""
    if transfer.activations == "fp32" or not expected.numel():
        return expected, 0.0
    sent = decode_payload(encode(expected, transfer.activations, block_size=transfer.block_size))
    return sent, 2 * float((sent - expected).abs().max())
