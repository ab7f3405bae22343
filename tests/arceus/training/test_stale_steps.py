"""Staleness 1 (PipeDream-2BW): chained train steps overlap on each stage, every step's forwards and backwards use the
weights before the previous step's update (steps not chained too: around a checkpoint), and the pipeline equals its
one-process reference with the same rule to 1e-5 (not the synchronous one: that shows the rule is exactly 2BW)."""

from __future__ import annotations

import math
import time

import torch

from arceus.contracts.assignment import Assignment, max_micro_batch_size
from arceus.data.config import validate_dataset_config
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity, stage_endpoints
from devtools.reference import fetch_weights, reference_run
from nodeagent.agent import Agent
from nodeagent.runtime import StageRuntime

JOB = "stale-driver"
MODEL, OPTIMIZER = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32})
MICRO_BATCHES, STEPS = 4, 8


def reference(staleness: int):  # noqa: ANN201 - devtools.reference.ReferenceRun
    return reference_run({
        "model_config": MODEL, "dataset_config": DATASET, "epochs": 1, "learning_rate": OPTIMIZER["lr"],
        "optimizer": OPTIMIZER["name"], "momentum": OPTIMIZER["momentum"], "seed": 0, "staleness": staleness,
    }, max_steps=STEPS)


def gradient_steps(runtime: StageRuntime) -> int:
    """How many steps' gradients the stage holds: the one its update reads (on the weights) and those of open steps'
    weights versions."""
    on_weights = any(p.grad is not None for p in runtime.layers.parameters())
    return on_weights + sum(any(t.grad is not None for t in v) for v in runtime._versions.values())


def test_a_stale_pipeline_equals_its_one_process_reference_with_the_same_rule(agent: Agent) -> None:
    """... and no stage ever holds two steps' gradients: a chained step's first backward waits for the update of the
    step it overlaps (the memory model counts one gradient set beside the two weights versions)."""
    remember_identity(agent.advertise_address, agent.identity)
    addresses, boundaries = [agent.advertise_address] * 3, [0, 1, 2, 3]
    agent.apply_assignments([Assignment.from_json(a) for a in pipeline_assignments(
        job_id=JOB, model_config=MODEL, boundaries=boundaries, addresses=addresses, optimizer=OPTIMIZER, seed=0,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
        staleness=1,
    )])
    plan = TrainPlan(
        job_id=JOB, generation=1, credential=driver_token(JOB), stages=stage_endpoints(addresses, boundaries),
        dataset=DATASET, epochs=1, learning_rate=OPTIMIZER["lr"], micro_batches=MICRO_BATCHES, seed=0,
        max_steps=STEPS, schedule="1f1b", checkpoint_interval=3, rpc_timeout_seconds=30.0, staleness=1,
    )
    most: list[int] = []
    for hosted in agent.registry.stages():
        runtime, backward, update = hosted.runtime, hosted.runtime.backward, hosted.runtime.optimizer_step

        def counted(key, grad_output=None, runtime=runtime, backward=backward):  # noqa: ANN001, ANN202
            most.append(gradient_steps(runtime))
            return backward(key, grad_output)

        def late(learning_rate=None, update=update):  # noqa: ANN001, ANN202
            time.sleep(0.2)  # an update that comes late (a slow ack, a busy core): the next step's backward waits
            return update(learning_rate)

        runtime.backward, runtime.optimizer_step = counted, late  # type: ignore[method-assign]
    sink = RecordingSink()
    assert train(plan, sink).steps == STEPS
    assert most and max(most) == 1, f"a stage held {max(most)} steps' gradients at a backward"
    stale, synchronous = reference(1), reference(0)
    losses = [p.loss for p in sink.steps]
    for step, (got, want) in enumerate(zip(losses, stale.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: stale loss {got!r} != its reference's {want!r}"
    # Step 1 is synchronous training's; step 2 uses the initial weights again, and from there on staleness 1 differs.
    assert math.isclose(losses[0], synchronous.losses[0], rel_tol=1e-5)
    assert all(not math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses[1:], synchronous.losses[1:], strict=True))
    weights = fetch_weights(plan)
    for name, want in stale.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
