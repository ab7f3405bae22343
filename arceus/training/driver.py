"""`train(plan, sink)`: drive a pipeline of stages through epochs of steps, with validation after each.

One step: ask every stage to run its schedule, naming the batch's samples by position to stage 0 and the last
stage, which read them themselves (a bundled dataset: arceus.data.step_data; an uploaded tensor dataset, by range
from the control plane, with the file's layout: arceus.data.upload_rows); for other data, split the batch into
micro-batches and push the inputs to stage 0 and the labels to the last stage, all concurrently. The first failed
call cancels the rest and becomes a DriverError naming the stage and the gRPC status.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import queue
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch

from arceus.checkpoint import StateFile, state_chunks
from arceus.contracts.counters import StageCounters
from arceus.contracts.spot_check import SpotCheckResult
from arceus.contracts.step_grant import is_not_granted
from arceus.contracts.step_window import window_length
from arceus.data.batches import epoch_batches
from arceus.data.config import validate_dataset_config
from arceus.data.step_data import labels_per_sample, micro_batch_indices, stages_read
from arceus.data.streaming import Samples, UploadRows, dataset_samples
from arceus.data.upload_rows import UploadLayout
from arceus.errors import SpecError
from arceus.model.expected_state import expected_stage_state, stage_file_check
from arceus.model.registry import model_spec_from_config
from arceus.model.sharding import Shard
from arceus.model.tensor_parallel import gather_state_tensors, rank_expected_state
from arceus.safetensors_file import StageStateError
from arceus.swarm.holdings import StepHoldings
from arceus.swarm.repair import RepairPlan, repair_step
from arceus.swarm.routing import Routes, route_step
from arceus.training.audit import Auditor
from arceus.training.plan import (
    EpochResult,
    ProgressSink,
    ReplicaFence,
    ReplicaJoin,
    StageEndpoint,
    StageStateFile,
    StageTiming,
    StepProgress,
    TrainPlan,
    TrainResult,
    UploadTarget,
)
from arceus.training.replicas import ReplicaKey, ReplicaRoster
from arceus.training.stage_client import StageClient
from arceus.training.tally import WorkTally
from arceus.training.window_streams import WindowStreams
from arceus.v1 import stage_pb2
from arceus.wire.channels import MAX_MESSAGE_BYTES, agents_answering
from arceus.wire.push_stream import PushError

log = logging.getLogger(__name__)
_ACTIVATION, _LABELS = stage_pb2.ACTIVATION, stage_pb2.LABELS
# How long a replica's agent has to answer a health check after a failed step before it counts as lost (one that
# refuses the connection counts as lost at once: it was serving the step a moment ago).
LIVENESS_SECONDS = 3.0
# While a step of replicated stages is outstanding, how often the driver asks whether the control plane still places
# every member (`TrainPlan.replica_placed`): a member whose agent fell silent (SIGSTOP, a frozen host) answers no
# refusal, and its node's loss is found sooner than the step's RPC deadline.
WATCH_SECONDS = 1.0
# A window is sent, chained after the one under way, once this many of that one's steps are left to answer: time for
# the call to reach the stages before they need it, with the sink's stop and checkpoint requests taken as late as that.
CHAIN_AHEAD_STEPS = 2


class DriverError(RuntimeError):
    """A stage call failed; `stage_index` and `code` (a grpc.StatusCode name) say which and how."""

    def __init__(self, message: str, *, stage_index: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.stage_index = stage_index
        self.code = code


class StepNotGranted(DriverError):
    """An agent refused a train step beyond its job's step grant (arceus/contracts/step_grant.py): the control plane
    stopped granting steps (a cancel, a budget or deadline, a hand-over). A stop, not a stage's fault: nothing is
    blamed, fenced or rewound for it."""


@dataclass
class StepOutcome:
    loss_sum: float
    correct: int
    samples: int
    labels: int  # loss terms: one per sample, or one per position for a GPT
    stages: list[StageCounters]
    spot_checks: list[SpotCheckResult]
    timings: list[StageTiming]
    exchange_bytes: int = 0  # replicated stages: what their replicas pushed to their siblings


@dataclass(frozen=True)
class Batch:
    """A step's samples: their positions in a split, in `epoch_batches`' order. The driver reads them (`take`) only
    where it pushes them or spot-checks the step."""

    samples: Samples
    indices: torch.Tensor
    validation: bool = False

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samples.take(self.indices)


class MicroBatches(Sequence[torch.Tensor]):
    """A batch's inputs (`part` 0) or labels (1) per micro-batch, each read only when asked: a spot check reads the
    micro-batch it recomputes, not the batch (of an upload the stages read themselves, the driver reads no other)."""

    def __init__(self, batch: Batch, num_micro_batches: int, part: int) -> None:
        self._batch, self._part = batch, part
        self._indices = micro_batch_indices(batch.indices, num_micro_batches)
        self._read: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, m: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self) <= m < len(self):
            raise IndexError(m)
        m %= len(self)
        if m not in self._read:
            self._read[m] = self._batch.samples.take(self._indices[m])[self._part]
        return self._read[m]


@dataclass
class _Sent:
    """An unreplicated step whose calls are out (`Pipeline._send`): the driver's pushes, then every agent's RunStep."""

    step: int  # its call id
    batch: Batch
    train: bool
    num_micro_batches: int
    calls: list[tuple[StageClient, str, grpc.Future | Future[None]]]
    pushes: int  # how many of `calls` are pushes
    issued: float  # time.perf_counter() when its RunSteps went out
    answered: dict[int, float]  # when the driver had each agent's answer, by the agent's place among the RunSteps
    after: _Sent | None  # the step it is chained after

    def wall_seconds(self, agent: int) -> float:
        """How long the step took on an agent as the driver saw it: from its RunStep, or for a chained step from the
        agent's answer to the step before (it starts no sooner), to its answer."""
        start = self.issued if self.after is None else max(self.issued, self.after.answered[agent])
        return self.answered[agent] - start


@dataclass
class _Window:
    """A window of train steps whose RunSteps are out (`Pipeline.window`): its steps, and every agent's replies."""

    sent: list[_Sent]
    streams: WindowStreams


