"""A replica lost mid-step costs no work (arceus/swarm/repair.py wired into the driver and the agents).

Six agents in this process host an MLP in 3 stages x 2 replicas. In one step one replica's agent stops serving
at a chosen point of its step (after a forward, before its next backward, as its exchange starts), and the step it
was in raises right there, so nothing more leaves it. The survivors report what they hold, the driver plans the
repair, and the step completes under the same id: only the lost replica's micro-batches are recomputed, by the
survivor of its stage, from the boundary tensors its neighbours kept; no other stage computes anything twice, nothing
runs again and nothing rewinds. Losses and every surviving replica's final weights equal plain torch on the same
batches to fp32 rounding. A repaired step is spot-checked like any other, the survivors' work before the loss included:
a survivor that falsifies what it recomputes, forward or gradient, is caught (the latter with 3 replicas of the last
stage, so that two survivors exchange).
"""

from __future__ import annotations

import logging
import math
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training import audit
from arceus.training.driver import train
from arceus.training.plan import StepProgress, TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, replica_endpoints
from devtools.reference import ReferenceRun, reference_run
from nodeagent.agent import Agent
from nodeagent.stage import HostedStage
from tests.arceus.training.replicated_agents import agents_hosting
from tests.nodeagent.dishonest_forward import make_dishonest

MLP = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}
BOUNDARIES = [0, 1, 2, 3]
DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
MICRO_BATCHES, SEED, STEPS = 4, 5, 4
Key = tuple[int, int]  # (stage, replica)
# Bytes a replica of each stage receives per micro-batch of 8 samples: its input (float32: the widths 32 and 16; the
# first stage reads its own) and the gradient of its output (float32; the last stage reads its own labels).
SAMPLES = DIGITS["batch_size"] // MICRO_BATCHES
RECEIVED_PER_MICRO_BATCH = {0: SAMPLES * 32 * 4, 1: SAMPLES * (32 + 16) * 4, 2: SAMPLES * 16 * 4}
SENT_PER_MICRO_BATCH = {0: SAMPLES * 32 * 4, 1: SAMPLES * (16 + 32) * 4, 2: SAMPLES * 16 * 4}  # output, input gradient


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[dict[Key, Agent]]:
    """One agent per replica of each stage (2 each), in this process; an indirect parameter may set the job's
    `replica_sync` and the stages' `replicas`."""
    options = getattr(request, "param", {})
    counts = options.get("replicas", (2, 2, 2))
    placement = [list(range(sum(counts[:i]), sum(counts[: i + 1]))) for i in range(len(counts))]
    with agents_hosting(
        placement, job_id="repaired", model_config=MLP, boundaries=BOUNDARIES, optimizer=SGD, seed=SEED,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DIGITS, MICRO_BATCHES),
        replica_sync=options.get("replica_sync"),
    ) as started:
        yield {(i, r): started[a] for i, hosts in enumerate(placement) for r, a in enumerate(hosts)}


def hosted(agent: Agent) -> HostedStage:
    (stage,) = agent.registry.stages()
    return stage


class Killer:
    """Stops the victim's agent (it refuses every connection from then on) the `nth` time its stage calls the
    runtime's `method` in step `step`, and fails that call, so the victim does and sends nothing more: what a SIGKILL
    at that point leaves."""

    def __init__(self, agents: dict[Key, Agent], victim: Key, method: str, nth: int, step: int) -> None:
        self.victim, self.step, self.armed, self.calls = victim, step, step == 1, 0
        self.killed = threading.Event()
        self.counters = {key: hosted(agent).runtime.counters for key, agent in agents.items()}
        self.stopping = threading.Thread(target=agents[victim].stop, args=(0,), daemon=True)
        runtime = hosted(agents[victim]).runtime
        real: Callable[..., Any] = getattr(runtime, method)
        address = agents[victim].grpc_address

        def watched(*args: Any, **kwargs: Any) -> Any:
            if self.armed and not self.killed.is_set():
                self.calls += 1
                if self.calls == nth:
                    self.killed.set()
                    self.stopping.start()
                    refusing(address)
                    raise RuntimeError(f"stage {victim[0]} replica {victim[1]} was killed in its {method}")
            return real(*args, **kwargs)

        setattr(runtime, method, watched)  # the real method, with the kill in front of its nth call

    def computed(self) -> dict[Key, int]:
        """Micro-batches each replica's runtime has run forward, in training and evaluation."""
        return {key: counters.micro_batches for key, counters in self.counters.items()}

    def compute_seconds(self) -> dict[Key, float]:
        """Seconds each replica's runtime has computed (what its agent reports)."""
        return {key: counters.compute_seconds for key, counters in self.counters.items()}


