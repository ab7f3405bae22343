"""The repair planner, proved on simulated steps: a replicated pipeline runs its routes as message passing
(each replica its list, sends asynchronous, in any interleaving), some replicas die at a random moment,
the survivors report their holdings, the plan is applied, and the step runs to its end (possibly losing
more on the way). Each micro-batch then counts once in every stage's gradient, no stage without a loss
recomputed anything, no tensor went to a replica that held it, only lost replicas' micro-batches moved,
and a stage losing every replica rewinds."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arceus.pipeline.schedule import Action, replica_schedule
from arceus.swarm.holdings import NOTHING, Holding, StepHoldings
from arceus.swarm.repair import RepairPlan, ReplicaInstructions, repair_step
from arceus.swarm.routing import Routes

Key = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True)
class Message:
    kind: str  # "input" and "labels" from the driver, "act" downstream, "grad" upstream
    micro_batch: int
    source: Key | None  # None: the driver
    to: Key


class Step:
    """One training step of a replicated pipeline, as processes exchanging messages."""

    def __init__(self, routes: Routes, schedule: str) -> None:
        self.routes, self.schedule = routes, schedule
        self.last = routes.num_stages - 1
        self.alive = {(i, r) for i, ids in enumerate(routes.members) for r in ids}
        self.records: dict[tuple[int, int, int], Holding] = {}
        self.labels: set[tuple[int, int]] = set()  # (replica of the last stage, micro-batch)
        self.in_flight: list[Message] = []
        self.skip_output: dict[Key, set[int]] = {key: set() for key in self.alive}
        self.skip_input_gradient: dict[Key, set[int]] = {key: set() for key in self.alive}
        self.gradient: dict[Key, list[int]] = {key: [] for key in self.alive}  # micro-batches in each partial
        self.forwards: Counter[int] = Counter()  # per stage, lost replicas' included
        self.moved: Counter[int] = Counter()  # per stage: micro-batches taken from lost replicas
        self.lost_stages: set[int] = set()
        self._relist()
        for m, route in enumerate(routes.of):
            self.in_flight.append(Message("input", m, None, (0, route[0])))
            self.in_flight.append(Message("labels", m, None, (self.last, route[self.last])))

    def _relist(self) -> None:
        n, deepest = self.routes.num_stages, max(len(ids) for ids in self.routes.members)
        self.lists = {
            (i, r): replica_schedule(self.schedule, n, i, self.routes.micro_batches_of(i, r), replicas=deepest)
            for i, r in self.alive
        }

    def record(self, i: int, r: int, m: int) -> Holding:
        return self.records.get((i, r, m), NOTHING)

    def mark(self, i: int, r: int, m: int, **changes: bool | int) -> None:
        self.records[(i, r, m)] = replace(self.record(i, r, m), **changes)

    def next_action(self, key: Key) -> Action | None:
        for action in self.lists[key]:
            held = self.records.get((*key, action.micro_batch))
            if not (held and (held.forwarded if action.kind == "F" else held.backwarded)):
                return action
        return None

    def ready(self, key: Key) -> bool:
        action = self.next_action(key)
        if action is None:
            return False
        (i, r), m = key, action.micro_batch
        held = self.record(i, r, m)
        if action.kind == "F":
            return held.input_received and (i < self.last or (r, m) in self.labels)
        return held.forwarded and (i == self.last or held.gradient_received)

    def send(self, kind: str, m: int, source: Key | None, to: Key) -> None:
        if to in self.alive:  # a push to a dead peer fails: nothing reaches it, nothing is recorded
            self.in_flight.append(Message(kind, m, source, to))

    def run(self, key: Key) -> None:
        action = self.next_action(key)
        assert action is not None
        (i, r), m = key, action.micro_batch
        if action.kind == "F":
            self.mark(i, r, m, forwarded=True)
            self.forwards[i] += 1
            if i < self.last and m not in self.skip_output[key]:
                self.send("act", m, key, (i + 1, self.routes.of[m][i + 1]))
        else:
            self.mark(i, r, m, backwarded=True)
            self.gradient[key].append(m)
            if i > 0 and m not in self.skip_input_gradient[key]:
                self.send("grad", m, key, (i - 1, self.routes.of[m][i - 1]))

    def deliver(self, index: int) -> None:
        message = self.in_flight.pop(index)
        (i, r), m = message.to, message.micro_batch
        assert self.routes.of[m][i] == r, f"{message} reached a replica micro-batch {m} is not routed to"
        held = self.record(i, r, m)
        if message.kind == "labels":
            assert (r, m) not in self.labels, f"{message}: labels sent twice"
            self.labels.add((r, m))
            return
        if message.kind in ("input", "act"):
            assert not held.input_received, f"{message}: sent to a replica that already holds it"
            self.mark(i, r, m, input_received=True)
            if message.source:
                self.mark(*message.source, m, output_sent_to=r)
        else:
            assert not held.gradient_received, f"{message}: sent to a replica that already holds it"
            self.mark(i, r, m, gradient_received=True)
            assert message.source
            self.mark(*message.source, m, input_gradient_sent_to=r)

    def events(self) -> list[tuple[str, int | Key]]:
        return [("run", key) for key in sorted(self.alive) if self.ready(key)] + [
            ("deliver", j) for j in range(len(self.in_flight))
        ]

    def advance(self, rng: random.Random, count: int) -> None:
        """Up to `count` events in a random interleaving."""
        for _ in range(count):
            events = self.events()
            if not events:
                return
            kind, what = rng.choice(events)
            self.run(what) if kind == "run" else self.deliver(what)  # type: ignore[arg-type]

    def kill(self, lost: set[Key]) -> None:
        """SIGKILL: what the lost held is gone, what they were sending or being sent never arrives."""
        self.alive -= lost
        self.lost_stages |= {i for i, _ in lost}
        self.in_flight = [
            x for x in self.in_flight if x.to in self.alive and (x.source is None or x.source in self.alive)
        ]
        self.records = {k: v for k, v in self.records.items() if k[:2] in self.alive}
        self.labels = {(r, m) for r, m in self.labels if (self.last, r) in self.alive}
        for key in lost:
            del self.gradient[key]

    def settle(self) -> None:
        """Survivors report once none of their sends is in flight."""
        while self.in_flight:
            self.deliver(0)

    def holdings(self) -> StepHoldings:
        return StepHoldings(self.records)

    def apply(self, plan: RepairPlan) -> None:
        old = self.routes
        self.routes = plan.routes
        assert set(plan.instructions) == self.alive
        for (i, r), todo in plan.instructions.items():
            mine = self.routes.micro_batches_of(i, r)
            assert set(todo.recompute) == {m for m in mine if old.of[m][i] != r}
            self.moved[i] += len(todo.recompute)
            for m in todo.recompute:
                assert (i, r, m) not in self.records, "a replica recomputes what it already holds"
            self.skip_output[(i, r)] = set(todo.skip_output)  # a plan's instructions replace the last one's
            self.skip_input_gradient[(i, r)] = set(todo.skip_input_gradient)
            for m, to in todo.resend_outputs:
                assert self.records[(i, r, m)].forwarded, "re-sending an output it does not hold"
                self.send("act", m, (i, r), (i + 1, to))
            for m, to in todo.resend_input_gradients:
                assert self.records[(i, r, m)].backwarded, "re-sending an input gradient it does not hold"
                self.send("grad", m, (i, r), (i - 1, to))
        for m, r in plan.driver_repush_inputs:
            self.send("input", m, None, (0, r))
        for m, r in plan.driver_repush_labels:
            self.send("labels", m, None, (self.last, r))
        self._relist()


@st.composite
def steps(draw: st.DrawFn) -> tuple[Routes, str]:
    n, m = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    members = tuple(tuple(sorted(draw(st.sets(st.integers(0, 6), min_size=1, max_size=3)))) for _ in range(n))
    routes = Routes(members, tuple(tuple(draw(st.sampled_from(ids)) for ids in members) for _ in range(m)))
    return routes, draw(st.sampled_from(["gpipe", "1f1b"]))


@settings(max_examples=400, deadline=None)
@given(steps(), st.randoms(use_true_random=False), st.integers(1, 3), st.data())
def test_a_repaired_step_ends_as_if_nothing_was_lost(
    case: tuple[Routes, str], rng: random.Random, failures: int, data: st.DataObject
) -> None:
    routes, schedule = case
    step = Step(routes, schedule)
    total_events = 4 * routes.num_micro_batches * routes.num_stages + 2 * routes.num_micro_batches
    epoch = 0
    for _ in range(failures):
        step.advance(rng, rng.randint(0, total_events))
        if len(step.alive) < 2:
            break
        # none lost: a failure between live replicas, resumed by all of them under a new epoch
        lost = set(data.draw(st.sets(st.sampled_from(sorted(step.alive)), min_size=0, max_size=len(step.alive) - 1)))
        step.kill(lost)
        step.advance(rng, rng.randint(0, total_events))  # survivors go on until they stall on the lost
        step.settle()
        before = step.routes
        plan = repair_step(before, lost, step.holdings(), {}, epoch)
        assert plan.epoch == epoch + 1
        epoch = plan.epoch
        dead = tuple(i for i, ids in enumerate(before.members) if all((i, k) in lost for k in ids))
        assert plan.rewind == bool(dead) and plan.rewind_stages == dead  # (e)
        if plan.rewind:
            return
        for m, (old, new) in enumerate(zip(before.of, plan.routes.of, strict=True)):  # (d)
            assert all(a == b or (i, a) in lost for i, (a, b) in enumerate(zip(old, new, strict=True))), m
        for (i, _), todo in plan.instructions.items():  # (b)
            if not any(stage == i for stage, _ in lost):
                assert todo.recompute == ()
            if i not in step.lost_stages:  # skips only for what an earlier repair moved
                assert todo.skip_output == todo.skip_input_gradient == ()
        step.apply(plan)
    step.advance(rng, 10**9)  # to the end: every delivery checked (c) on the way
    assert not step.in_flight
    stuck = {key: step.next_action(key) for key in step.alive if step.next_action(key) is not None}
    assert not stuck, f"deadlock after the repair: {stuck}"
    for i in range(routes.num_stages):  # (a): each micro-batch once in each stage's gradient
        taken = sorted(m for (s, _), ms in step.gradient.items() if s == i for m in ms)
        assert taken == list(range(routes.num_micro_batches)), (i, taken)
        if i not in step.lost_stages:  # (b): an undisturbed stage's counters
            assert step.forwards[i] == routes.num_micro_batches
        assert step.forwards[i] <= routes.num_micro_batches + step.moved[i]


def test_a_middle_replica_lost_after_its_neighbours_used_its_tensors() -> None:
    """Stage 1 replica 1 forwarded and backwarded micro-batch 1 and died: replica 0 recomputes it from the
    activation stage 0 sends again, and sends neither its output (stage 2 used it) nor its input gradient
    (stage 0 holds it); stage 2 sends again the gradient it had sent to the dead replica."""
    routes = Routes(((0,), (0, 1), (0,)), ((0, 0, 0), (0, 1, 0)))
    done = Holding(True, True, None, True, True, None)
    holdings = StepHoldings(
        {
            (0, 0, 0): Holding(True, True, 0, True, True),
            (0, 0, 1): Holding(True, True, 1, True, False),
            (1, 0, 0): Holding(True, True, 0, True, True, 0),
            (2, 0, 0): done,
            (2, 0, 1): Holding(True, True, None, False, True, 1),
        }
    )
    plan = repair_step(routes, {(1, 1)}, holdings, {}, epoch=4)
    assert plan.epoch == 5 and not plan.rewind
    assert plan.routes == Routes(((0,), (0,), (0,)), ((0, 0, 0), (0, 0, 0)))
    recompute = ReplicaInstructions(recompute=(1,), skip_output=(1,), skip_input_gradient=(1,))
    assert plan.instructions[(1, 0)] == recompute
    assert plan.instructions[(2, 0)] == ReplicaInstructions(resend_input_gradients=((1, 0),))
    assert plan.instructions[(0, 0)] == ReplicaInstructions(resend_outputs=((1, 0),))
    assert plan.driver_repush_inputs == plan.driver_repush_labels == ()


def test_only_a_stage_whose_membership_changed_exchanges_again() -> None:
    """Stage 1 lost a replica as its exchange started, after every tensor was sent: stages 0 and 2 lost no member,
    and where every member completed its exchange of the step's epoch, the reduced gradient it holds stands."""
    routes = Routes(((0, 1), (0, 1), (0, 1)), ((0, 0, 0), (1, 1, 1), (0, 0, 0), (1, 1, 1)))
    done = Holding(True, True, None, True, True, None)
    holdings = StepHoldings({(i, r, m): done for i in (0, 2) for m in range(4) for r in (routes.of[m][i],)})
    everyone = {(i, r) for i in range(3) for r in (0, 1)} - {(1, 1)}
    plan = repair_step(routes, {(1, 1)}, holdings, {}, epoch=3, exchanged=everyone)
    assert {key: todo.keep_exchange for key, todo in plan.instructions.items()} == {
        (0, 0): True, (0, 1): True, (1, 0): False, (2, 0): True, (2, 1): True,
    }
    # A member that had not completed it (its exchange was cut short): its whole stage exchanges again.
    plan = repair_step(routes, {(1, 1)}, holdings, {}, epoch=3, exchanged=everyone - {(2, 1)})
    assert [key for key, todo in plan.instructions.items() if todo.keep_exchange] == [(0, 0), (0, 1)]