class Pipeline:
    """The driver's view of the stages of one job generation: one channel per stage, reused."""

    def __init__(self, plan: TrainPlan, *, dataset: dict | None = None, layout: UploadLayout | None = None) -> None:
        """`dataset`: the plan's dataset config validated (None: validated here); where the stages read it
        themselves (a bundled dataset: arceus.data.step_data.stages_read; an upload, tensors or a text's token
        file, whose `layout` the driver read from the file's header) the driver sends positions, not samples."""
        self.plan = plan
        dataset = validate_dataset_config(plan.dataset) if dataset is None else dataset
        self._stage_data = dataset if stages_read(dataset) or layout is not None else None
        self._dataset_json = json.dumps(dataset)  # what every StepData names (written once, not every step)
        self._layout_json = "" if layout is None else json.dumps(layout.to_json())
        self._labels_per_sample = labels_per_sample(dataset)

        def client(endpoint: StageEndpoint) -> StageClient:
            timeout = plan.rpc_timeout_seconds
            return StageClient(
                endpoint, job_id=plan.job_id, generation=plan.generation, credential=plan.credential, timeout=timeout
            )

        # Every agent of each stage: rank 0 first, then a tensor-parallel stage's other ranks, which get
        # the same inputs and RunStep (their outputs equal rank 0's, which is what the driver reads).
        self.ranks = [
            [
                client(s),
                *(
                    client(
                        replace(
                            s,
                            address=r.address,
                            node_id=r.node_id,
                            certificate=r.certificate,
                            public_key="",
                            tensor_parallel_ranks=(),
                        )
                    )
                    for r in s.tensor_parallel_ranks
                ),
            ]
            for s in plan.stages
        ]
        self._client = client
        # Replicated stages: a client per replica; the stage's lowest replica serves as the stage (its state).
        self.roster = (
            ReplicaRoster(plan.replicas, len(plan.stages), credential=plan.credential) if plan.replicas else None
        )
        self.replica_clients = {(e.index, e.replica): client(e) for e in plan.replicas}
        if self.replica_clients:
            for ranks in self.ranks:
                ranks[0].close()
            self.ranks = [[self.replica_clients[(s.index, s.replica)]] for s in plan.stages]
        self.clients = [ranks[0] for ranks in self.ranks]
        self._call_ids = itertools.count(1)  # unique per RunStep (train and eval) within this run
        self._train_step = 0  # the training step being run (Pipeline.step)
        self._ahead: _Sent | None = None  # the next train step, sent with the one before (`step`'s `then`)
        self._windows: list[_Window] = []  # windows sent and not yet taken to their end, in order (`window`)
        self.auditor = Auditor(plan) if plan.audit_rate > 0 else None
        # The counters the control plane bills (arceus.training.tally): what the driver can vouch for. Per
        # micro-batch an agent sends at most an activation and a gradient, each to every rank of a neighbour.
        self.tally = WorkTally()
        fanout = max(len(ranks) for ranks in self.ranks)
        self._max_step_bytes = 2 * fanout * MAX_MESSAGE_BYTES

    @property
    def chains(self) -> bool:
        """Whether `step` sends the next train step with this one (`then`): where stage 0 and the last stage read their
        samples themselves (nothing is pushed ahead of a step), no replica is repaired, no step is spot-checked (an
        audit reads a step's weights before the next step moves them) and no stage is split over tensor-parallel
        ranks (not measured chained)."""
        return (self.roster is None and self.auditor is None and self._stage_data is not None
                and all(len(ranks) == 1 for ranks in self.ranks))

    def step(self, batch: Batch, *, train: bool, train_step: int = 0, then: Batch | None = None) -> StepOutcome:
        """`train_step`: the job's training step (1, 2, ...) a train step computes, which seeds dropout's masks on
        every attempt at it (0: each RunStep's call id does). `then`: the next train step's batch, sent now (where the
        pipeline `chains`) chained after this one (`RunStepRequest.after_step`): each stage starts it as soon as its
        own part of this one is done, with no round trip to the driver in between. The next call must be that step's;
        a failure of this one cancels it."""
        if self._windows:
            self.cancel_windows()
            raise ValueError("a step goes out only once every window sent was taken to its end")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.batch.indices is not batch.indices or not train):
            _cancel(ahead.calls)
            raise ValueError(f"step {ahead.step} was sent ahead for another batch than the one asked for")
        self._train_step = train_step if train else 0
        if self.roster is not None:
            return self._replicated_step(self.roster, next(self._call_ids), batch, train=train)
        sent = ahead or self._send(batch, train=train, train_step=self._train_step, after=None)
        if then is not None and train and self.chains:
            self._ahead = self._send(then, train=True, train_step=train_step + 1 if train_step else 0, after=sent)
        try:
            return self._outcome(sent)
        except BaseException:
            self.cancel_ahead()
            raise

    def cancel_ahead(self) -> None:
        """Cancel the step sent ahead (`step`'s `then`), if one is outstanding."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            _cancel(ahead.calls)

    @property
    def windows(self) -> bool:
        """Whether train steps may go out in windows (`window`): where the pipeline `chains` and the job's staleness
        is 0 (staleness 1 overlaps consecutive steps on a stage: they go one RunStep each, chained)."""
        return self.chains and self.plan.staleness == 0

    def window(self, batches: Sequence[Batch], *, first_train_step: int) -> Iterator[StepOutcome]:
        """Train steps `first_train_step`, `first_train_step` + 1, ... of `batches` (of one size) in one RunSteps call
        per agent (where the pipeline runs `windows`; arceus.contracts.step_window), sent now: each stage runs them
        back to back. Sent while earlier windows are outstanding (not yet taken to their end), it is chained after
        the last of them (its first step's `after_step`): each stage starts it as soon as its own part of that one is
        done, with no round trip to the driver in between; its outcomes are taken after theirs. Yields each step's
        outcome as every stage answered it; the first step a stage failed raises as `step` would, after the outcomes
        of the steps before it, and cancels the windows sent after it (none of their steps counts)."""
        if self._ahead is not None or len({len(b.indices) for b in batches}) != 1:
            raise ValueError("a window is of batches of one size, with no step sent ahead")
        plan, n = self.plan, len(batches[0].indices)
        num_micro_batches = min(plan.micro_batches, n)
        before = self._windows[-1] if self._windows else None
        after = None if before is None else before.sent[-1]
        sent: list[_Sent] = []
        issued = time.perf_counter()
        for batch in batches:
            sent.append(_Sent(next(self._call_ids), batch, True, num_micro_batches, [], 0, issued, {},
                              sent[-1] if sent else after))
        reads = {0, len(self.ranks) - 1}
        calls = []
        for index, ranks in enumerate(self.ranks):
            for c in ranks:
                first = c.step_request(
                    step=sent[0].step, mode=stage_pb2.TRAIN, num_micro_batches=num_micro_batches,
                    schedule=plan.schedule, batch_size=n, learning_rate=plan.learning_rate,
                    train_step=first_train_step, data=self._data(batches[0]) if index in reads else None,
                    after_step=0 if after is None else after.step,
                )
                following = [
                    stage_pb2.WindowStep(step=s.step, train_step=first_train_step + k, learning_rate=plan.learning_rate,
                                         data=self._data(s.batch) if index in reads else None)
                    for k, s in enumerate(sent[1:], 1)
                ]
                calls.append(c.run_steps(first, following, behind=sum(len(w.sent) for w in self._windows)))
        window = _Window(sent, WindowStreams(calls))
        self._windows.append(window)
        return self._window_outcomes(window)

    def _window_outcomes(self, window: _Window) -> Iterator[StepOutcome]:
        """`window`'s steps' outcomes (`window`), once every window sent before it was taken to its end."""
        agents = [c for ranks in self.ranks for c in ranks]
        count = len(window.sent)

        def failure(agent: int, k: int, error: BaseException | None) -> DriverError:
            what = f"RunSteps (step {k + 1} of a window of {count})"
            if error is None:
                return DriverError(f"{what} on {agents[agent].describe()}: its replies ended after {k} steps",
                                   stage_index=agents[agent].endpoint.index)
            return _driver_error(agents[agent], what, error)

        if not self._windows or self._windows[0] is not window:
            self.cancel_windows()
            raise ValueError("a window's outcomes are taken after those of every window sent before it")
        finished = False
        try:
            for k, (replies, answered) in enumerate(window.streams.steps(count, failure)):
                window.sent[k].answered.update(enumerate(answered))
                outcome = self._checked(window.sent[k], replies)
                if k == count - 1:  # taken to its end: the window after it is next
                    finished = self._windows.pop(0) is window
                yield outcome
        finally:  # the caller stopped taking steps (or one failed): nothing of this window, nor after it, runs on
            if not finished:
                self.cancel_windows()

    def cancel_windows(self) -> None:
        """Cancel every window sent and not taken to its end (`window`)."""
        windows, self._windows = self._windows, []
        for window in windows:
            window.streams.cancel()

    def _send(self, batch: Batch, *, train: bool, train_step: int, after: _Sent | None) -> _Sent:
        """Start an unreplicated step's calls (`after`: the step it is chained after)."""
        plan = self.plan
        step = next(self._call_ids)
        n = len(batch.indices)
        num_micro_batches = min(plan.micro_batches, n)
        calls: list[tuple[StageClient, str, grpc.Future | Future[None]]] = []
        data = self._data(batch)
        if data is None:
            x, y = batch.take()
            for m, (xm, ym) in enumerate(
                zip(torch.tensor_split(x, num_micro_batches), torch.tensor_split(y, num_micro_batches), strict=True)
            ):
                calls.extend(
                    (c, f"pushing the inputs of micro-batch {m}", c.push(stage_pb2.ACTIVATION, step, m, xm))
                    for c in self.ranks[0]
                )
                calls.extend(
                    (c, f"pushing the labels of micro-batch {m}", c.push(stage_pb2.LABELS, step, m, ym))
                    for c in self.ranks[-1]
                )
        reads = {0, len(self.ranks) - 1}
        mode = stage_pb2.TRAIN if train else stage_pb2.EVAL
        issued = time.perf_counter()
        runs = [
            (
                c,
                "RunStep",
                c.run_step(
                    step=step,
                    mode=mode,
                    num_micro_batches=num_micro_batches,
                    schedule=plan.schedule,
                    batch_size=n,
                    learning_rate=plan.learning_rate,
                    retain_for_audit=train and self.auditor is not None,
                    train_step=train_step,
                    data=data if index in reads else None,
                    after_step=0 if after is None else after.step,
                ),
            )
            for index, ranks in enumerate(self.ranks)
            for c in ranks
        ]
        answered: dict[int, float] = {}
        for i, (_, _, future) in enumerate(runs):
            future.add_done_callback(lambda _f, i=i: answered.setdefault(i, time.perf_counter()))
        return _Sent(step, batch, train, num_micro_batches, calls + runs, len(calls), issued, answered, after)

    def _outcome(self, sent: _Sent) -> StepOutcome:
        """Wait for a step's calls (`_send`) and check and count what they answered."""
        return self._checked(sent, _await_all(sent.calls)[sent.pushes :])

    def _checked(self, sent: _Sent, every_reply: list[stage_pb2.RunStepReply]) -> StepOutcome:
        """A step's outcome from every agent's reply (in `ranks` order), checked and counted."""
        last, step, batch, num_micro_batches = self.clients[-1], sent.step, sent.batch, sent.num_micro_batches
        n = len(batch.indices)
        agents = [c for ranks in self.ranks for c in ranks]
        replies = [r for c, r in zip(agents, every_reply, strict=True) if c in self.clients]  # rank 0s
        final = replies[-1]
        if sum(final.sample_counts) != n:
            raise DriverError(
                f"{last.describe()} reported {sum(final.sample_counts)} samples for a batch of {n}",
                stage_index=last.endpoint.index,
            )
        spot_checks = []
        if sent.train and self.auditor is not None:
            try:
                parties = {(c.endpoint.index, 0): (c, r) for c, r in zip(self.clients, replies, strict=True)}
                spot_checks = self.auditor.check(step, parties, MicroBatches(batch, num_micro_batches, 0))
            except grpc.RpcError as exc:
                raise DriverError(f"a spot check of step {step} failed: {exc}") from exc
        walls = [sent.wall_seconds(i) for i in range(len(agents))]
        return StepOutcome(
            loss_sum=sum(final.loss_sums),
            correct=sum(final.correct),
            samples=n,
            labels=self._labels(n),
            stages=[
                self.tally.record(
                    index=c.endpoint.index,
                    node_id=c.endpoint.node_id,
                    samples=n,
                    micro_batches=num_micro_batches,
                    wall_seconds=walls[i],
                    max_bytes=self._max_step_bytes * num_micro_batches,
                    reported=r.counters,
                )
                for i, (c, r) in enumerate(zip(agents, every_reply, strict=True))
            ],
            spot_checks=spot_checks,
            timings=[
                _timing(c.endpoint.index, r, walls[i], samples=n, micro_batches=num_micro_batches)
                for i, (c, r) in enumerate(zip(agents, every_reply, strict=True))
                if c in self.clients
            ],
        )

    def _data(self, batch: Batch) -> stage_pb2.StepData | None:
        """What stage 0 and the last stage are told of `batch` where they read it themselves; None where the driver
        pushes it."""
        if self._stage_data is None:
            return None
        return stage_pb2.StepData(dataset_json=self._dataset_json, validation=batch.validation,
                                  indices=batch.indices.tolist(), layout_json=self._layout_json)

    def _labels(self, n: int) -> int:
        """Loss terms in a batch of `n` samples (the mean loss divides by them)."""
        return n * self._labels_per_sample

    def _replicated_step(self, roster: ReplicaRoster, step: int, batch: Batch, *, train: bool) -> StepOutcome:
        """One step of replicated stages. A replica lost meanwhile (its agent no longer answers) leaves the roster
        (a new membership epoch) and the survivors repair the step (arceus.swarm.repair): each reports what it
        holds of it, only the lost replicas' micro-batches are recomputed, by survivors of their stages, from the
        boundary tensors their neighbours kept, and the exchange commits among the survivors; every micro-batch
        counts once in each stage's gradient. Where no repair applies (an evaluation step, replicas that sync every
        few steps, a survivor that cannot report) the step runs again on the others under a new call id, every
        replica discarding what it deferred from the failed attempt; either way no checkpoint is loaded and no
        finished step is replayed. A failure with every replica alive is retried, then blamed on the newest
        replica (`_blame`). A stage left without replicas is the DriverError of an unreplicated pipeline."""
        self._join(roster)
        failed: list[int] = []
        retried = False  # a failure between live replicas was retried in this step (`_blame`)
        repair: RepairPlan | None = None
        delivered: set[tuple[int, int, int]] = set()  # (kind, micro-batch, replica) the driver's pushes reached
        started = time.perf_counter()  # a replica computes the step within its attempts' calls, all since then
        while True:
            routes = repair.routes if repair is not None else self._routes(roster, len(batch.indices), train=train)
            pushes: list[tuple[tuple[int, int, int], Future[None]]] = []
            try:
                outcome = self._replicated_attempt(
                    roster, step, routes, batch, train=train, failed=failed, repair=repair, delivered=delivered,
                    pushes=pushes, started=started,
                )
                if repair is not None:
                    log.info("job %s: step %d repaired without a rerun (membership epoch %d)",
                             self.plan.job_id, step, roster.epoch)
                return outcome
            except StepNotGranted:
                raise  # a stop: no replica is lost or to blame
            except DriverError as exc:
                # Logged as text: a record holding the exception would hold, through its traceback, this step's
                # frames (and the caller's) in any handler that keeps records (pytest's), and so what they hold.
                epoch, failure = roster.epoch, str(exc)
                lost = self._drop_lost(roster, exc)
                if not lost:
                    lost, retried = self._blame(roster, exc, retried=retried), True
                # What the driver's pushes delivered is known once they settle (one to a silent replica may not).
                futures.wait([future for _, future in pushes], timeout=LIVENESS_SECONDS)
                delivered |= {key for key, f in pushes if f.done() and not f.cancelled() and f.exception() is None}
                repair, why = self._plan_repair(step, routes, lost, epoch, train=train)
                if repair is None:
                    log.warning("job %s lost replicas %s in step %d (%s); running it again without them: %s",
                                self.plan.job_id, lost, step, failure, why)
                    failed.append(step)
                    step, delivered = next(self._call_ids), set()
                    continue
                if not lost:  # `_blame` said why
                    continue
                moved = sum(len(i.recompute) for i in repair.instructions.values())
                log.warning("job %s lost replicas %s in step %d (%s); the survivors repair it: %d micro-batches "
                            "recomputed, nothing else", self.plan.job_id, lost, step, failure, moved)

    def _routes(self, roster: ReplicaRoster, n: int, *, train: bool) -> Routes:
        """A step's routes over the roster's members, by their speeds (an evaluation of a batch with fewer
        micro-batches than a stage's replicas uses the first members)."""
        num_micro_batches = min(self.plan.micro_batches, n)
        members = roster.members()
        if train and num_micro_batches < max(len(ids) for ids in members):
            raise DriverError(
                f"a batch of {n} samples makes {num_micro_batches} micro-batches, fewer than the "
                f"{max(len(ids) for ids in members)} replicas of a stage: every replica needs one to take the step"
            )
        if num_micro_batches < max(len(ids) for ids in members):  # evaluation: the first members suffice
            members = [ids[:num_micro_batches] for ids in members]
        return route_step(num_micro_batches, members, roster.speeds)

    def _plan_repair(
        self, step: int, routes: Routes, lost: Sequence[ReplicaKey], epoch: int, *, train: bool
    ) -> tuple[RepairPlan | None, str]:
        """The repair of `step` (run on `routes` at membership `epoch`) after `lost` left the roster, from every
        survivor's holdings; (None, why) where none applies, and the step runs again as a whole."""
        if not train:
            return None, "an evaluation step keeps no gradients to repair"
        lost = [key for key in lost if key[1] in routes.members[key[0]]]
        survivors = [(i, k) for i, ids in enumerate(routes.members) for k in ids if (i, k) not in lost]
        asked = [(key, self.replica_clients[key].holdings(step, self.roster.epoch)) for key in survivors]
        entries, exchanged = {}, set()
        for (i, k), future in asked:
            try:
                reply = future.result()
                entries.update(StepHoldings.from_json(json.loads(reply.holdings_json)))
                if reply.HasField("exchanged_epoch") and reply.exchanged_epoch == epoch:
                    exchanged.add((i, k))  # it holds the reduced gradient of the step's members
            except grpc.RpcError as exc:
                return None, f"stage {i} replica {k} could not report what it holds: {exc.code().name}: {exc.details()}"
            except (json.JSONDecodeError, SpecError) as exc:
                return None, f"stage {i} replica {k} reported holdings that do not parse: {exc}"
        try:
            plan = repair_step(routes, lost, StepHoldings(entries), self.roster.speeds, epoch, exchanged)
        except ValueError as exc:  # a survivor's report does not fit the step (SpecError is a ValueError)
            return None, f"the survivors' holdings make no repair: {exc}"
        if plan.rewind:
            return None, f"stages {list(plan.rewind_stages)} lost every replica"
        if plan.epoch != self.roster.epoch:
            return None, f"the repair's epoch {plan.epoch} is not the roster's {self.roster.epoch}"
        return plan, ""

    def _placed_watch(self, members: Sequence[StageClient]) -> Callable[[], DriverError | None] | None:
        """What `_await_all` asks while a step of `members` is outstanding: a DriverError once the control plane no
        longer places one of them and its agent does not answer either (a silent node, lost), so the step is given up
        and the replica dropped. One taken off that still answers (a paused node's) finishes the step."""
        placed_now = self.plan.replica_placed
        if placed_now is None:
            return None

        def watch() -> DriverError | None:
            placed = placed_now()
            gone = [c for c in members if (c.endpoint.index, c.endpoint.replica) not in placed]
            if not gone:
                return None
            answering = agents_answering([(c.endpoint.address, c.endpoint.certificate) for c in gone],
                                         timeout=LIVENESS_SECONDS, concurrency=len(gone), refused_is_down=True)
            silent = [c for c, up in zip(gone, answering, strict=True) if not up]
            if not silent:
                return None
            return DriverError(
                f"{silent[0].describe()} fell silent mid-step and the control plane took it off the job (its node "
                "was lost)", stage_index=silent[0].endpoint.index, code="UNAVAILABLE",
            )

        return watch

    def _drop_lost(self, roster: ReplicaRoster, exc: DriverError) -> list[ReplicaKey]:
        """After `exc`, the replicas whose agents no longer answer, taken off the roster (none: every replica
        answers, the failure was not a loss); a DriverError when a stage lost every replica."""
        clients = list(self.replica_clients.values())
        alive = agents_answering(
            [(c.endpoint.address, c.endpoint.certificate) for c in clients], timeout=LIVENESS_SECONDS,
            concurrency=len(clients), refused_is_down=True,
        )
        lost = [(c.endpoint.index, c.endpoint.replica) for c, up in zip(clients, alive, strict=True) if not up]
        if not lost:
            return []
        try:
            roster.remove(lost)
        except ValueError as gone:
            raise DriverError(f"{gone}; after: {exc}", stage_index=lost[0][0], code=exc.code) from exc
        self._forget(roster, lost)
        return lost

    def drop_lost_replicas(self, exc: DriverError) -> list[ReplicaKey]:
        """After a failed call between steps (a checkpoint's), the replicas whose agents no longer answer, taken off
        the roster, so the call can be made again on the others; `exc` again when nothing was lost."""
        if self.roster is None or not (lost := self._drop_lost(self.roster, exc)):
            raise exc
        return lost

    def _blame(self, roster: ReplicaRoster, exc: DriverError, *, retried: bool) -> list[ReplicaKey]:
        """After `exc` failed a step with every replica alive (an exchange or a push between live replicas, say a
        sibling that dialled a joiner before the joiner trusted its certificate): whose fault it was cannot be told,
        and rewinding every stage for it would throw the job's work away. The first such failure of a step costs
        nothing but a new membership epoch: the step resumes with every member (none blamed, []). Another fences
        the newest member of the failing stage or its neighbours (a newcomer is the likely culprit, and holds
        nothing its stage's others lack) and the survivors repair the step as after a loss; it may join again later
        (`ReplicaRoster.fence`), while the control plane still places it, which is told (`plan.replica_fenced`).
        `exc` again where no such stage keeps a member (the failure is not between replicas: as an unreplicated
        pipeline's)."""
        if exc.stage_index is None:
            raise exc
        if not retried:
            roster.renew()
            log.warning("job %s: step failed with every replica alive (%s); resuming it under membership epoch %d",
                        self.plan.job_id, str(exc), roster.epoch)
            return []
        suspect = roster.newest(range(exc.stage_index - 1, exc.stage_index + 2))
        if suspect is None:
            raise exc
        until = roster.fence(suspect, self._train_step)
        self._forget(roster, [suspect])
        log.warning("job %s: step failed again with every replica alive (%s); fenced stage %d replica %d, the newest "
                    "member near stage %d, until step %d", self.plan.job_id, str(exc), *suspect, exc.stage_index, until)
        if self.plan.replica_fenced is not None:
            self.plan.replica_fenced(ReplicaFence(*suspect, until, self._train_step))
        return [suspect]

    def _forget(self, roster: ReplicaRoster, gone: Sequence[ReplicaKey]) -> None:
        """Close the clients of replicas `roster` no longer has; each stage is served by its lowest replica."""
        for key in gone:
            self.replica_clients.pop(key).close()
        self.ranks = [[self.replica_clients[(i, min(ids))]] for i, ids in enumerate(roster.members())]
        self.clients = [ranks[0] for ranks in self.ranks]

    def endpoints(self) -> tuple[StageEndpoint, ...]:
        """Where each stage is served now (a replicated stage: by its lowest live replica)."""
        return tuple(ranks[0].endpoint for ranks in self.ranks)

    def _join(self, roster: ReplicaRoster) -> None:
        """Let replicas the control plane took off the job leave (`plan.replica_placed`; a stage's last stays, as
        the control plane rewinds a stage that lost every replica), then add the replicas ready to join
        (`plan.replica_joins`), each after copying its stage's state from the stage's lowest live replica; one
        that cannot copy now is left for a later step. A live replica fenced earlier (`_blame`) joins again the same
        way once its wait is over, while the control plane places it: one placed with the job too, which the control
        plane would never offer as a joiner."""
        placed = None
        if self.plan.replica_placed is not None:
            placed = self.plan.replica_placed()
            members = roster.members()
            left = [(i, k) for i, ids in enumerate(members) for k in ids
                    if (i, k) not in placed and any((i, other) in placed for other in ids)]
            if left:
                roster.remove(left)
                self._forget(roster, left)
                log.info("job %s: replicas %s were taken off the job; going on without them", self.plan.job_id, left)
        joins = self.plan.replica_joins() if self.plan.replica_joins else ()
        offered = {(e.index, e.replica): e for e in roster.fenced() if placed is None or (e.index, e.replica) in placed}
        offered.update({(e.index, e.replica): e for e in joins})
        for key, endpoint in sorted(offered.items()):
            if not roster.may_join(key, self._train_step):
                continue
            source = self.replica_clients[(endpoint.index, min(roster.members()[endpoint.index]))].endpoint
            client = self._client(endpoint)
            try:
                sha256, size, held = client.copy_state(source, roster.epoch)
                if held != sha256:
                    raise ValueError(f"it copied state of sha256 {sha256} but holds sha256 {held}")
                roster.add(endpoint, self.plan.micro_batches)
            except (grpc.RpcError, ValueError) as exc:
                client.close()
                log.warning("job %s: stage %d replica %d cannot join now: %s", self.plan.job_id, *key, str(exc))
                continue
            self.replica_clients[key] = client
            log.info("job %s: stage %d replica %d joined with %d bytes of state (sha256 %s) from replica %d",
                     self.plan.job_id, *key, size, sha256, source.replica)
            if self.plan.replica_joined is not None:
                self.plan.replica_joined(ReplicaJoin(*key, source.replica, size, sha256, held))

    def _replicated_attempt(
        self, roster: ReplicaRoster, step: int, routes: Routes, batch: Batch, *, train: bool,
        failed: list[int], repair: RepairPlan | None, delivered: set[tuple[int, int, int]],
        pushes: list[tuple[tuple[int, int, int], Future[None]]], started: float,
    ) -> StepOutcome:
        """One attempt at a step of replicated stages: inputs and labels to the replicas each micro-batch's route
        names, RunStep to every member with the routes, then the loss in micro-batch order and the replicas' speeds
        learnt. A repair (`repair`, the same step resumed) pushes only the inputs and labels the survivors lack
        (the lost replicas' and any earlier push did not deliver: `delivered`), and names each survivor's
        instructions. `pushes`: each push it makes, by (kind, micro-batch, replica). `started`: when the step's first
        attempt was issued; a replica's compute is credited up to the wall time since (a survivor of a repaired step
        did its own share in the attempts before, the lost replicas' in this one)."""
        plan, n = self.plan, len(batch.indices)
        num_micro_batches = routes.num_micro_batches
        last = len(plan.stages) - 1
        calls: list[tuple[StageClient, str, grpc.Future | Future[None]]] = []
        data = self._data(batch)
        repush = set() if repair is None else {
            *((_ACTIVATION, m, r) for m, r in repair.driver_repush_inputs),
            *((_LABELS, m, r) for m, r in repair.driver_repush_labels),
        }
        pushed = () if data is not None else zip(
            *(torch.tensor_split(t, num_micro_batches) for t in batch.take()), strict=True
        )
        for m, (xm, ym) in enumerate(pushed):  # a survivor that reads its samples reads a lost replica's too
            for kind, stage, tensor, what in ((_ACTIVATION, 0, xm, "inputs"), (_LABELS, last, ym, "labels")):
                key = (kind, m, routes.of[m][stage])
                if repair is not None and key not in repush and key in delivered:
                    continue
                client = self.replica_clients[(stage, key[2])]
                future = client.push(kind, step, m, tensor)
                pushes.append((key, future))
                calls.append((client, f"pushing the {what} of micro-batch {m}", future))
        mode = stage_pb2.TRAIN if train else stage_pb2.EVAL
        agents = [self.replica_clients[(i, k)] for i, ids in enumerate(routes.members) for k in ids]
        issued = time.perf_counter()

        def replica_step(c: StageClient) -> stage_pb2.ReplicaStep:
            swarm = roster.replica_step(c.endpoint.index, routes, failed)
            if repair is not None:
                swarm.repair_json = json.dumps(repair.instructions[(c.endpoint.index, c.endpoint.replica)].to_json())
            return swarm

        runs = [
            (
                c,
                "RunStep",
                c.run_step(
                    step=step, mode=mode, num_micro_batches=num_micro_batches, schedule=plan.schedule, batch_size=n,
                    learning_rate=plan.learning_rate, replicas=replica_step(c),
                    retain_for_audit=train and self.auditor is not None,
                    train_step=self._train_step, data=data if c.endpoint.index in (0, last) else None,
                ),
            )
            for c in agents
        ]
        answered: dict[int, float] = {}
        for i, (_, _, future) in enumerate(runs):
            future.add_done_callback(lambda _f, i=i: answered.setdefault(i, time.perf_counter()))
        # The driver's own pushes are left to finish when a call fails: a repair then knows what they delivered.
        replies: list[stage_pb2.RunStepReply] = _await_all(
            calls + runs, cancel_from=len(calls), watch=self._placed_watch(agents)
        )[len(calls) :]
        per_micro_batch: dict[int, tuple[float, int, int]] = {}
        for c, r in zip(agents, replies, strict=True):
            routed = routes.micro_batches_of(c.endpoint.index, c.endpoint.replica)
            is_last = c.endpoint.index == last
            results = (r.loss_sums, r.correct, r.sample_counts) if is_last else ((),) * 3
            if tuple(r.micro_batches) != routed or (is_last and any(len(v) != len(routed) for v in results)):
                raise DriverError(
                    f"{c.describe()} reported micro-batches {list(r.micro_batches)} (and {len(r.loss_sums)} losses); "
                    f"its route gave it {list(routed)}",
                    stage_index=c.endpoint.index,
                )
            per_micro_batch.update(zip(routed, zip(*results, strict=True), strict=False))
        if sum(v[2] for v in per_micro_batch.values()) != n:
            raise DriverError(
                f"the last stage's replicas reported {sum(v[2] for v in per_micro_batch.values())} samples for a "
                f"batch of {n}",
                stage_index=last,
            )
        spot_checks = []
        if train and self.auditor is not None:
            parties = {(c.endpoint.index, c.endpoint.replica): (c, r) for c, r in zip(agents, replies, strict=True)}
            try:
                # A repaired step's survivors sign for the whole step: it is checked as any (the lost replicas'
                # micro-batches the survivors recomputed named, whose tensors may come from a lost replica).
                moved = () if repair is None else [
                    (i, m) for (i, _), todo in repair.instructions.items() for m in todo.recompute
                ]
                inputs, labels = (MicroBatches(batch, num_micro_batches, part) for part in (0, 1))
                spot_checks = self.auditor.check(step, parties, inputs, routes, labels, moved)
            except grpc.RpcError as exc:
                raise DriverError(f"a spot check of step {step} failed: {exc}") from exc
        sizes = [len(part) for part in micro_batch_indices(batch.indices, num_micro_batches)]
        ran = [sum(sizes[m] for m in r.micro_batches) for r in replies]
        if train and repair is None:  # a repaired step's replies time only what was left of it
            roster.measured([((c.endpoint.index, c.endpoint.replica), s, r.compute_seconds)
                             for c, r, s in zip(agents, replies, ran, strict=True)])
        timings = [  # each replica's own: its speed and its share of the step, as the dashboard shows them
            _timing(c.endpoint.index, r, answered[i] - issued, samples=s, micro_batches=len(r.micro_batches),
                    node_id=c.endpoint.node_id)
            for i, (c, r, s) in enumerate(zip(agents, replies, ran, strict=True))
        ]
        return StepOutcome(
            loss_sum=sum(per_micro_batch[m][0] for m in range(num_micro_batches)),
            correct=sum(v[1] for v in per_micro_batch.values()),
            samples=n,
            labels=self._labels(n),
            stages=[
                self.tally.record(
                    index=c.endpoint.index, node_id=c.endpoint.node_id, samples=s, micro_batches=len(r.micro_batches),
                    wall_seconds=answered[i] - started, max_bytes=self._max_step_bytes * num_micro_batches,
                    reported=r.counters,
                )
                for i, (c, r, s) in enumerate(zip(agents, replies, ran, strict=True))
            ],
            spot_checks=spot_checks,
            timings=timings,
            exchange_bytes=sum(r.exchange_bytes for r in replies),
        )

    def evaluate(self, samples: Samples, batch_size: int) -> tuple[float, float, list[StageCounters]]:
        """(mean loss, accuracy, stage counters) over the whole validation set, read a batch at a time."""
        loss_sum, correct, labels = 0.0, 0, 0
        stages: list[StageCounters] = []
        for start in range(0, len(samples), batch_size):
            batch = Batch(samples, torch.arange(start, min(start + batch_size, len(samples))), validation=True)
            outcome = self.step(batch, train=False)
            loss_sum, correct, stages = loss_sum + outcome.loss_sum, correct + outcome.correct, outcome.stages
            labels += self._labels(len(batch.indices))
        n = max(labels, 1)  # mean over labels: samples, or a GPT's tokens
        return loss_sum / n, correct / n, stages

    def states(
        self, directory: Path, *, include_optimizer_state: bool = True, uploads: dict[int, UploadTarget] | None = None
    ) -> list[StageStateFile]:
        """Every stage's weights (and optimizer state) between steps (a coordinated checkpoint): uploaded by
        the stage's agent itself where `uploads` names a target for its index (an unsplit stage), otherwise
        streamed into a safetensors file in `directory` a chunk at a time."""
        uploads = uploads or {}
        return [
            self._uploaded_state(ranks[0], endpoint, uploads[endpoint.index])
            if endpoint.index in uploads and len(ranks) == 1
            else self._stage_state(ranks, endpoint, directory, include_optimizer_state)
            for ranks, endpoint in zip(self.ranks, self.endpoints(), strict=True)
        ]

    def _uploaded_state(self, client: StageClient, endpoint: StageEndpoint, target: UploadTarget) -> StageStateFile:
        try:
            sha256, size = client.upload_state(target.path)
        except grpc.RpcError as exc:
            raise _driver_error(client, "SaveState (checkpoint)", exc) from exc
        return StageStateFile(
            endpoint.index, endpoint.layer_start, endpoint.layer_end, None, sha256, size, upload_id=target.upload_id
        )

    def _stage_state(
        self, ranks: list[StageClient], endpoint: StageEndpoint, directory: Path, include_optimizer_state: bool
    ) -> StageStateFile:
        """One stage's state file under the unsplit model's names: a tensor-parallel stage's shards are
        gathered, so its checkpoint is the file an unsplit stage would write."""
        what = "GetState (checkpoint)" if include_optimizer_state else "GetState"
        paths = [directory / f"stage-{endpoint.index}-rank-{rank}.safetensors" for rank in range(len(ranks))]
        saved = []
        for rank, (client, path) in enumerate(zip(ranks, paths, strict=True)):
            try:
                saved.append(client.save_state(path, include_optimizer_state=include_optimizer_state))
            except grpc.RpcError as exc:
                raise _driver_error(client, what, exc) from exc
            self._check_state(endpoint, path, Shard(rank, len(ranks)) if len(ranks) > 1 else None)
        if len(ranks) == 1:
            (sha256, size), path = saved[0], paths[0]
        else:
            path = directory / f"stage-{endpoint.index}.safetensors"
            sha256, size = self._gather(ranks, paths, path)
        return StageStateFile(endpoint.index, endpoint.layer_start, endpoint.layer_end, path, sha256, size)

    def _check_state(self, endpoint: StageEndpoint, path: Path, shard: Shard | None) -> None:
        """DriverError unless the file a stage (or one rank of it) streamed holds exactly its state, checked
        from its header: an agent's file is never trusted, nor gathered, as it is (the plan says which model
        and optimizer the stages have; a plan without them is not checked)."""
        if not (self.plan.model and self.plan.optimizer):
            return
        spec = model_spec_from_config(self.plan.model)
        expected = expected_stage_state(
            spec, stage_index=endpoint.index, layer_start=endpoint.layer_start, layer_end=endpoint.layer_end,
            optimizer=self.plan.optimizer,
        )
        if shard is not None:
            expected = rank_expected_state(spec, expected, shard)
        try:
            with path.open("rb") as handle:
                stage_file_check(handle, path.stat().st_size, expected)
        except StageStateError as exc:
            where = "" if shard is None else f" (rank {shard.rank})"
            raise DriverError(f"GetState{where}: {exc}", stage_index=endpoint.index) from exc

    def _gather(self, ranks: list[StageClient], shards: list[Path], destination: Path) -> tuple[str, int]:
        """The unsplit stage's file from its ranks', streamed a tensor at a time (never the whole stage)."""
        spec = model_spec_from_config(self.plan.model)
        try:
            tensors = gather_state_tensors(spec, [StateFile(path) for path in shards])
        except SpecError as exc:  # the plan names a split stage of a model that cannot split
            raise DriverError(f"{exc.field}: {exc.message}", stage_index=ranks[0].endpoint.index) from exc
        _, chunks = state_chunks(tensors)
        digest, size = hashlib.sha256(), 0
        with destination.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def close(self) -> None:
        self.cancel_ahead()
        self.cancel_windows()
        clients = [*(c for ranks in self.ranks for c in ranks), *self.replica_clients.values()]
        for client in {id(c): c for c in clients}.values():  # a tensor-parallel stage's other ranks, every replica
            client.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def train(plan: TrainPlan, sink: ProgressSink) -> TrainResult:
    """Train for `plan.epochs` (or until `plan.max_steps`, or until `sink.should_stop()`), starting
    after `plan.start_step` with the data order of a run that never stopped.

    Validation runs after every epoch and when `max_steps` ends training early (then it reports the
    partial epoch through `sink.on_epoch` too). Every `plan.checkpoint_interval` steps, whenever
    `sink.wants_checkpoint()`, and at the end, every stage's state goes to `sink.on_checkpoint` (after
    the epoch's validation when both fall on one step, so a resumed run never needs to validate an
    epoch again). A stop requested by the sink, or a train step an agent refused as beyond its job's step grant
    (`StepNotGranted`, the result's `stop_reason`), skips validation; the result then carries the last
    validation's numbers (NaN if there was none). Where the pipeline chains its steps (`Pipeline.chains`), a train
    step goes out with the one before it, so the sink is asked for a checkpoint or a stop before that one runs: what
    it asks applies a step later. Where it runs windows of steps (`Pipeline.windows`), each window goes out, chained,
    while the one before still has `CHAIN_AHEAD_STEPS` steps to answer: what the sink asks after that applies after
    the window sent.
    """
    plan.check()
    dataset = validate_dataset_config(plan.dataset)
    with dataset_samples(dataset, plan.open_dataset) as (train_set, val_set):
        return _train(plan, sink, dataset, train_set, val_set)


def _train(plan: TrainPlan, sink: ProgressSink, dataset: dict, train_set: Samples, val_set: Samples) -> TrainResult:
    batch_size, val_batch_size = dataset["batch_size"], dataset["val_batch_size"]
    steps_per_epoch = math.ceil(len(train_set) / batch_size)
    total_steps = steps_per_epoch * plan.epochs
    if plan.max_steps is not None:
        total_steps = min(total_steps, plan.max_steps)
    step, final_loss, val_loss, val_accuracy = plan.start_step, math.nan, math.nan, math.nan
    stages: list[StageCounters] = []
    stopped, stop_reason = False, ""
    step_seconds: float | None = None  # the last train step's wall time: what sizes a window
    # Resuming from the final checkpoint re-runs only the last validation (the driver died before it
    # could report the end).
    first_epoch = min(plan.start_step // steps_per_epoch + 1, plan.epochs)
    # An upload's stages read their rows themselves (a tensor file's, a text's token file's): the driver has read only
    # the file's header.
    layout = train_set.layout if isinstance(train_set, UploadRows) else None
    with Pipeline(plan, dataset=dataset, layout=layout) as pipeline:

        def checkpoint(epoch: int) -> None:
            while True:  # a replica lost since the last step: its stage's state comes from another (they are equal)
                uploads = sink.checkpoint_uploads(step, pipeline.endpoints())
                with tempfile.TemporaryDirectory(prefix="arceus-checkpoint-") as directory:
                    try:
                        sink.on_checkpoint(step, epoch, pipeline.states(Path(directory), uploads=uploads))
                        return
                    except StageStateError as exc:  # a stage's state refused (or never uploaded): its failure
                        raise DriverError(str(exc), stage_index=exc.stage_index) from exc
                    except DriverError as exc:  # re-raised unless a replica was lost
                        log.warning("job %s lost replicas %s before the checkpoint of step %d (%s); saving from "
                                    "the others", plan.job_id, pipeline.drop_lost_replicas(exc), step, str(exc))

        for epoch in range(first_epoch, plan.epochs + 1):
            batches = epoch_batches(len(train_set), batch_size, plan.seed, epoch)
            skip = plan.start_step - (epoch - 1) * steps_per_epoch if epoch == first_epoch else 0
            todo = batches[skip:]
            sent_ahead = False  # this step went out with the one before: what comes between them was decided then
            # The window after the one under way, sent before that one ended (chained after it): its length and
            # outcomes.
            queued: tuple[int, Iterator[StepOutcome]] | None = None

            i = 0
            while i < len(todo) and step < total_steps:
                if not sent_ahead and queued is None:
                    if sink.wants_checkpoint():
                        checkpoint(epoch)
                    if sink.should_stop():
                        stopped = True
                        break
                if pipeline.windows:
                    count, outcomes = queued or _send_window(pipeline, train_set, todo, i, step, total_steps,
                                                             step_seconds)
                    queued = None
                else:
                    # The next step goes out with this one where nothing comes between them: it is of this epoch, no
                    # checkpoint follows this step, and the sink asks for no checkpoint and no stop now.
                    count, current = 1, step + 1
                    sent_ahead = (
                        pipeline.chains and i + 1 < len(todo) and current < total_steps
                        and not (plan.checkpoint_interval and current % plan.checkpoint_interval == 0)
                        and not sink.wants_checkpoint() and not sink.should_stop()
                    )
                    outcomes = iter([None])
                # Where the window after this one starts (todo's index, and the step it follows).
                following = {"at": i + count, "after": step + count, "total_steps": total_steps}
                queued = _chained(pipeline, sink, train_set, todo, outstanding=count, step_seconds=step_seconds,
                                  **following)
                started = time.perf_counter()
                try:
                    for k, outcome in enumerate(outcomes):
                        if outcome is None:  # a step of its own
                            outcome = pipeline.step(Batch(train_set, todo[i]), train=True, train_step=step + 1,
                                                    then=Batch(train_set, todo[i + 1]) if sent_ahead else None)
                        now = time.perf_counter()
                        elapsed, started = now - started, now
                        step, i, step_seconds = step + 1, i + 1, elapsed
                        final_loss, stages = outcome.loss_sum / outcome.labels, outcome.stages
                        sink.on_step(
                            StepProgress(
                                epoch=epoch,
                                step=step,
                                total_steps=total_steps,
                                loss=final_loss,
                                samples_per_second=outcome.samples / elapsed if elapsed > 0 else 0.0,
                                seconds=elapsed,
                                stages=outcome.stages,
                                spot_checks=outcome.spot_checks,
                                timings=outcome.timings,
                                exchange_bytes=outcome.exchange_bytes,
                            )
                        )
                        if queued is None:
                            queued = _chained(pipeline, sink, train_set, todo, outstanding=count - k - 1,
                                              step_seconds=step_seconds, **following)
                except StepNotGranted as exc:  # no stage took the step: every stage holds step `step`'s state
                    log.warning("job %s: stopped after step %d: %s", plan.job_id, step, exc)
                    stopped, stop_reason = True, str(exc)
                    break
                ends_epoch = step % steps_per_epoch == 0 or step >= total_steps
                if plan.checkpoint_interval and step % plan.checkpoint_interval == 0 and not ends_epoch:
                    checkpoint(epoch)  # (a window ends at a checkpoint's step)
            if stopped:
                break
            val_loss, val_accuracy, stages = pipeline.evaluate(val_set, val_batch_size)
            log.info(
                "job %s epoch %d: val_loss %.4f, val_accuracy %.4f",
                plan.job_id,
                epoch,
                val_loss,
                val_accuracy,
            )
            sink.on_epoch(
                EpochResult(epoch=epoch, val_loss=val_loss, val_accuracy=val_accuracy, stages=stages)
            )
            if step >= total_steps or (plan.checkpoint_interval and step % plan.checkpoint_interval == 0):
                checkpoint(epoch)
            if step >= total_steps:
                break
    return TrainResult(
        steps=step,
        final_loss=final_loss,
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        stopped=stopped,
        stages=stages,
        stop_reason=stop_reason,
    )


def _chained(pipeline: Pipeline, sink: ProgressSink, samples: Samples, todo: Sequence[torch.Tensor], *,
             outstanding: int, at: int, after: int, total_steps: int, step_seconds: float | None,
             ) -> tuple[int, Iterator[StepOutcome]] | None:
    """The window after step `after` (`todo[at]` first), sent now, chained after the one under way, once `outstanding`
    steps of that one are left to answer (`CHAIN_AHEAD_STEPS`) and where nothing comes between the two: it is of this
    epoch, no checkpoint follows the one under way, and the sink asks for no checkpoint and no stop now (what it asks
    later applies after the window sent); None where it is not sent now."""
    if (not pipeline.windows or outstanding > CHAIN_AHEAD_STEPS or at >= len(todo) or after >= total_steps
            or (pipeline.plan.checkpoint_interval and after % pipeline.plan.checkpoint_interval == 0)
            or sink.wants_checkpoint() or sink.should_stop()):
        return None
    return _send_window(pipeline, samples, todo, at, after, total_steps, step_seconds)


def _send_window(pipeline: Pipeline, samples: Samples, todo: Sequence[torch.Tensor], at: int, after: int,
                 total_steps: int, step_seconds: float | None) -> tuple[int, Iterator[StepOutcome]]:
    """The window after step `after`, `todo[at]` (an epoch's batches from there on) first, sent (`Pipeline.window`):
    how many steps it holds and their outcomes. Its batches are of one size (an epoch's last may be short)."""
    count = window_length(step=after, last_step=min(total_steps, after + len(todo) - at),
                          checkpoint_interval=pipeline.plan.checkpoint_interval, step_seconds=step_seconds)
    count = next((k for k in range(1, count) if len(todo[at + k]) != len(todo[at])), count)
    return count, pipeline.window([Batch(samples, todo[at + k]) for k in range(count)], first_train_step=after + 1)


def _timing(
    index: int, reply: stage_pb2.RunStepReply, wall_seconds: float, *, samples: int, micro_batches: int,
    node_id: str = "",
) -> StageTiming:
    """A stage's (or replica's) own account of its step, each figure kept within the wall time the driver measured
    (an agent is a stranger's process: NaN or a claimed hour reads as the whole call), with the samples and
    micro-batches the driver routed to it."""

    def bounded(value: float) -> float:
        return min(max(value, 0.0), wall_seconds) if math.isfinite(value) else wall_seconds

    return StageTiming(index, bounded(reply.compute_seconds), bounded(reply.wait_seconds), wall_seconds,
                       node_id=node_id, samples=samples, micro_batches=micro_batches)


def _await_all(
    calls: list[tuple[StageClient, str, grpc.Future | Future[None]]],
    *,
    cancel_from: int = 0,
    watch: Callable[[], DriverError | None] | None = None,
) -> list:
    """Results of all calls in order; the first failure cancels the others from index `cancel_from` on (those
    before it are left to finish) and raises DriverError. `watch`: asked every WATCH_SECONDS while calls are
    outstanding; a DriverError it returns cancels them (from `cancel_from` on) and is raised."""
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index, (_, _, future) in enumerate(calls):
        future.add_done_callback(lambda _f, i=index: done.put(i))
    results: list = [None] * len(calls)
    for _ in calls:
        while True:
            try:
                index = done.get(timeout=None if watch is None else WATCH_SECONDS)  # every call has a deadline
                break
            except queue.Empty:
                given_up = watch() if watch is not None else None
                if given_up is not None:
                    for _, _, other in calls[cancel_from:]:
                        other.cancel()
                    raise given_up from None
        client, what, future = calls[index]
        error = future.exception()
        if error is not None:
            for _, _, other in calls[cancel_from:]:
                other.cancel()
            raise _driver_error(client, what, error)
        results[index] = future.result()
    return results


def _cancel(calls: Sequence[tuple[StageClient, str, grpc.Future | Future[None]]]) -> None:
    for _, _, future in calls:
        future.cancel()


def _driver_error(client: StageClient, what: str, error: BaseException) -> DriverError:
    if isinstance(error, grpc.Call | PushError):
        code = error.code()
        kind = StepNotGranted if is_not_granted(code.name, error.details() or "") else DriverError
        return kind(
            f"{what} on {client.describe()} failed with {code.name}: {error.details()}",
            stage_index=client.endpoint.index,
            code=code.name,
        )
    return DriverError(f"{what} on {client.describe()} failed: {error}", stage_index=client.endpoint.index)