def assert_losses_of_one_process(sink: Any) -> ReferenceRun:
    """Every step's loss `sink` saw is one process's on the same batches (to 1e-5); returns that reference run."""
    expected = reference_run(
        {"model_config": MLP, "dataset_config": DIGITS, "epochs": 1, "learning_rate": SGD["lr"], "optimizer": "sgd",
         "momentum": SGD["momentum"], "weight_decay": SGD["weight_decay"], "seed": SEED},
        max_steps=STEPS,
    )
    for step, (got, want) in enumerate(zip([p.loss for p in sink.steps], expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: loss {got!r} != reference {want!r}"
    return expected


def refusing(address: str, timeout: float = 30.0) -> None:
    """Wait until nothing listens at `address` any more."""
    host, port = address.rsplit(":", 1)
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.005)
    raise AssertionError(f"{address} still accepts connections {timeout} s after its agent was stopped")


class Sink(RecordingSink):
    """Records, after every step, the micro-batches each replica has computed and the tensor bytes each live one
    has received (activations, gradients)."""

    def __init__(self, killer: Killer, agents: dict[Key, Agent]) -> None:
        super().__init__()
        self.killer, self.agents = killer, agents
        self.computed = [killer.computed()]
        self.compute_seconds = [killer.compute_seconds()]
        self.received = [self._received()]

    def _received(self) -> dict[Key, int]:
        return {key: hosted(agent).bytes_received for key, agent in self.agents.items() if agent.registry.stages()}

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.computed.append(self.killer.computed())
        self.compute_seconds.append(self.killer.compute_seconds())
        self.received.append(self._received())
        if p.step == self.killer.step - 1:
            self.killer.armed = True


def plan_of(agents: dict[Key, Agent]) -> TrainPlan:
    addresses = [[agents[(i, r)].advertise_address for r in range(len([k for k in agents if k[0] == i]))]
                 for i in range(3)]
    stages, replicas = replica_endpoints(addresses, BOUNDARIES)
    return TrainPlan(
        job_id="repaired", generation=1, credential=driver_token("repaired", 1), stages=stages, replicas=replicas,
        dataset=DIGITS, epochs=1, learning_rate=SGD["lr"], micro_batches=MICRO_BATCHES, seed=SEED,
        rpc_timeout_seconds=30.0, max_steps=STEPS,
    )


def audited_plan(agents: dict[Key, Agent], **overrides: Any) -> TrainPlan:
    """`plan_of`'s, every train step audited: each replica with its agent's receipt key."""
    keys = {key: agent.signer.public_key_hex for key, agent in agents.items()}
    plan = plan_of(agents)
    return replace(
        plan, audit_rate=1.0, model=MLP,
        stages=tuple(replace(e, public_key=keys[(e.index, e.replica)]) for e in plan.stages),
        replicas=tuple(replace(e, public_key=keys[(e.index, e.replica)]) for e in plan.replicas), **overrides,
    )


class Last(random.Random):
    """The auditor's draws, aimed: every step is audited, and each pick is the last there is (the last boundary's
    forward of the last micro-batch, the partial gradient of the last replicated stage's replica that took it)."""

    def random(self) -> float:
        return 0.0

    def randrange(self, stop: int, *_: Any, **__: Any) -> int:  # type: ignore[override]
        return stop - 1

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[-1]


@pytest.fixture
def aimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit.random, "SystemRandom", Last)


