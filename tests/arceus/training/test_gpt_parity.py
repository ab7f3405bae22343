"""A GPT trained across real agent processes equals single-process training, per step, to fp32 rounding.

Three `python -m nodeagent` processes host 2- and 3-stage pipelines of a small character-level GPT
(embedding | blocks | head), run with GPipe and 1F1B; the reference is plain torch on the same windows of
the same text in the same seeded order. The agents lend each other cores (`--solo-threads 2`), so stages
switch thread counts between actions: the sums that change order with them stay within the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from arceus.contracts.assignment import max_micro_batch_size
from arceus.data.text_config import dataset_tokenizer
from arceus.model.generate import sample_text
from arceus.training.driver import train
from arceus.training.plan import TrainPlan
from arceus.training.recording import RecordingSink
from arceus.training.sampling import sample_through_pipeline
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, pipeline_assignments, stage_endpoints
from devtools.reference import fetch_weights
from tests.arceus.training.reference_jobs import reference_of

pytestmark = pytest.mark.slow

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16}
MICRO_BATCHES = 4
SEED = 11
# An epoch is 337 windows: 21 steps of 16 and one of 1 (a single micro-batch), so STEPS crosses an epoch
# end (validation, reshuffle).
STEPS = 24
ADAM = {"name": "adam", "lr": 3e-3, "weight_decay": 0.0}
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 1e-4}
RUNS: dict[str, dict[str, Any]] = {
    "gpt-2-gpipe": {"boundaries": [0, 2, 4], "schedule": "gpipe", "optimizer": ADAM},
    "gpt-2-1f1b": {"boundaries": [0, 2, 4], "schedule": "1f1b", "optimizer": SGD},
    "gpt-3-gpipe": {"boundaries": [0, 1, 3, 4], "schedule": "gpipe", "optimizer": SGD},
    "gpt-3-1f1b": {"boundaries": [0, 1, 3, 4], "schedule": "1f1b", "optimizer": ADAM},
    # The LM head is the token embedding (tie_word_embeddings): stages 0 and 2 hold a copy each and sum their
    # gradients every step, as one process's one parameter gets both.
    "gpt-3-tied": {"boundaries": [0, 1, 3, 4], "schedule": "1f1b", "optimizer": ADAM, "tied": True},
}


def run_model(model: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return {**model, "tie_word_embeddings": True} if run.get("tied") else model


@pytest.fixture(scope="module")
def configs(small_text) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and dataset configs as job submission completes them (vocab_size, block_size)."""
    return small_text(MODEL)


@pytest.fixture(scope="module")
def agents(
    configs: tuple[dict[str, Any], dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[AgentProcess]]:
    model, dataset = configs
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    per_agent: list[list[dict[str, Any]]] = [[], [], []]
    for job_id, run in RUNS.items():
        num_stages = len(run["boundaries"]) - 1
        stages = pipeline_assignments(
            job_id=job_id,
            model_config=run_model(model, run),
            boundaries=run["boundaries"],
            addresses=addresses[:num_stages],
            optimizer=run["optimizer"],
            seed=SEED,
            micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(dataset, MICRO_BATCHES),
        )
        for i, stage in enumerate(stages):
            per_agent[i].append(stage)
    started = spawn_static_agents(per_agent, addresses, tmp_path_factory.mktemp("gpt-agents"), solo_threads=2)
    try:
        yield started
    finally:
        stop_agents(started)


@pytest.mark.parametrize("job_id", list(RUNS))
def test_gpt_pipeline_training_matches_single_process(
    configs: tuple[dict[str, Any], dict[str, Any]], agents: list[AgentProcess], job_id: str
) -> None:
    model, dataset = configs
    run = RUNS[job_id]
    model = run_model(model, run)
    boundaries = run["boundaries"]
    plan = TrainPlan(
        job_id=job_id,
        generation=1, credential=driver_token(job_id, 1),
        stages=stage_endpoints([a.grpc_address for a in agents[: len(boundaries) - 1]], boundaries),
        dataset=dataset,
        epochs=3,
        learning_rate=run["optimizer"]["lr"],
        micro_batches=MICRO_BATCHES,
        seed=SEED,
        rpc_timeout_seconds=30.0,
        max_steps=STEPS,
        schedule=run["schedule"],
    )
    recorder = RecordingSink()
    result = train(plan, recorder)
    optimizer = run["optimizer"]
    expected = reference_of(model, dataset, optimizer, epochs=3, seed=SEED, max_steps=STEPS)

    assert result.steps == STEPS and not result.stopped
    assert [p.epoch for p in recorder.steps] == [1] * 22 + [2] * 2
    assert [r.epoch for r in recorder.epochs] == [1, 2]  # validation loss after every epoch
    assert all(math.isfinite(r.val_loss) and 0 <= r.val_accuracy <= 1 for r in recorder.epochs)
    losses = [p.loss for p in recorder.steps]
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: pipeline loss {got!r} != reference {want!r}"
    # A per-token mean: it starts near ln(vocab) and the model learns.
    assert math.isclose(losses[0], math.log(model["vocab_size"]), rel_tol=0.05)
    assert losses[-1] < losses[0] - 0.3
    assert math.isclose(result.val_loss, expected.val_loss, rel_tol=1e-5)
    assert math.isclose(result.val_accuracy, expected.val_accuracy, rel_tol=1e-5)

    # Adam turns the rounding noise of a gradient that is zero in exact arithmetic (the attention key
    # bias: softmax ignores a per-query constant) into lr-sized steps, so its weights get an absolute slack.
    atol = 1e-4 if optimizer["name"] == "adam" else 1e-6
    weights = fetch_weights(plan)
    assert sorted(weights) == sorted(expected.weights)
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    if run.get("tied"):  # the two stages' copies stepped with the same bits
        assert torch.equal(weights["layers.0.wte.weight"], weights["layers.3.lm_head.weight"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_text_sampled_through_the_agents_is_what_one_process_samples_from_their_weights(
    configs: tuple[dict[str, Any], dict[str, Any]], agents: list[AgentProcess], temperature: float
) -> None:
    model, dataset = configs
    boundaries = RUNS["gpt-3-1f1b"]["boundaries"]
    stages = stage_endpoints([a.grpc_address for a in agents], boundaries)
    token = driver_token("gpt-3-1f1b", 1)
    plan = TrainPlan(job_id="gpt-3-1f1b", generation=1, credential=token, stages=stages, dataset=dataset, epochs=1,
                     learning_rate=0.1, micro_batches=MICRO_BATCHES, seed=SEED)
    tokenizer = dataset_tokenizer(dataset)
    # Longer than the window (16): the window slides and every stage's cache starts again.
    options = {"prompt": "In the", "length": 40, "temperature": temperature, "seed": 5}
    sampled = sample_through_pipeline(
        stages, job_id="gpt-3-1f1b", generation=1, credential=token, model_config=model, tokenizer=tokenizer,
        timeout=30.0, **options
    )
    assert sampled.startswith("In the") and len(tokenizer.encode(sampled)) == len(tokenizer.encode("In the")) + 40
    assert sampled == sample_text(model, fetch_weights(plan), tokenizer, **options)
