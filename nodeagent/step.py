"""One step of a hosted stage, as an object: run its schedule's actions, waiting for inputs, computing,
and pushing outputs on.

Sends are asynchronous (a stage never waits for its neighbour to accept before computing the next
micro-batch); the step fails if any send failed, and the optimizer steps only once all are delivered.
Its collaborators each own one concern: `PushTracker` the sends, `StepAudit` the receipts and what is kept
for spot checks, `StepLending` the threads each action computes with, and a tensor-parallel stage's group
the names of its all-reduces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import grpc
import torch

from arceus.pipeline.schedule import Action, build_schedule, replica_schedule
from arceus.pipeline.solo import solo_planner
from arceus.swarm.exchange import chunk_bounds
from arceus.swarm.outer import OuterSync
from arceus.swarm.repair import ReplicaInstructions
from arceus.v1 import stage_pb2
from arceus.verify.receipts import ReceiptSigner
from arceus.wire.compression import decode_payload
from nodeagent import faults
from nodeagent.lending import ComputeThreads, StepLending
from nodeagent.mailbox import MailboxCancelled, MailboxClosed, MailboxTimeout
from nodeagent.neighbour_stream import StepWire
from nodeagent.repair import HeldStep
from nodeagent.replicas import ReplicaStepPlan, parse_replica_step
from nodeagent.rpc import RpcFailure
from nodeagent.sends import PushTracker
from nodeagent.stage import HostedStage, NeighbourLink
from nodeagent.step_audit import StepAudit
from nodeagent.step_samples import read_step_samples
from nodeagent.validation import check_run_step

# After a failed step, how long a replica keeping it for a repair waits for its sends in flight to be delivered or
# refused before it cancels them (a send to a peer that went silent would otherwise hold its report until the deadline).
SETTLE_SECONDS = 5.0


class StepRun:
    def __init__(
        self,
        stage: HostedStage,
        request: stage_pb2.RunStepRequest,
        *,
        replicas: ReplicaStepPlan | None,
        deadline: float,
        abort: threading.Event,
        signer: ReceiptSigner,
        threads: ComputeThreads | None = None,
    ) -> None:
        """`replicas`: the step's plan for a replica (`replica_plan`), None for a stage that is not replicated.
        `deadline` is a time.monotonic() value. `threads`: None leaves the calling thread's torch thread count as it
        is."""
        schedule = check_run_step(stage.io, request)
        a = stage.assignment
        self.stage, self.request, self.abort = stage, request, abort
        self.step, self.train = request.step, request.mode == stage_pb2.TRAIN
        # Staleness 1 (PipeDream-2BW): this train step runs with its own version of the weights, and a step chained
        # after it starts here once its forwards are done (`HostedStage.step_join`), its update after this one's.
        self.stale = self.train and a.staleness == 1
        if self.stale and request.retain_for_audit:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{stage.name}: spot checks of a job with staleness 1 are not supported yet")
        # A replica runs its share of the micro-batches, sends each to the replica its route names, and exchanges
        # its gradients with its siblings before the optimizer step.
        self.replicas = replicas
        # Leave a little of the caller's deadline so our own explanation reaches it before its timer fires.
        self.wait_until = deadline - min(1.0, 0.05 * max(0.0, deadline - time.monotonic()))
        # The activations and gradients to and from one-agent neighbours: on the stage's neighbour streams.
        self.wire: StepWire | None = None
        if self.replicas is None:
            every = build_schedule(schedule, a.num_stages, request.num_micro_batches, self.train)
            self.actions = every[a.stage_index]
            if stage.neighbours.any:
                self.wire = stage.neighbours.begin(request.step, every, self.wait_until, abort)
        else:
            plan = self.replicas
            self.actions = replica_schedule(
                schedule, a.num_stages, a.stage_index, plan.micro_batches, self.train, replicas=plan.most_replicas
            )
        self.pushes = PushTracker(stage, request.step, deadline, abort, epoch=0 if replicas is None else replicas.epoch)
        routes = None if self.replicas is None else self.replicas.routes
        self.audit = StepAudit(
            stage, request.step, signer, retain=request.retain_for_audit and self.train,
            train_step=request.train_step or request.step,
            replica_of=None if routes is None else (lambda i, m: routes.of[m][i]),
        )
        # The ranks of a tensor-parallel stage compute side by side: none of them computes alone.
        borrows = (
            threads is not None and threads.solo > threads.own and stage.tensor_parallel is None
            and self.replicas is None  # its solo plan is of one agent per stage
        )
        self.lending = StepLending(
            stage_index=a.stage_index,
            gauge=stage.lending,
            threads=threads,
            planner=solo_planner(schedule, a.num_stages, request.num_micro_batches, self.train) if borrows else None,
            # Not a method of this step: the lending lives as long as the step, and a step in a reference cycle would
            # keep its HeldStep (a whole gradient) until Python's cycle collector ran.
            arrived=partial(_arrived, stage, request.step, self.wire),
        )
        self._where = {"stage": a.stage_index, "replica": a.replica or 0}  # for the fault hook (nodeagent.faults)
        self._forward_sizes: dict[int, int] = {}
        self.wait_seconds = 0.0  # waiting for inputs and for sends: the bubble this stage sees
        self._results: dict[int, tuple[float, int, int]] = {}
        self.exchange_seconds = 0.0
        self.held: HeldStep | None = None  # a replica's record of this step, kept for a repair (nodeagent.repair)
        self._keeps_exchange = False  # a repair left this replica's stage its completed exchange
        self._skip_output: frozenset[int] = frozenset()
        self._skip_input_gradient: frozenset[int] = frozenset()
        # A stage that is not replicated sends every activation to the same links, and every gradient: only the last
        # of each in its schedule is acked on its own, the others with it (one ack a link a step, not one a tensor).
        self._acked = {act.kind: i for i, act in enumerate(self.actions)} if self.replicas is None else None
        self._last_forward = max(i for i, act in enumerate(self.actions) if act.kind == "F")
        # Staleness 1: a chained step's first backward waits for the update of the step it overlaps, so a stage never
        # holds two steps' gradients (the memory model counts one set and two weights versions).
        self._first_backward = min(i for i, act in enumerate(self.actions) if act.kind == "B") if self.stale else -1

    def run(self) -> stage_pb2.RunStepReply:
        runtime = self.stage.runtime
        held = self._held_step()
        if self.train and self.replicas is not None and not self.stage.assignment.replica_sync.exact:
            self._start_sync_round()
        compute_before, own_before = runtime.counters.compute_seconds, runtime.thread_compute_seconds()
        sent_before = 0 if self.stage.exchange is None else self.stage.exchange.bytes_sent
        after, step = self.request.after_step, self.step
        if self.stale:  # the step it overlaps still takes its gradients; the next one's inputs may come early
            self.stage.mailbox.discard(lambda key: not (after or step) <= key[0] <= step + 1)
        else:
            self.stage.mailbox.retain_step(step)
        try:
            if self.stale:
                try:
                    runtime.stale_begin(self.step)
                except ValueError as exc:
                    raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"{self.stage.name}: {exc}") from None
            if self.request.HasField("data"):
                own = range(self.request.num_micro_batches) if self.replicas is None else self.replicas.micro_batches
                read_step_samples(self.stage, self.request, own)
            if self.replicas is not None and self.replicas.repair is not None:
                self._resend(self.replicas, self.replicas.repair)
            for index, action in enumerate(self.actions):
                if held is not None and held.done(action):
                    continue  # done in an earlier attempt at this step: it counts once
                if self.abort.is_set():
                    raise RpcFailure(grpc.StatusCode.CANCELLED, f"step {self.step} on {self.stage.name} was cancelled")
                if action.kind == "F":
                    self._forward(index, action)
                    if self.stale and index == self._last_forward:
                        self.stage.forwards_done(self.step)
                else:
                    if index == self._first_backward and after:
                        with self._waiting():
                            self.stage.wait_for_step(after, self.wait_until, self.abort)
                    self._backward(index, action)
                self.pushes.raise_if_failed()
            with self._waiting():
                self.pushes.wait_all()
                if self.wire is not None:
                    self.wire.finish()
            if self.train:
                faults.reached("gradient-sent", self.step, **self._where)
            if self.stale:  # the update of the step it overlaps came before this step's first backward
                runtime.stale_gradients(self.step)
            sync = self.stage.assignment.replica_sync
            members = () if self.replicas is None else self.replicas.members(self.stage.io.stage_index)
            if held is not None and not self._keeps_exchange:
                held.partial = runtime.gradient_vector()  # what a repair of this step exchanges again
            if self.train and sync.exact and len(members) > 1 and not self._keeps_exchange:
                self._exchange(self.replicas)
            if self.train and self.stage.tied and not self._keeps_exchange:
                self._tied_sum()
            if self.train:
                self.lending.optimizer_step()
                if self.replicas is not None and not sync.exact and sync.syncs_at(self.step):
                    # Replicas that sync every H steps: this step's own update now, then the average, so they leave
                    # the step equal. Nothing is deferred: an audit would read the weights after it.
                    if self.audit.keep():
                        raise RpcFailure(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"{self.stage.name}: spot checks of replicas that sync every few steps are not supported",
                        )
                    runtime.optimizer_step(self.request.learning_rate or None)
                    self._average(self.replicas)
                elif self.audit.keep() or self.replicas is not None:
                    # An audit reads the weights this step's forwards used: they stay until the next call. Replicas
                    # apply their update only once every replica took the step: the driver's next step commits it.
                    runtime.defer_optimizer_step(self.request.learning_rate or None)
                    self.stage.deferred_step = self.step
                else:
                    runtime.optimizer_step(self.request.learning_rate or None)
            if held is not None:
                held.finished = True
        except BaseException:
            if self.wire is not None:
                self.wire.fail()
            if held is None:
                runtime.abort_step()
                self.pushes.cancel_all()
            else:  # kept for a repair: its graphs, gradient and tensors stay; its sends settle before it reports
                self.pushes.settle(min(SETTLE_SECONDS, max(0.0, self.wait_until - time.monotonic())))
            raise
        ordered = [self._results[m] for m in sorted(self._results)]
        return stage_pb2.RunStepReply(
            loss_sums=[r[0] for r in ordered],
            correct=[r[1] for r in ordered],
            sample_counts=[r[2] for r in ordered],
            compute_seconds=(  # with staleness 1 the stage's counters also count the overlapping step's
                runtime.thread_compute_seconds() - own_before if self.stale
                else runtime.counters.compute_seconds - compute_before
            ),
            wait_seconds=self.wait_seconds,
            counters=self.stage.counters(),
            receipts=self.audit.receipts,
            sent_receipts=self.audit.sent_receipts,
            micro_batches=() if self.replicas is None else self.replicas.micro_batches,
            exchange_seconds=self.exchange_seconds,
            exchange_bytes=0 if self.stage.exchange is None else self.stage.exchange.bytes_sent - sent_before,
            partial_receipt=self.audit.partial_receipt,
            shard_receipts=self.audit.shard_receipts or (),
            gradient_receipts=self.audit.gradient_receipts,
            reduced_receipts=self.audit.reduced_receipts,
        )

    def _held_step(self) -> HeldStep | None:
        """Commit or discard what the previous step left (or take back this step's own, when the driver repairs
        it), and the record this step keeps: a replica's train step that exchanges every step keeps one until the
        next step commits it (nodeagent.repair); other steps keep none."""
        stage, plan, runtime = self.stage, self.replicas, self.stage.runtime
        keeps = self.train and plan is not None and stage.assignment.replica_sync.exact
        held = stage.held_step
        if plan is not None and plan.repair is not None and not keeps:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{stage.name}: only the train steps of replicas that exchange gradients every step are repaired",
            )
        if keeps and plan.repair is not None and held is not None and held.step == self.step:
            # The same step, resumed after a loss: its update (if it finished) waits again, and its own partial
            # gradient (if it exchanged) comes back, to take the micro-batches it recomputes and be exchanged anew;
            # unless its stage keeps its exchange (no member lost, every one done): its reduced gradient stands.
            runtime.take_back_deferred()
            stage.deferred_step = None
            if held.audit is not None:  # the step's evidence goes on from its earlier attempts
                self.audit = held.audit
                self.audit.resume(lambda i, m: plan.routes.of[m][i], keep_exchange=plan.repair.keep_exchange)
            if plan.repair.keep_exchange:
                if held.exchanged_epoch is None:
                    raise RpcFailure(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{stage.name} is told to keep the exchange of step {self.step}, which it did not complete",
                    )
                held.exchanged_epoch = plan.epoch  # the same members: the sum stands in the new epoch
                self._keeps_exchange = True
            elif held.partial is not None:
                runtime.set_gradient_vector(held.partial)
                held.partial = held.exchanged_epoch = None
            held.finished = False
        else:
            if plan is not None and stage.deferred_step in self.request.replicas.discard_steps:
                stage.drop_held_step()
                runtime.discard_deferred()  # the update of a failed attempt at this step, which this replica finished
            else:
                stage.settle()  # the previous step's optimizer step, if an audit (or replicas) kept it waiting
            stage.deferred_step = None
            held = HeldStep(self.step) if keeps else None
            if held is not None:
                held.audit = self.audit
            stage.held_step = held
        if held is not None:
            held.micro_batches = plan.micro_batches
            self._forward_sizes, self._results = held.forward_sizes, held.results
            self._skip_output = frozenset(plan.repair.skip_output if plan.repair else ())
            self._skip_input_gradient = frozenset(plan.repair.skip_input_gradient if plan.repair else ())
        self.held = held
        return held

    def _resend(self, plan: ReplicaStepPlan, repair: ReplicaInstructions) -> None:
        """Push again the kept tensors a repair names, to the replicas that lack them now, each signed for again
        (naming its new receiver)."""
        stage, held, index = self.stage, self.held, self.stage.io.stage_index
        for pairs, kept, to_stage, kind, sent, sign in (
            (repair.resend_outputs, held.outputs, index + 1, stage_pb2.ACTIVATION, held.output_sent, self.audit.sent),
            (repair.resend_input_gradients, held.input_gradients, index - 1, stage_pb2.GRADIENT,
             held.input_gradient_sent, self.audit.gradient_sent),
        ):
            for m, to in pairs:
                if m not in kept:
                    raise RpcFailure(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{stage.name} holds no {stage_pb2.TensorKind.Name(kind)} of micro-batch {m} of step "
                        f"{self.step} to send again",
                    )
                link = stage.replica_link(plan.peers[(to_stage, to)])
                self.pushes.send_encoded([link], to_stage, kind, m, kept[m], replica=to,
                                         delivered=lambda m=m, to=to, sent=sent: sent(m, to))
                if self.audit.record is not None:
                    sign(m, decode_payload(kept[m]), kept[m])

    def _exchange(self, plan: ReplicaStepPlan) -> None:
        """Replace this replica's gradients with the sum of every member's: the same bits on each. On a retained
        step the partial gradient is kept and its digest signed, every shard pushed is signed, and the siblings'
        signed shards are kept as the evidence of what each put into the sum."""
        stage, started = self.stage, time.perf_counter()
        index = stage.io.stage_index
        own = self.held.partial if self.held is not None else None  # kept for a repair: the same vector
        partial = stage.runtime.gradient_vector() if own is None else own
        # The gradients become views of the partial (theirs freed; the same values) until the sum replaces them:
        # the exchange holds two gradient-sized vectors (the partial, the sum), not three. Nothing writes the
        # gradients in between, so the partial a repair or an audit keeps stays as it was.
        stage.runtime.set_gradient_vector(partial)
        self.audit.partial(partial)
        retained = self.audit.record is not None
        reduced = stage.exchange.exchange(
            partial,
            step=self.step,
            epoch=plan.epoch,
            members=plan.members(index),
            peers={k: plan.peers[(index, k)] for k in plan.members(index) if k != stage.assignment.replica},
            port_of=lambda k: stage.exchange_port(plan.peers[(index, k)], self.wait_until, plan.epoch),
            deadline=self.wait_until,
            abort=self.abort,
            sign=self.audit.sign_shard if retained else None,
            keys={k: plan.peers[(index, k)].public_key for k in plan.members(index) if (index, k) in plan.peers},
            kept=self.audit.shard_receipts if retained else None,
        )
        stage.runtime.set_gradient_vector(reduced)
        if self.held is not None:
            self.held.exchanged_epoch = plan.epoch
        self.audit.reduced(reduced, chunk_bounds(reduced.numel(), plan.members(index)))
        self.exchange_seconds = time.perf_counter() - started

    def _tied_sum(self) -> None:
        """Step each tied weight's copy held here with its group's sum (nodeagent.tied): this stage's copies' final
        gradients pushed to the stages sharing them (rank 0 of a tensor-parallel stage), theirs taken here."""
        stage, runtime = self.stage, self.stage.runtime
        if stage.assignment.sends_on:
            stage.tied.send(
                runtime.parameter_gradient,
                lambda to, index, encoded: self.pushes.send_encoded(
                    stage.tied_links[to], to, stage_pb2.TIED_GRADIENT, index, encoded
                ),
            )
        stage.tied.sum(
            runtime.parameter_gradient, lambda index: self._receive(stage_pb2.TIED_GRADIENT, index),
            runtime.set_parameter_gradient,
        )
        with self._waiting():
            self.pushes.wait_all()

    def _start_sync_round(self) -> None:
        """The weights every replica starts from, kept at its first train step (the replicas are equal then:
        built from the same weights or copied from a peer): what the first sync's deltas are measured from."""
        stage = self.stage
        if stage.outer_sync is None:
            runtime = stage.runtime
            stage.outer_sync = OuterSync(
                list(runtime.layers.parameters()), runtime.optimizer, stage.assignment.replica_sync,
                runtime.buffers.buffers,
            )

    def _average(self, plan: ReplicaStepPlan) -> None:
        """Replicas that sync every H steps, at a sync: the same outer step from the members' mean on each."""
        stage, started = self.stage, time.perf_counter()
        index = stage.io.stage_index
        members = plan.members(index)
        local = stage.outer_sync.local_vector()
        summed = local if len(members) == 1 else stage.exchange.exchange(
            local,
            step=self.step,
            epoch=plan.epoch,
            members=members,
            peers={k: plan.peers[(index, k)] for k in members if k != stage.assignment.replica},
            port_of=lambda k: stage.exchange_port(plan.peers[(index, k)], self.wait_until, plan.epoch),
            deadline=self.wait_until,
            abort=self.abort,
        )
        stage.outer_sync.apply(summed, len(members))
        stage.runtime.buffers.rebind()  # the mean buffers are the next step's start
        self.exchange_seconds = time.perf_counter() - started

    def _forward(self, index: int, action: Action) -> None:
        stage, runtime, m = self.stage, self.stage.runtime, action.micro_batch
        a, io, key = stage.assignment, stage.io, (self.step, m)
        x = self._receive(stage_pb2.ACTIVATION, m)
        held = self.held
        if held is not None:
            held.mark(m, input_received=True)
        self._forward_sizes[m] = len(x)
        if not io.is_first:
            self.audit.received(m, x)
        if io.is_last:
            labels = self._receive(stage_pb2.LABELS, m)
            if len(labels) != len(x):
                raise RpcFailure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"micro-batch {m} of step {self.step} has {len(x)} activations but {len(labels)} labels",
                )
            with self._computing(index, len(x)):
                if self.train:
                    loss_sum, correct = runtime.forward_loss(
                        key, x, labels, self.request.batch_size, self.request.train_step or None
                    )
                else:
                    loss_sum, correct = runtime.eval_loss(x, labels)
            self._results[m] = (loss_sum, correct, len(x))
            if held is not None:
                held.mark(m, forwarded=True)
            if self.train:
                faults.reached("forward", self.step, **self._where)
            return
        with self._computing(index, len(x)):
            out = runtime.forward(key, x, self.request.train_step or None) if self.train else runtime.eval_forward(x)
        if held is not None:
            held.mark(m, forwarded=True)
        if self.train:
            faults.reached("forward", self.step, **self._where)
        if a.sends_on:  # ranks 1.. of a tensor-parallel stage compute the same output as rank 0
            links, replica = self._links(a.stage_index + 1, m, stage.next_links)
            if self.wire is not None and self.wire.carries(stage_pb2.ACTIVATION, incoming=False):
                encoded = stage.transfer.encode(out, gradient=False, stream=m)
                self.wire.send(stage_pb2.ACTIVATION, m, encoded)
            elif held is None:
                encoded = self.pushes.send(links, a.stage_index + 1, stage_pb2.ACTIVATION, m, out, replica=replica,
                                           ack_later=self._ack_later(index))
            elif m in self._skip_output:  # the next stage already holds it (from a lost replica): kept, not sent
                encoded = stage.transfer.encode(out, gradient=False, stream=m)
            else:
                encoded = self.pushes.send(links, a.stage_index + 1, stage_pb2.ACTIVATION, m, out, replica=replica,
                                           delivered=lambda: held.output_sent(m, replica))
            if held is not None:
                held.outputs[m] = encoded
            self.audit.sent(m, out, encoded)

    def _backward(self, index: int, action: Action) -> None:
        stage, m = self.stage, action.micro_batch
        a = stage.assignment
        grad, held = None, self.held
        if not stage.io.is_last:
            grad = self._receive(stage_pb2.GRADIENT, m)
            if held is not None:
                held.mark(m, gradient_received=True)
            if len(grad) != self._forward_sizes[m]:
                raise RpcFailure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the GRADIENT of step {self.step} micro-batch {m} has {len(grad)} "
                    f"rows but its forward had {self._forward_sizes[m]}",
                )
            self.audit.gradient_received(m, grad)
        with self._computing(index, self._forward_sizes[m]):
            grad_input = stage.runtime.backward((self.step, m), grad)
        if held is not None:
            held.mark(m, backwarded=True)
        if grad_input is not None and a.sends_on:
            links, replica = self._links(a.stage_index - 1, m, stage.prev_links)
            if held is None:
                if self.wire is not None and self.wire.carries(stage_pb2.GRADIENT, incoming=False):
                    encoded = stage.transfer.encode(grad_input, gradient=True, stream=m)
                    self.wire.send(stage_pb2.GRADIENT, m, encoded)
                else:
                    encoded = self.pushes.send(links, a.stage_index - 1, stage_pb2.GRADIENT, m, grad_input,
                                               replica=replica, ack_later=self._ack_later(index))
                self.audit.gradient_sent(m, grad_input, encoded)
                return
            if m in self._skip_input_gradient:  # the previous stage already holds it: kept, not sent
                encoded = stage.transfer.encode(grad_input, gradient=True, stream=m)
            else:
                encoded = self.pushes.send(links, a.stage_index - 1, stage_pb2.GRADIENT, m, grad_input,
                                           replica=replica, delivered=lambda: held.input_gradient_sent(m, replica))
            # Signed even unsent: what the previous stage's replica holds (from a lost replica) is checked against it.
            self.audit.gradient_sent(m, grad_input, encoded)
            held.input_gradients[m] = encoded

    def _ack_later(self, index: int) -> bool:
        """Whether action `index`'s push may be acked with a later one: not the last of its kind (see __init__)."""
        return self._acked is not None and self._acked[self.actions[index].kind] != index

    def _links(self, to_stage: int, m: int, neighbour: list[NeighbourLink]) -> tuple[list[NeighbourLink], int]:
        """Where micro-batch m's tensor for stage `to_stage` goes: its neighbour's ranks, or the replica its route
        names."""
        if self.replicas is None:
            return neighbour, 0
        replica = self.replicas.routes.of[m][to_stage]
        return [self.stage.replica_link(self.replicas.peers[(to_stage, replica)])], replica

    @contextmanager
    def _computing(self, index: int, samples: int) -> Iterator[None]:
        """Around the compute of action `index`, once its inputs are in: its threads, its tensor-parallel
        group's names for the all-reduces inside, and the timing the lending gauge learns from."""
        action, counters = self.actions[index], self.stage.runtime.counters
        lent = self.lending.start(index, action)
        before = counters.compute_seconds
        group = self.stage.tensor_parallel
        if group is None:
            yield
        else:  # its ranks run the same all-reduces in one order: (step, micro-batch, count) names each
            with group.micro_batch(self.step, action.micro_batch, deadline=self.wait_until, abort=self.abort):
                yield
        self.lending.done(action, lent, counters.compute_seconds - before, samples)

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _receive(self, kind: int, micro_batch: int) -> torch.Tensor:
        with self._waiting():
            return _receive(self.stage, self.step, kind, micro_batch, self.wait_until, self.abort, self.pushes,
                            self.wire)