# Step 1's routes give each replica 2 of the 4 micro-batches (no speed is known yet); later ones follow the measured
# speeds, so a kill at a replica's second call is made in step 1.
@pytest.mark.parametrize(
    ("victim", "method", "nth", "killed_in"),
    [
        ((1, 1), "forward", 1, 2),  # mid-forward: as its first forward of the step starts
        ((1, 1), "backward", 2, 1),  # its first input gradient sent upstream, before its second backward
        ((1, 1), "gradient_vector", 1, 2),  # every tensor sent, as its gradient exchange starts
        ((0, 1), "forward", 2, 1),  # the first stage: its survivor reads the lost replica's inputs
        ((2, 1), "backward", 1, 2),  # the last stage: its survivor reads the lost replica's labels
    ],
    ids=["middle-forward", "middle-backward", "middle-exchange", "first-forward", "last-backward"],
)
def test_a_replica_lost_mid_step_costs_only_its_own_micro_batches_and_the_step_ends_as_undisturbed(
    agents: dict[Key, Agent], victim: Key, method: str, nth: int, killed_in: int, caplog: pytest.LogCaptureFixture
) -> None:
    killer = Killer(agents, victim, method, nth, killed_in)
    sink = Sink(killer, agents)
    caplog.set_level(logging.INFO, logger="arceus.training.driver")
    result = train(plan_of(agents), sink)

    assert killer.killed.is_set()
    assert result.steps == STEPS and [p.step for p in sink.steps] == list(range(1, STEPS + 1))
    assert not sink.checkpoints.keys() - {STEPS}  # none but the final one: nothing was loaded
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"in step {killed_in} " in m and "the survivors repair it" in m for m in messages), messages
    assert not any("running it again" in m for m in messages), messages

    expected = assert_losses_of_one_process(sink)
    for key, agent in agents.items():
        if key == victim:
            continue
        stage = hosted(agent)
        stage.hold_between_steps(10.0)  # the last step's deferred update applied
        try:
            weights = stage.runtime.named_weights()
        finally:
            stage.step_lock.release()
        for name, got in weights.items():
            torch.testing.assert_close(got, expected.weights[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, k=key: f"replica {k} {n}: {m}")

    # Each step, every live replica computed exactly the micro-batches its route gave it (what the driver counted
    # for it), and each stage's live replicas computed each micro-batch once: in the repaired step too, where the
    # lost stage's survivor took the lost replica's share on top of its own and no other stage recomputed anything.
    counted_before: dict[Key, int] = {}
    for step, (p, before, after) in enumerate(zip(sink.steps, sink.computed, sink.computed[1:], strict=False), 1):
        counted_now = {(c.index, int(c.node_id.rsplit("-", 1)[1])): c.micro_batches for c in p.stages}
        counted = {key: n - counted_before.get(key, 0) for key, n in counted_now.items()}  # the driver's, this step
        counted_before = counted_now
        live = {key for key in agents if key != victim or step < killed_in}
        ran = {key: after[key] - before[key] for key in live}
        for stage in range(3):
            assert sum(n for (i, _), n in ran.items() if i == stage) == MICRO_BATCHES, (step, stage, ran)
        assert ran == counted, (step, ran, counted)
        # Nothing was sent twice: each replica received, once, the input and the gradient (or labels) of each
        # micro-batch it ran, whatever it had received before the loss and whatever was sent again after it. Only
        # what the dying replica itself had on its way may land after the survivors reported (as after a SIGKILL):
        # a copy of what the repair sent, never used twice.
        got = {key: sink.received[step][key] - sink.received[step - 1][key] for key in live}
        expected = {key: n * RECEIVED_PER_MICRO_BATCH[key[0]] for key, n in ran.items()}
        if step != killed_in:
            assert got == expected, (step, got, expected)
            continue
        surplus = {key: got[key] - expected[key] for key in live}
        victim_forwards = sink.computed[step][victim] - sink.computed[step - 1][victim]
        assert all(v >= 0 for v in surplus.values()), (step, got, expected)
        assert sum(surplus.values()) <= victim_forwards * SENT_PER_MICRO_BATCH[victim[0]], (step, got, expected)
    lost_share = sink.computed[killed_in][victim] - sink.computed[killed_in - 1][victim]
    assert lost_share < MICRO_BATCHES  # the victim's own work before the kill, lost with it


def test_a_repaired_step_credits_each_survivor_all_the_compute_it_did_in_it(agents: dict[Key, Agent]) -> None:
    # The middle stage's survivor is slow (each forward takes 0.25 s more): before the loss it computed its own share,
    # and in the repair the lost replica's; the driver credits both, as its agent counted them, and every other
    # replica's compute too (each step's within the wall time the driver measured since the step's first attempt).
    runtime = hosted(agents[(1, 0)]).runtime
    real_forward = runtime._train_forward

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.25)
        return real_forward(*args, **kwargs)

    runtime._train_forward = slow_forward
    victim = (1, 1)
    killer = Killer(agents, victim, "gradient_vector", 1, 2)
    sink = Sink(killer, agents)
    train(plan_of(agents), sink)
    assert killer.killed.is_set()

    credited_before: dict[Key, float] = {}
    for step, (p, before, after) in enumerate(
        zip(sink.steps, sink.compute_seconds, sink.compute_seconds[1:], strict=False), 1
    ):
        credited_now = {(c.index, int(c.node_id.rsplit("-", 1)[1])): c.compute_seconds for c in p.stages}
        credited = {key: s - credited_before.get(key, 0.0) for key, s in credited_now.items()}
        credited_before = credited_now
        did = {key: after[key] - before[key] for key in agents if key != victim or step < 2}
        assert credited.keys() == did.keys(), step
        for key, seconds in did.items():
            assert math.isclose(credited[key], seconds, rel_tol=1e-9, abs_tol=1e-9), (step, key, credited, did)
    repaired = sink.compute_seconds[2][(1, 0)] - sink.compute_seconds[1][(1, 0)]
    assert repaired >= MICRO_BATCHES * 0.25  # the forwards of its own share and of the lost replica's: all 4