def test_a_failure_between_live_replicas_resumes_the_step_with_every_member() -> None:
    """Nothing lost (the exchange of stage 1 failed between live replicas): the same routes under a new epoch, nothing
    recomputed or sent again; the stages whose every member completed its exchange keep it, stage 1 exchanges again."""
    routes = Routes(((0, 1), (0, 1), (0, 1)), ((0, 0, 0), (1, 1, 1), (0, 0, 0), (1, 1, 1)))
    done = Holding(True, True, None, True, True, None)
    holdings = StepHoldings({(i, routes.of[m][i], m): done for i in range(3) for m in range(4)})
    exchanged = {(i, r) for i in (0, 2) for r in (0, 1)}
    plan = repair_step(routes, set(), holdings, {}, epoch=6, exchanged=exchanged)
    assert plan.epoch == 7 and not plan.rewind and plan.routes == routes
    assert plan.driver_repush_inputs == plan.driver_repush_labels == ()
    assert plan.instructions == {(i, r): ReplicaInstructions(keep_exchange=i != 1) for i in range(3) for r in (0, 1)}


def test_a_first_and_last_stage_loss_has_the_driver_push_again() -> None:
    routes = Routes(((0, 1), (2, 3)), ((0, 2), (1, 3), (1, 2)))
    plan = repair_step(routes, {(0, 1), (1, 3)}, StepHoldings(), {}, epoch=0)
    assert plan.routes.members == ((0,), (2,))
    assert plan.driver_repush_inputs == ((1, 0), (2, 0))
    assert plan.driver_repush_labels == ((1, 2),)