def _arrived(stage: HostedStage, step: int, wire: StepWire | None) -> list[Action]:
    """The neighbours' actions of `step` whose outputs wait in the stage's mailbox or were read off its neighbour
    streams: the previous stage's forwards (not the driver's inputs to the first stage) and the next stage's
    backwards."""
    arrived = []
    read = [] if wire is None else [(stage_pb2.TensorKind.Name(kind), m) for kind, m in wire.arrived()]
    for kind, micro_batch in [*stage.mailbox.arrived(step), *read]:
        if kind == "ACTIVATION" and not stage.io.is_first:
            arrived.append(Action("F", micro_batch))
        elif kind == "GRADIENT":
            arrived.append(Action("B", micro_batch))
    return arrived


def replica_plan(stage: HostedStage, request: stage_pb2.RunStepRequest) -> ReplicaStepPlan | None:
    """The step's routes for a replica (None for a stage that is not replicated); INVALID_ARGUMENT for a RunStep
    that names routes to a stage that is not replicated, or none to one that is. The replica learns the step's
    membership epoch here (nodeagent.membership), before the step waits for its step lock: a sibling or neighbour
    that started the epoch first is then not kept waiting while a cancelled attempt unwinds."""
    a = stage.assignment
    routed = request.HasField("replicas")
    if a.replica is None:
        if routed:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{stage.name} is not replicated: it takes no routes")
        return None
    if not routed:
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{stage.name} is replica {a.replica} of a replicated stage: RunStep must name the step's routes",
        )
    plan = parse_replica_step(request, stage_index=a.stage_index, num_stages=a.num_stages, replica=a.replica)
    if stage.exchange is not None:
        stage.exchange.learn(plan.epoch, plan.peers.values())  # who may send to it in this epoch
    return plan


