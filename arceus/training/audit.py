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
replicas that took it, recomputed preferably by a sibling of the producer on another owner's node. A repaired step
(arceus.swarm.repair) is checked the same way: each survivor's reply signs for everything it did in the step, in the
attempt the loss cut short too. The partial checked is drawn replica by replica (`sampled_partial`).

Who checks the checker: a verdict that would fail anyone needs a second verifier of yet another owner where there is
one (`Auditor._votes`); verifiers are asked until two agree, and each verifier overruled fails a check of kind
VERIFICATION.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from arceus.contracts.spot_check import PARTIAL_GRADIENT, VERIFICATION, SpotCheckResult
from arceus.contracts.transfer import TransferConfig
from arceus.model.precision import BF16_TOLERANCE
from arceus.model.registry import model_spec_from_config
from arceus.swarm.exchange import chunk_bounds, exchange_elements, reduce_in_order, shard_bounds
from arceus.swarm.routing import Routes
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.stage_client import StageClient
from arceus.v1 import stage_pb2
from arceus.verify.receipts import (
    GRADIENT,
    PARTIAL,
    RECEIVED,
    REDUCED,
    SENT,
    ReceiptError,
    ReceiptFields,
    ShardFields,
    verify_receipt,
    verify_shard,
)
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
        self, step: int, parties: Parties, inputs: Sequence[torch.Tensor], routes: Routes | None = None,
        labels: Sequence[torch.Tensor] | None = None, moved: Collection[tuple[int, int]] = (),
    ) -> list[SpotCheckResult]:
        """Check the receipts of a train step (each receiver's against its producer's: hashes only, every
        micro-batch), recompute a forward where the two disagree, else one sampled forward with
        probability `audit_rate`. `parties`: every agent that took the step, by (stage, replica), with its reply;
        `routes`: which replica of each stage took each micro-batch (None: one agent per stage, replica 0); and,
        replicated, with probability `audit_rate` one sampled replica's partial gradient recomputed by a sibling
        (`labels`: the step's, per micro-batch, for the last stage's). A repaired step (arceus.swarm.repair) is
        checked the same way on the repair's `routes`: each survivor signs for all it did in the step, before the
        loss too, and `moved` names the (stage, micro-batch)s of the lost replicas that survivors recomputed; an
        activation its receiver held from a lost replica (it signed for that one) is compared with no survivor's.
        A producer or receiver that answers its audit with an error fails the check; a stage out of reach, or the
        verifier failing, raises grpc.RpcError (the driver's usual error path)."""
        n = len(self.plan.stages)
        routes = routes or Routes.single(n, len(inputs))
        moved = frozenset(moved)
        received: list[dict[int, stage_pb2.Receipt]] = [{} for _ in range(n)]  # by receiving stage
        sent: list[dict[int, stage_pb2.Receipt]] = [{} for _ in range(n)]  # by producing stage
        checks = []
        for (i, k), (client, reply) in sorted(parties.items()):
            if i > 0:
                got, failure = self._receipts(step, client, k, RECEIVED, reply.receipts, routes, moved)
                received[i].update(got)
                checks += [failure] if failure is not None else []
            if i < n - 1:
                got, failure = self._receipts(step, client, k, SENT, reply.sent_receipts, routes, moved)
                sent[i].update(got)
                checks += [failure] if failure is not None else []
        evidence = self._exchange_evidence(step, parties, routes) if self.plan.replicas else None
        if evidence is not None:
            checks += evidence.failures
        if checks:
            return checks  # a receipt that does not verify is news enough
        nodes = {client.endpoint.node_id for client, _ in parties.values()}
        # Where the receiver signed for its route's producer, the two accounts are of one activation.
        pairs = [(i, m) for i in range(n - 1) for m in range(len(inputs))
                 if received[i + 1][m].producer_replica == routes.of[m][i]]
        disputes = [(i, m) for i, m in pairs if sent[i][m].sha256 != received[i + 1][m].sha256]
        if disputes:
            # The producer and the receiver give different accounts: the recomputation says who is right.
            i, m = disputes[0]
            return self._recompute(step, i, m, inputs[m], received, sent, parties, routes)
        # A recomputation needs a node other than the producer's.
        if pairs and len(nodes) > 1 and self.rng.random() < self.plan.audit_rate:
            i, m = self.rng.randrange(n - 1), self.rng.randrange(len(inputs))
            if (i, m) not in pairs:
                i, m = self.rng.choice(pairs)  # each of `pairs` is as likely as the others still
            checks += self._recompute(step, i, m, inputs[m], received, sent, parties, routes)
        replicated = any(len(ids) > 1 for ids in routes.members)
        if evidence is not None and replicated and self.rng.random() < self.plan.audit_rate:
            i, _, m = sampled_partial(routes, self.rng)
            checks += self._partial(step, i, m, inputs, labels or [], received, evidence, parties, routes, moved)
        return checks

    def _exchange_evidence(self, step: int, parties: Parties, routes: Routes) -> _Evidence:
        """The signed evidence of a replicated step's exchanges: each member's partial-gradient digest, the gradients
        each replica signed for sending upstream (by receiving stage and micro-batch), and the shards each member
        kept of its siblings' (each signature checked against its sender's key: the member checked it on receipt).
        Whatever does not verify is a failed check of its signer (a kept shard's: of the member that kept it)."""
        evidence = _Evidence()
        for (i, k), (client, reply) in sorted(parties.items()):
            e = client.endpoint
            try:
                if len(routes.members[i]) > 1:
                    r = reply.partial_receipt
                    if not reply.HasField("partial_receipt") or (
                        r.stage.job_id, r.stage.stage_index, r.stage.generation, r.stage.replica, r.step
                    ) != (self.plan.job_id, i, self.plan.generation, k, step):
                        raise ReceiptError("no partial-gradient receipt of this step")
                    verify_receipt(e.public_key, ReceiptFields(
                        self.plan.job_id, i, self.plan.generation, step, -1, r.sha256, PARTIAL, k, k
                    ), r.signature)
                    evidence.partials[(i, k)] = r.sha256
                    members = routes.members[i]
                    reduced = {}
                    for chunk in reply.reduced_receipts:
                        c = chunk.micro_batch
                        if chunk.step != step or not 0 <= c < len(members) or chunk.producer_replica != members[c] or (
                            chunk.stage.stage_index, chunk.stage.replica) != (i, k):
                            raise ReceiptError(f"a receipt of the summed gradient names chunk {c} of replica "
                                               f"{chunk.producer_replica}, not one of this step's exchange")
                        verify_receipt(e.public_key, ReceiptFields(
                            self.plan.job_id, i, self.plan.generation, step, c, chunk.sha256, REDUCED, members[c], k
                        ), chunk.signature)
                        reduced[c] = chunk.sha256
                    if sorted(reduced) != list(range(len(members))):
                        raise ReceiptError(f"receipts of the summed gradient cover chunks {sorted(reduced)} of "
                                           f"{len(members)}")
                    evidence.reduced[(i, k)] = reduced
                if i > 0:
                    own = routes.micro_batches_of(i, k)
                    for r in reply.gradient_receipts:
                        m = r.micro_batch
                        if r.step != step or m not in own or (r.stage.stage_index, r.stage.replica) != (
                            i - 1, routes.of[m][i - 1]
                        ) or r.producer_replica != k:
                            raise ReceiptError(f"a gradient receipt names micro-batch {m} of stage "
                                               f"{r.stage.stage_index} replica {r.stage.replica}, not its route's")
                        verify_receipt(e.public_key, ReceiptFields(
                            self.plan.job_id, i - 1, self.plan.generation, step, m, r.sha256, GRADIENT, k,
                            r.stage.replica,
                        ), r.signature)
                        evidence.gradients[(i - 1, m)] = r.sha256
                    if sorted(m for (s, m) in evidence.gradients if s == i - 1 and m in own) != list(own):
                        raise ReceiptError(f"gradient receipts do not cover its micro-batches {list(own)}")
            except ReceiptError as exc:
                evidence.failures.append(SpotCheckResult(step, -1, i, e.node_id, False, f"bad receipts: {exc}",
                                                         replica=k))
                continue
            for shard in reply.shard_receipts:
                sender = parties.get((i, shard.source_replica))
                try:
                    if sender is None:
                        raise ReceiptError(f"replica {shard.source_replica} took no part in this step")
                    verify_shard(sender[0].endpoint.public_key, ShardFields(
                        self.plan.job_id, i, self.plan.generation, step, shard.epoch, shard.source_replica,
                        shard.start, shard.length, shard.sha256,
                    ), shard.signature)
                except ReceiptError as exc:
                    evidence.failures.append(SpotCheckResult(
                        step, -1, i, e.node_id, False, f"kept a gradient shard its sender did not sign: {exc}",
                        replica=k,
                    ))
                    break
                evidence.shards.setdefault((i, k), []).append(shard)
        return evidence

    def _partial(
        self, step: int, i: int, m: int, inputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
        received: list[dict[int, stage_pb2.Receipt]], evidence: _Evidence, parties: Parties, routes: Routes,
        moved: Collection[tuple[int, int]],
    ) -> list[SpotCheckResult]:
        """Check the partial gradient of the replica of stage i that took micro-batch m: what it kept matches the
        digest it signed, every shard it pushed to a sibling (as the sibling kept it, under its signature) is that
        partial's, and a sibling replica of another owner, recomputing it with its own weights of the step from the
        inputs and gradients it signed for, gets the same within tolerance. None where no such sibling is, or where
        a gradient it holds came from a replica lost since (a repaired step: `moved`) and is not bit for bit the one
        its recomputation sent (only the lost replica signed for what it sent)."""
        k = routes.of[m][i]
        client = parties[(i, k)][0]
        e, node, last = client.endpoint, client.endpoint.node_id, i == len(self.plan.stages) - 1
        own = routes.micro_batches_of(i, k)
        ids = {"replica": k, "producer_replica": k, "receiver_replica": k}
        where = f"step {step} stage {i} replica {k}"

        def failed(what: str, stage_node: str = node, **replicas: int) -> SpotCheckResult:
            return SpotCheckResult(step, m, i, stage_node, False, f"{where}: {what}", kind=PARTIAL_GRADIENT,
                                   **(replicas or ids))

        elements = exchange_elements(model_spec_from_config(self.plan.model), e.layer_start, e.layer_end)
        try:
            partial = client.audit_partial(step, elements)
        except grpc.RpcError as exc:
            return [_refused(exc, step, m, i, node, ids)]
        except ValueError as exc:
            return [failed(f"returned a malformed partial gradient: {exc}")]
        if tensor_digest(partial) != evidence.partials[(i, k)]:
            return [failed("returned a partial gradient other than the one it signed for")]
        members = routes.members[i]
        for chunk in chunk_bounds(elements, members):
            if chunk.owner == k:
                continue
            kept = sorted((s for s in evidence.shards.get((i, chunk.owner), []) if s.source_replica == k),
                          key=lambda s: s.start)
            spans = [(s.start, s.start + s.length) for s in kept]
            if spans != list(shard_bounds(chunk, 4)):
                owner = parties[(i, chunk.owner)][0].endpoint.node_id
                return [failed(f"replica {chunk.owner} kept no full signed account of the shards replica {k} pushed to "
                              "it", owner, replica=chunk.owner, producer_replica=k, receiver_replica=chunk.owner)]
            for s in kept:
                if tensor_digest(partial[s.start : s.start + s.length]) != s.sha256:
                    return [failed(f"pushed replica {chunk.owner} a gradient shard at element {s.start} other than the "
                                  "partial gradient it signed for")]
        owned = [(c, chunk) for c, chunk in enumerate(chunk_bounds(elements, members)) if chunk.owner == k]
        if any(chunk.end > chunk.start for _, chunk in owned):
            # Its own chunk it summed itself: its siblings' signed partials, as they pushed them to it, must add up
            # (in ascending replica id, as the exchange adds) to what it signed for applying.
            partials = {k: partial}
            for s in members:
                if s == k:
                    continue
                sibling = parties[(i, s)][0]
                s_ids = {"replica": s, "producer_replica": s, "receiver_replica": s}
                try:
                    partials[s] = sibling.audit_partial(step, elements)
                except grpc.RpcError as exc:
                    return [_refused(exc, step, m, i, sibling.endpoint.node_id, s_ids)]
                except ValueError as exc:
                    return [failed(f"replica {s} returned a malformed partial gradient: {exc}",
                                  sibling.endpoint.node_id, **s_ids)]
                if tensor_digest(partials[s]) != evidence.partials[(i, s)]:
                    return [failed(f"replica {s} returned a partial gradient other than the one it signed for",
                                  sibling.endpoint.node_id, **s_ids)]
                for shard in evidence.shards.get((i, k), []):
                    if shard.source_replica == s and tensor_digest(
                        partials[s][shard.start : shard.start + shard.length]
                    ) != shard.sha256:
                        return [failed(f"replica {s} pushed replica {k} a gradient shard at element {shard.start} "
                                      "other than the partial gradient it signed for", sibling.endpoint.node_id,
                                      **s_ids)]
            for c, chunk in owned:
                total = reduce_in_order({s: p[chunk.start : chunk.end] for s, p in partials.items()})
                if evidence.reduced[(i, k)][c] != tensor_digest(total):
                    return [failed(f"summed chunk {c} (elements [{chunk.start}, {chunk.end})) of the exchange other "
                                  "than its members' signed partial gradients add up to")]
                if differing := [s for s in members if evidence.reduced[(i, s)][c] != tensor_digest(total)]:
                    log.warning("step %d stage %d: replicas %s applied another chunk %d than replica %d summed",
                                step, i, differing, c, k)
        items = []
        for mb in own:
            try:
                kept_step = client.audit(step, mb) if i > 0 or not last else None
            except grpc.RpcError as exc:
                return [_refused(exc, step, mb, i, node, ids)]
            x = inputs[mb] if i == 0 else kept_step.received
            if i > 0 and (x is None or tensor_digest(x) != received[i][mb].sha256):
                return [failed(f"returned an input of micro-batch {mb} other than the one it signed for")]
            if last:
                target = labels[mb]
            else:
                target = kept_step.gradient
                if target is not None and (i + 1, mb) in moved and tensor_digest(target) != evidence.gradients[(i, mb)]:
                    log.warning("step %d: stage %d replica %d holds a gradient of micro-batch %d from a replica lost "
                                "since, not the one its recomputation sent: its partial gradient is not checked",
                                step, i, k, mb)
                    return []
                if target is None or tensor_digest(target) != evidence.gradients[(i, mb)]:
                    return [failed(f"returned a gradient of micro-batch {mb} other than the one stage {i + 1} "
                                  f"replica {routes.of[mb][i + 1]} signed for sending it")]
            items.append((mb, x, target))
        siblings = [c for (s, r), (c, _) in parties.items() if s == i and r != k and not _same_party(c.endpoint, e)]
        if not siblings:
            log.warning("step %d: no sibling of stage %d replica %d on another owner's node can recompute it",
                        step, i, k)
            return []
        rtol, atol = self.plan.audit_rtol, self.plan.audit_atol
        if self.plan.precision == "bf16":
            rtol, atol = max(rtol, BF16_TOLERANCE), max(atol, BF16_TOLERANCE)

        def judge(verifier: StageClient) -> _Vote:
            expected = verifier.verify_partial(step, sum(len(x) for x in inputs), items, elements, last=last)
            diff = float((expected - partial).abs().max()) if elements else 0.0
            return _Vote(verifier, bool(torch.allclose(partial, expected, rtol=rtol, atol=atol)), diff)

        def pick(voters: list[StageClient]) -> StageClient | None:
            pool = [c for c in siblings if not any(_same_party(c.endpoint, v.endpoint) for v in voters)]
            return self.rng.choice(pool) if pool else None

        # A verdict that fails the replica needs a second sibling of another owner, where it has one.
        votes = self._votes(judge, pick, settled=lambda v: v.agrees)
        honest, vote, overruled = _decided(votes)
        v, diff = vote.verifier.endpoint, vote.diff
        on = f"sibling replica {v.replica} on node {v.node_id}" + _confirmed(votes, vote)
        detail = (
            f"{where}: partial gradient of micro-batches {list(own)} matches the recomputation by {on} "
            f"(max |diff| {diff:.3g})"
            if honest
            else f"{where}: partial gradient of micro-batches {list(own)} differs from the recomputation by {on} by "
            f"up to {diff:.3g} (rtol {rtol}, atol {atol})"
        )
        return [SpotCheckResult(step, m, i, node, honest, detail, verifier_node_id=v.node_id, max_abs_diff=diff,
                                kind=PARTIAL_GRADIENT, **ids),
                *self._overruled(step, m, overruled, vote, f"{where}'s partial gradient")]

    def _receipts(
        self, step: int, signer: StageClient, replica: int, role: str, signed: Iterable[stage_pb2.Receipt],
        routes: Routes, moved: Collection[tuple[int, int]],
    ) -> tuple[dict[int, stage_pb2.Receipt], SpotCheckResult | None]:
        """The receipts of role `role` of replica `replica` of stage `signer.endpoint.index`, one per micro-batch its
        route gave it, each naming the replicas the routes say the activation went from and to (a received one of a
        micro-batch `moved` off the producing stage may name the lost replica it came from), verified against the
        signer's key; else a failed check of the signer."""
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
                from_lost = role == RECEIVED and (receiver - 1, r.micro_batch) in moved
                if r.stage.replica != route[receiver] or (r.producer_replica != route[receiver - 1] and not from_lost):
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
    ) -> list[SpotCheckResult]:
        """Recompute the forward of micro-batch m by the replica of stage i that took it, on an independent node (a
        sibling replica of the producer's where one is), and on more where its verdict would fail anyone (`_votes`):
        the check, and a failed one of each verifier overruled; none where no node can recompute it."""
        k, k_next = routes.of[m][i], routes.of[m][i + 1]
        (producer, _), (receiver, _) = parties[(i, k)], parties[(i + 1, k_next)]
        node, receiver_node = producer.endpoint.node_id, receiver.endpoint.node_id
        of_producer = {"replica": k, "producer_replica": k, "receiver_replica": k_next}
        of_receiver = {"replica": k_next, "producer_replica": k, "receiver_replica": k_next}
        try:
            kept = producer.audit(step, m)
        except grpc.RpcError as exc:
            return [_refused(exc, step, m, i, node, of_producer)]
        x = driver_input if i == 0 else kept.received
        if i > 0 and (x is None or tensor_digest(x) != received[i][m].sha256):
            return [SpotCheckResult(step, m, i, node, False, "returned an input other than the one it signed for",
                                    **of_producer)]
        if kept.sent is None or tensor_digest(kept.sent) != sent[i][m].sha256:
            return [SpotCheckResult(
                step, m, i, node, False, "returned a sent activation other than the one it signed for", **of_producer
            )]
        try:
            got = receiver.audit(step, m).received
        except grpc.RpcError as exc:
            return [_refused(exc, step, m, i + 1, receiver_node, of_receiver)]
        receipt, sent_receipt = received[i + 1][m], sent[i][m]
        if got is None or tensor_digest(got) != receipt.sha256:
            # The receiver kept something else than it signed for: its word is worthless, not the producer's.
            return [SpotCheckResult(step, m, i + 1, receiver_node, False,
                                    "returned an activation other than the one it signed for", **of_receiver)]
        clients = [c for c, _ in parties.values()]
        disputed = receipt.sha256 != sent_receipt.sha256
        first = self._verifier(producer.endpoint, receiver.endpoint, clients)
        if first is None:
            log.warning("step %d: no node of another owner than stage %d's can recompute its forward", step, i)
            return []
        e = producer.endpoint
        rtol, atol = self.plan.audit_rtol, self.plan.audit_atol
        if self.plan.precision == "bf16":  # another summation order moves bf16 results by a few roundings
            rtol, atol = max(rtol, BF16_TOLERANCE), max(atol, BF16_TOLERANCE)
        # The producer's weights go from it to the verifiers through a file: no message or buffer here
        # holds the stage.
        with tempfile.TemporaryDirectory(prefix="arceus-audit-") as directory:
            weights = Path(directory) / "weights.safetensors"
            try:
                producer.save_audit_weights(step, weights)
            except grpc.RpcError as exc:
                return [_refused(exc, step, m, i, node, of_producer)]

            def judge(verifier: StageClient) -> _Vote:
                expected = verifier.verify_forward(
                    self._model_json, e.layer_start, e.layer_end, weights, x, self.plan.precision
                )
                if expected.shape != kept.sent.shape:
                    return _Vote(verifier, False, float("inf"), f"sent shape {list(kept.sent.shape)}; the "
                                 f"recomputed forward is {list(expected.shape)}")
                expected, slack = _as_sent(expected, self.plan.transfer)
                diff = float((expected - kept.sent).abs().max()) if expected.numel() else 0.0
                return _Vote(verifier, bool(torch.allclose(kept.sent, expected, rtol=rtol, atol=atol + slack)), diff)

            # A verdict that fails anyone (the producer, or in a dispute the receiver) needs a second verifier.
            votes = self._votes(
                judge, lambda voters: self._verifier(producer.endpoint, receiver.endpoint, clients, voters)
                if voters else first, settled=lambda v: v.agrees and not disputed,
            )
        honest, vote, overruled = _decided(votes)
        signed = {"receipt_sha256": receipt.sha256.hex(), "receipt_signature": receipt.signature.hex(),
                  "sent_sha256": sent_receipt.sha256.hex(), "sent_signature": sent_receipt.signature.hex(),
                  "verifier_node_id": vote.verifier.endpoint.node_id, "producer_index": i}
        where = f"step {step} micro-batch {m}" + (f" (stage {i} replica {k})" if self.plan.replicas else "")
        checks = self._overruled(step, m, overruled, vote, f"{where}'s forward")
        on = _on(vote.verifier, self.plan.replicas) + _confirmed(votes, vote)
        diff = vote.diff
        if vote.shape:
            return [SpotCheckResult(step, m, i, node, False, f"{where}: {vote.shape}", max_abs_diff=diff, **signed,
                                    **of_producer), *checks]
        tolerance = f"(rtol {rtol}, atol {atol})"
        if disputed and honest:
            # The producer's account holds up against the recomputation: the receiver's does not.
            return [SpotCheckResult(step, m, i + 1, receiver_node, False,
                                    f"{where}: signed for an activation other than the one stage {i} sent, which "
                                    f"matches the recomputation on {on} (max |diff| {diff:.3g})",
                                    max_abs_diff=diff, **signed, **of_receiver), *checks]
        detail = (
            f"{where}: output matches the recomputation on {on} (max |diff| {diff:.3g})"
            if honest
            else f"{where}: output differs from the recomputation on {on} by up to "
            f"{diff:.3g} {tolerance}"
            + (f"; stage {i + 1} signed for another activation" if disputed else "")
        )
        return [SpotCheckResult(step, m, i, node, honest, detail, max_abs_diff=diff, **signed, **of_producer), *checks]

    def _votes(
        self, judge: Callable[[StageClient], _Vote], pick: Callable[[list[StageClient]], StageClient | None],
        settled: Callable[[_Vote], bool],
    ) -> list[_Vote]:
        """Independent recomputations of one output, each on a node of another owner than the checked one's and than
        every earlier verifier's (`pick`, given the verifiers so far): the first alone where it `settled` (it passes
        the output, and nothing is disputed), else more until two agree or no such node is left. No verifier's word
        alone fails a contributor where another owner's node can recompute it."""
        votes = [judge(pick([]))]
        while not settled(votes[0]) and not any(sum(v.agrees == w.agrees for w in votes) >= 2 for v in votes):
            verifier = pick([v.verifier for v in votes])
            if verifier is None:
                break
            votes.append(judge(verifier))
        return votes

    def _overruled(self, step: int, m: int, overruled: list[_Vote], vote: _Vote, what: str) -> list[SpotCheckResult]:
        """A failed check of each verifier whose recomputation the decided verdict (`vote`'s) overruled."""
        replicated = bool(self.plan.replicas)
        return [
            SpotCheckResult(
                step, m, v.verifier.endpoint.index, v.verifier.endpoint.node_id, False,
                f"as the verifier of {what}, {'passed' if v.agrees else 'failed'} it against the recomputation on "
                f"{_on(vote.verifier, replicated)} (its max |diff| {v.diff:.3g})",
                verifier_node_id=vote.verifier.endpoint.node_id, max_abs_diff=v.diff, kind=VERIFICATION,
                replica=v.verifier.endpoint.replica,
            )
            for v in overruled
        ]

    def _verifier(
        self, producer: StageEndpoint, receiver: StageEndpoint, clients: Sequence[StageClient],
        voters: Sequence[StageClient] = (),
    ) -> StageClient | None:
        """A stage on a node of another owner than the producer's (no contributor checks its own work) and than each
        of `voters` (the verifiers asked already): a sibling replica of the producer's where one is (it holds the
        same stage), else preferably of neither the producer's nor the receiver's owner; None where there is none."""
        independent = [c for c in clients if not _same_party(c.endpoint, producer)
                       and not any(_same_party(c.endpoint, v.endpoint) for v in voters)]
        siblings = [c for c in independent if c.endpoint.index == producer.index]
        preferred = [c for c in independent if not _same_party(c.endpoint, receiver)]
        pool = siblings or preferred or independent
        return self.rng.choice(pool) if pool else None


