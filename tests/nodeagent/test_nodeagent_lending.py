"""Agents lend each other cores: a stage computes with its solo threads in the actions no other stage
computes alongside, and with its own share in the rest (two in-process agents over loopback), while
borrowing is measured to pay."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.data.loader import load_dataset
from arceus.data.streaming import InMemorySamples
from arceus.training.driver import Batch, Pipeline
from arceus.training.plan import StageEndpoint, TrainPlan
from devtools.pipeline import driver_token, identity_for, pipeline_assignments, remember_identity
from nodeagent.agent import Agent
from nodeagent.lending import KEPT, PROBE_EVERY, ComputeThreads, LendingGauge

MODEL = {"type": "mlp", "layer_sizes": [64, 32, 10]}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES = 4
OWN = torch.get_num_threads()  # what an in-process agent starts with
SOLO = OWN + 1


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started = [Agent(device=torch.device("cpu"), solo_threads=SOLO) for _ in range(2)]
    for agent in started:
        agent.start()
        remember_identity(agent.advertise_address, agent.identity)
    try:
        yield started
    finally:
        for agent in started:
            agent.stop(1)


def record_threads(agent: Agent) -> list[str]:
    """Hooks on the hosted stage's layers that log, from the thread that computes, each training
    forward and backward as "F<threads>" / "B<threads>"."""
    log: list[str] = []
    [stage] = agent.registry.stages()

    def on_forward(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            log.append(f"F{torch.get_num_threads()}")
            output.register_hook(lambda _grad: log.append(f"B{torch.get_num_threads()}"))

    stage.runtime.layers[-1].register_forward_hook(on_forward)  # the stage's output: its forward is done
    return log


def test_solo_actions_compute_with_the_solo_threads(agents: list[Agent]) -> None:
    """GPipe, F0 F1 F2 F3 B3 B2 B1 B0 on both stages: stage 0 is alone in F0 (stage 1 waits for it) and
    B0 (stage 1 is done), stage 1 in F3 and B3 (stage 0 waits for B3's gradient). Stage 0's other forwards
    and stage 1's other backwards always overlap the other stage's. The rest may be alone too, depending
    on what has arrived when they start (stage 1's forwards once stage 0's last activation is in, stage
    0's backwards once stage 1's last gradient is). Checked on a first step: nothing is measured yet, so
    every solo action borrows."""
    stages = pipeline_assignments(
        job_id="lend",
        model_config=MODEL,
        boundaries=[0, 1, 2],
        addresses=[a.advertise_address for a in agents],
        optimizer={"name": "sgd", "lr": 0.05},
        seed=1,
        micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
    )
    for agent, stage in zip(agents, stages, strict=True):
        agent.apply_assignments([Assignment.from_json(stage)])
    logs = [record_threads(a) for a in agents]
    plan = TrainPlan(
        job_id="lend",
        generation=1, credential=driver_token("lend", 1),
        stages=tuple(StageEndpoint(i, a.advertise_address, f"node-{i}", i, i + 1,
            certificate=identity_for(a.advertise_address).certificate) for i, a in enumerate(agents)),
        dataset=DATASET,
        epochs=1,
        learning_rate=0.05,
        micro_batches=MICRO_BATCHES,
        seed=1,
        rpc_timeout_seconds=20.0,
        schedule="gpipe",
        model=MODEL,
    )
    x, y, _, _ = load_dataset(DATASET)
    either = f"(?:{OWN}|{SOLO})"
    expected = [
        f"F{SOLO} F{OWN} F{OWN} F{OWN} B{either} B{either} B{either} B{SOLO}",
        f"F{either} F{either} F{either} F{SOLO} B{SOLO} B{OWN} B{OWN} B{OWN}",
    ]
    with Pipeline(plan) as pipeline:
        pipeline.step(Batch(InMemorySamples(x, y), torch.arange(32)), train=True)
    for log, pattern in zip(logs, expected, strict=True):
        assert re.fullmatch(pattern, " ".join(log)), log


def test_the_owners_cap_bounds_the_solo_threads() -> None:
    agent = Agent(device=torch.device("cpu"), solo_threads=OWN + 2)
    assert agent.threads() == ComputeThreads(own=OWN, solo=OWN + 2)
    agent.limit_threads(OWN + 1)
    assert agent.threads() == ComputeThreads(own=OWN, solo=OWN + 1)
    agent.limit_threads(1)
    assert agent.threads() == ComputeThreads(own=1, solo=1)
    agent.limit_threads(None)
    assert agent.threads() == ComputeThreads(own=OWN, solo=OWN + 2)
    assert Agent(device=torch.device("cpu")).threads() == ComputeThreads(own=OWN, solo=OWN)


def test_solo_threads_below_the_own_share_are_refused() -> None:
    with pytest.raises(ValueError, match="below the agent's"):
        Agent(device=torch.device("cpu"), solo_threads=OWN - 1)


def warm_gauge() -> LendingGauge:
    """A gauge past the first computation with either count, which it leaves out."""
    gauge = LendingGauge()
    for kind in ("F", "B"):
        for lent in (False, True):
            gauge.record(kind, lent=lent, seconds=1.0, samples=1)
    return gauge


def test_borrowing_stops_when_it_does_not_pay_and_is_tried_again() -> None:
    gauge = warm_gauge()
    assert gauge.lend("F")  # nothing measured yet
    gauge.record("F", lent=False, seconds=0.04, samples=4)
    for _ in range(2):
        gauge.record("F", lent=True, seconds=0.02, samples=4)
    assert gauge.pays("F") and gauge.lend("F")
    gauge.record("F", lent=True, seconds=0.12, samples=4)  # one slow action on a busy moment
    assert gauge.pays("F")
    for _ in range(KEPT):  # a busy machine: borrowed threads now take three times as long
        gauge.record("F", lent=True, seconds=0.12, samples=4)
    assert not gauge.pays("F")
    assert gauge.pays("B")  # per kind
    tries = [gauge.lend("F") for _ in range(2 * PROBE_EVERY)]
    assert tries == ([False] * (PROBE_EVERY - 1) + [True]) * 2  # one probe in every PROBE_EVERY chances
    for _ in range(KEPT):  # the probes find it quiet again
        gauge.record("F", lent=True, seconds=0.02, samples=4)
    assert gauge.lend("F")


def test_figures_are_per_sample() -> None:
    """A smaller last micro-batch takes less time without looking faster."""
    gauge = warm_gauge()
    gauge.record("B", lent=False, seconds=0.08, samples=4)
    gauge.record("B", lent=True, seconds=0.03, samples=1)  # 30 ms a sample against 20
    assert not gauge.pays("B")


def test_the_first_computation_with_a_count_is_left_out() -> None:
    gauge = LendingGauge()
    gauge.record("B", lent=True, seconds=5.0, samples=1)  # starting threads, cold caches
    gauge.record("B", lent=True, seconds=0.05, samples=1)
    for _ in range(2):
        gauge.record("B", lent=False, seconds=0.08, samples=1)
    assert gauge.pays("B")  # counted, the 5 s would make borrowing look slower (median 2.5 s against 0.08)