def _receive(
    stage: HostedStage,
    step: int,
    kind: int,
    micro_batch: int,
    wait_until: float,
    abort: threading.Event,
    pushes: PushTracker,
    wire: StepWire | None,
) -> torch.Tensor:
    """The tensor of `kind` for (step, micro_batch), waiting for it to arrive until `wait_until`: off the stage's
    neighbour stream where `wire` carries it, else from its mailbox."""
    if wire is not None and wire.carries(kind, incoming=True):
        return wire.receive(kind, micro_batch)
    a = stage.assignment
    kind_name = stage_pb2.TensorKind.Name(kind)
    if kind == stage_pb2.TIED_GRADIENT:
        source = f"the stages sharing its tied weights ({', '.join(str(p.stage_index) for p in a.tied)})"
    elif kind == stage_pb2.GRADIENT:
        source = f"stage {a.stage_index + 1} at {a.next_address or 'the replica its route names'}"
    elif kind == stage_pb2.ACTIVATION and not a.is_first:
        source = f"stage {a.stage_index - 1} at {a.prev_address or 'the replica its route names'}"
    else:
        source = "the driver"
    timeout = max(0.0, wait_until - time.monotonic())
    try:
        return stage.mailbox.get((step, kind_name, micro_batch), timeout, abort)
    except MailboxTimeout:
        raise RpcFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{stage.name} waited {timeout:.1f}s for the {kind_name} of step {step} "
            f"micro-batch {micro_batch} from {source}; it never arrived",
        ) from None
    except MailboxClosed:
        raise RpcFailure(
            grpc.StatusCode.ABORTED, f"{stage.name} was removed from this agent while running step {step}"
        ) from None
    except MailboxCancelled:
        pushes.raise_if_failed()
        raise RpcFailure(grpc.StatusCode.CANCELLED, f"step {step} on {stage.name} was cancelled") from None