def sampled_partial(routes: Routes, rng: random.Random) -> tuple[int, int, int]:
    """The partial gradient a step's check recomputes: (stage, replica, one of the replica's micro-batches), every
    replica of a replicated stage as likely as another. Each puts its whole partial into the sum, whatever its share
    of the micro-batches: sampling by micro-batch checked a replica taking 1 of 8 (a slow one, or one posing as slow)
    one time in 8 instead of one in 2. ValueError where no stage is replicated."""
    partials = [(i, k) for i, ids in enumerate(routes.members) if len(ids) > 1 for k in ids]
    if not partials:
        raise ValueError("no stage of the step is replicated: it exchanges no partial gradient")
    i, k = rng.choice(partials)
    return i, k, rng.choice(routes.micro_batches_of(i, k))


@dataclass(frozen=True)
class _Vote:
    """One verifier's recomputation of a checked output: whether the output `agrees` with it, by how much they differ,
    and (forwards) why they could not be compared."""

    verifier: StageClient
    agrees: bool
    diff: float
    shape: str = ""


def _decided(votes: Sequence[_Vote]) -> tuple[bool, _Vote, list[_Vote]]:
    """The verdict of `votes` (`Auditor._votes`'), a vote that gave it, and the votes it overruled: two that agree
    decide; one alone stands; where two disagree and no third owner's node is left, the recomputation that agrees with
    the checked output stands (two parties of different owners against one)."""
    for_it = [v for v in votes if v.agrees]
    against = [v for v in votes if not v.agrees]
    honest = len(for_it) >= 2 or (len(against) < 2 and bool(for_it))
    winners, losers = (for_it, against) if honest else (against, for_it)
    return honest, winners[0], losers


def _on(verifier: StageClient, replicated: bool) -> str:
    e = verifier.endpoint
    return f"node {e.node_id}" + (f" (stage {e.index} replica {e.replica})" if replicated else "")


def _confirmed(votes: Sequence[_Vote], vote: _Vote) -> str:
    """", or the other nodes whose recomputations agree with `vote`'s."""
    others = [v.verifier.endpoint.node_id for v in votes if v is not vote and v.agrees == vote.agrees]
    return f", confirmed by node {', '.join(others)}" if others else ""


@dataclass
class _Evidence:
    """What a replicated step's members signed about their exchanges (Auditor._exchange_evidence)."""

    partials: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (stage, replica) -> partial's digest
    gradients: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (receiving stage, micro-batch) -> digest
    shards: dict[tuple[int, int], list[stage_pb2.ShardReceipt]] = field(default_factory=dict)  # by keeping member
    reduced: dict[tuple[int, int], dict[int, bytes]] = field(default_factory=dict)  # member -> chunk -> digest
    failures: list[SpotCheckResult] = field(default_factory=list)


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