@pytest.mark.parametrize("cheat", [False, True], ids=["honest", "perturbed-recompute"])
def test_a_repaired_step_is_spot_checked_like_any_other_and_a_perturbed_recompute_is_caught(
    agents: dict[Key, Agent], aimed: None, cheat: bool
) -> None:
    # The middle stage's replica 1 is lost at its first forward of step 1, so its survivor recomputes its share (2 of
    # the 4 micro-batches: 1 and 3) in the repair. The repaired step is audited like any: every survivor's receipts
    # cover all it did in the step (a reply lacking those of its work before the loss fails), the last boundary's
    # forward of micro-batch 3 (the survivor's, recomputed) is recomputed on another node, and the partial gradient
    # of the last stage's replica that took micro-batch 3 by its sibling. A survivor that perturbs what it recomputes
    # (honest before the loss) is caught and named.
    victim, survivor = (1, 1), (1, 0)
    killer = Killer(agents, victim, "forward", 1, 1)

    def perturbed(out: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        return out + 0.01 if cheat and killer.killed.is_set() else out

    make_dishonest(hosted(agents[survivor]).runtime, perturbed)
    sink = Sink(killer, agents)
    train(audited_plan(agents, max_steps=1), sink)
    assert killer.killed.is_set()

    [forward] = [c for c in sink.steps[0].spot_checks if c.producer_index is not None]
    assert (forward.stage_index, forward.replica, forward.node_id, forward.micro_batch) == (1, 0, "agent-1-0", 3)
    assert forward.verifier_node_id not in ("agent-1-0", "agent-1-1")
    assert forward.passed is not cheat, forward.detail
    assert ("differs from the recomputation" if cheat else "matches the recomputation") in forward.detail
    [partial] = [c for c in sink.steps[0].spot_checks if c.producer_index is None]
    assert (partial.stage_index, partial.replica, partial.node_id) == (2, 1, "agent-2-1"), partial
    assert partial.passed and "partial gradient of micro-batches [1, 3] matches" in partial.detail, partial.detail


@pytest.mark.parametrize("agents", [{"replicas": (2, 2, 3)}], indirect=True)
@pytest.mark.parametrize("cheat", [False, True], ids=["honest", "dishonest-recomputed-gradient"])
def test_a_survivor_that_falsifies_the_gradient_of_what_it_recomputes_is_caught_by_a_sibling(
    agents: dict[Key, Agent], aimed: None, cheat: bool
) -> None:
    # The last stage has 3 replicas: replica 0 (micro-batches 0 and 3 of step 1) is lost at its first forward, and
    # the repair gives micro-batch 0 to replica 1, 3 to replica 2, each computing it anew beside its own (1, 2). The
    # survivors exchange their partials; replica 2 adds to the gradient of the micro-batch it recomputes (its forward,
    # its own micro-batch and all it signs are consistent with it): the repaired step's partial gradient check, by its
    # sibling replica 1 from the inputs and labels it signed for, catches it and names it.
    killer = Killer(agents, (2, 0), "forward_loss", 1, 1)
    runtime = hosted(agents[(2, 2)]).runtime
    honest_backward = runtime.backward

    def backward(key: tuple[int, int], grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        grad_input = honest_backward(key, grad_output)
        if cheat and killer.killed.is_set() and key[1] == 3:
            next(runtime.layers.parameters()).grad.add_(1e-3)
        return grad_input

    runtime.backward = backward  # on the instance (as make_dishonest does: no monkeypatch holding the runtime)
    sink = Sink(killer, agents)
    train(audited_plan(agents, max_steps=1), sink)
    assert killer.killed.is_set()

    checks = sink.steps[0].spot_checks
    assert all(c.passed for c in checks if c.producer_index is not None), [c.detail for c in checks]
    [partial] = [c for c in checks if c.producer_index is None]
    assert (partial.stage_index, partial.replica, partial.node_id) == (2, 2, "agent-2-2"), partial
    assert partial.verifier_node_id == "agent-2-1"
    assert "partial gradient of micro-batches [2, 3]" in partial.detail, partial.detail
    assert partial.passed is not cheat, partial.detail
    if cheat:
        assert "differs from the recomputation by sibling replica 1" in partial.detail
        assert partial.max_abs_diff >= 1e-3 * 0.99
    else:
        assert partial.max_abs_diff <= 1e-6


@pytest.mark.parametrize("agents", [{"replica_sync": {"every_steps": 2}}], indirect=True)
def test_replicas_that_sync_every_few_steps_run_the_step_again_without_the_lost_one_saying_why(
    agents: dict[Key, Agent], caplog: pytest.LogCaptureFixture
) -> None:
    # What a replica trained alone since the last sync is gone with it: no repair brings it back, so the step runs
    # again on the others under a new call id, as before repairs existed (no rewind either).
    killer = Killer(agents, (1, 1), "backward", 1, 2)
    sink = Sink(killer, agents)
    result = train(plan_of(agents), sink)
    assert killer.killed.is_set()
    assert result.steps == STEPS and [p.step for p in sink.steps] == list(range(1, STEPS + 1))
    messages = [r.getMessage() for r in caplog.records if r.name == "arceus.training.driver"]
    assert any("in step 2 " in m and "running it again without them" in m and "syncs with its siblings every few "
               "steps" in m for m in messages), messages
    assert not any("the survivors repair it" in m for m in messages), messages


def test_a_repaired_step_exchanges_again_only_in_the_stage_that_lost_a_replica(
    agents: dict[Key, Agent], caplog: pytest.LogCaptureFixture
) -> None:
    # The middle stage's replica 1 is lost as its exchange starts (every tensor sent), once the other stages completed
    # theirs: their members are all alive and summed the same partials, so their reduced gradients stand and they
    # exchange nothing again; the middle stage's survivor, alone now, has nothing to exchange with.
    victim = (1, 1)
    killer = Killer(agents, victim, "gradient_vector", 1, 2)
    started: Counter[tuple[Key, int]] = Counter()
    completed: Counter[tuple[Key, int]] = Counter()
    others = {key for key in agents if key[0] != victim[0]}
    finished_armed: set[Key] = set()
    settled, lock = threading.Event(), threading.Lock()
    for key, agent in agents.items():
        exchange = hosted(agent).exchange

        def counted(flat: torch.Tensor, *, step: int, key: Key = key, real: Any = exchange.exchange,
                    **kwargs: Any) -> torch.Tensor:
            with lock:
                started[(key, step)] += 1
            reduced = real(flat, step=step, **kwargs)
            with lock:
                completed[(key, step)] += 1
                if killer.armed:
                    finished_armed.add(key)
                    if others <= finished_armed:
                        settled.set()
            return reduced

        exchange.exchange = counted
    runtime = hosted(agents[victim]).runtime
    kill = runtime.gradient_vector  # the Killer's

    def after_the_others(*args: Any, **kwargs: Any) -> Any:
        if killer.armed and not killer.killed.is_set() and not settled.wait(30.0):
            raise AssertionError("the other stages did not complete their exchanges of the step")
        return kill(*args, **kwargs)

    runtime.gradient_vector = after_the_others
    sink = Sink(killer, agents)
    caplog.set_level(logging.INFO, logger="arceus.training.driver")
    train(plan_of(agents), sink)

    assert killer.killed.is_set()
    messages = [r.getMessage() for r in caplog.records]
    assert any("in step 2 " in m and "the survivors repair it" in m for m in messages), messages
    assert {step for _, step in started} == set(range(1, STEPS + 1))  # no step ran again under a new id
    for step in range(1, STEPS + 1):
        for key in others:  # once per step, the repaired one too
            assert (started[(key, step)], completed[(key, step)]) == (1, 1), (step, key, started, completed)
    assert (started[((1, 0), 2)], completed[((1, 0), 2)]) == (1, 0)  # cut short by the loss, never redone alone
    assert_losses_of_one_process(sink)