def test_losing_every_replica_of_a_stage_rewinds() -> None:
    routes = Routes(((0, 1), (0,), (0, 1)), ((0, 0, 0), (1, 0, 1)))
    plan = repair_step(routes, {(1, 0), (2, 0)}, StepHoldings(), {}, epoch=2)
    assert plan.rewind and plan.rewind_stages == (1,) and plan.epoch == 3 and not plan.instructions


def test_bad_repair_inputs_are_named() -> None:
    routes = Routes(((0, 1),), ((0,), (1,)))
    with pytest.raises(ValueError, match="stage 0 replica 7 is lost but is not a member"):
        repair_step(routes, {(0, 7)}, StepHoldings(), {}, 0)
    with pytest.raises(ValueError, match="stage 0 replica 0 reports micro-batch 1, which is not routed to it"):
        repair_step(routes, {(0, 1)}, StepHoldings({(0, 0, 1): Holding(True)}), {}, 0)


def test_instructions_round_trip_and_refuse_bad_json() -> None:
    todo = ReplicaInstructions((1, 4), ((2, 3),), ((0, 1), (5, 2)), (4,), ())
    assert ReplicaInstructions.from_json(todo.to_json()) == todo
    kept = ReplicaInstructions(resend_outputs=((2, 3),), keep_exchange=True)
    assert ReplicaInstructions.from_json(kept.to_json()) == kept and kept.to_json()["keep_exchange"] is True
    assert todo.to_json()["resend_input_gradients"] == [[0, 1], [5, 2]]
    bad = {f.name: [] for f in fields(ReplicaInstructions)} | {"resend_outputs": [[1]]}
    with pytest.raises(ValueError, match=r"repair.resend_outputs\[0\]: must be a \[micro_batch, replica\] pair"):
        ReplicaInstructions.from_json(bad)
