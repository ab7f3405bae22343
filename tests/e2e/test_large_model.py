"""A GPT too large for the 256 MiB a gRPC message may carry per stage, trained over REST by real processes.

Every stage holds more than 256 MiB of training state (weights and Adam's two moments). The job checkpoints
(each agent uploads its own stage's state to the control plane), one stage's agent is killed with SIGKILL,
the spare takes the stage over from the last checkpoint, the resumed losses equal an uninterrupted
single-process run's, text is sampled through the agents while the job runs, and the downloaded model is the
uninterrupted run's. Then the owner serves the finished job: its stages are placed again, for inference, on the
live agents (weights only, no training state), its greedy text through them is the one process's from the
downloaded weights, and stopping releases the nodes. Every agent's peak memory (VmHWM, the killed one's read
just before the kill) is what the memory model predicts: what the agent held at registration plus its stage's
`stage_memory`, within PEAK_TOLERANCE (REBUILT_TOLERANCE for a stage built from the checkpoint).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from arceus.data.config import validate_dataset_config
from arceus.data.text_config import BUNDLED_TEXT, dataset_tokenizer
from arceus.model.expected_state import optimizer_kind
from arceus.model.generate import sample_text
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config
from arceus.placement.profiles import layer_profiles
from arceus.placement.solver import Workload, stage_memory
from arceus.sdk import ApiError
from devtools.cluster import LocalCluster
from devtools.cluster import stage_placement as placement
from devtools.reference import reference_run
from devtools.supervisor import peak_rss

pytestmark = pytest.mark.slow

# 8 blocks of d_model 768 (7.1M parameters each): two stages of about 28M parameters, 340 MB of training state.
MODEL = {"type": "transformer", "n_layer": 8, "n_head": 12, "d_model": 768, "block_size": 32}
CHECKPOINT_EVERY = 5
FAULT_AFTER_STEP = CHECKPOINT_EVERY + 1
STAGE_STATE_FLOOR = 256 * 2**20
ENDED = ("failed", "cancelled", "succeeded")  # waiting for a step of the run: an ended job will not reach it
# The memory model against an agent's measured peak: the goal, for the agent that built its stage once, from
# the seed (the killed one). The model leaves out the kernels of shapes the agent's warm-up did not run
# (bench/stage_peak_memory.py; docs/BENCHMARKS.md). The agents
# that built their stage from the checkpoint (the spare, and stage 0's after the rewind) peaked 90-180 MiB higher
# in two runs, which the model does not explain yet (loading copies each tensor beside its read buffer, and a
# rebuilt stage lands in the heap its old one left): they get REBUILT_TOLERANCE, above the 17% measured.
PEAK_TOLERANCE = 0.15
REBUILT_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def job_body(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    source = tmp_path_factory.mktemp("large-text") / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return {
        "name": "large-gpt",
        "model_config": MODEL,
        "dataset_config": {"name": "text", "source": str(source), "batch_size": 8, "val_batch_size": 16},
        "epochs": 1,  # 11 steps: checkpoints at 5 and 10, the kill after 6
        "learning_rate": 3e-4,
        "optimizer": "adam",
        "micro_batches": 2,
        "seed": 7,
        "stages": 2,
        "checkpoint_interval_steps": CHECKPOINT_EVERY,
        "audit_rate": 0.0,
        "requirements": {"owner_diversity": False},  # every agent here is one owner's
    }


@pytest.fixture(scope="module")
def reference(job_body: dict[str, Any]) -> Any:
    """The same job trained in this process without interruption (its configs completed as submission does)."""
    dataset = validate_dataset_config(job_body["dataset_config"])
    _, model, dataset = fit_model_to_dataset(job_body["model_config"], dataset)
    return reference_run({**job_body, "model_config": model, "dataset_config": dataset})


def test_a_large_gpt_checkpoints_survives_a_killed_agent_samples_and_downloads(
    cluster: LocalCluster, job_body: dict[str, Any], reference: Any, tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    # Declared equal speeds: measured ones differ on a shared machine, and the solver would split by them.
    agents = cluster.start_agents(["large-0", "large-1", "large-2"], "--declare-flops", "2e10")
    client = cluster.client
    source = cluster.add_data_file(Path(job_body["dataset_config"]["source"]))
    job = client.submit_job({**job_body, "dataset_config": {**job_body["dataset_config"], "source": source}})
    client.start_job(job["id"])

    checkpointed = cluster.wait_for_job(
        job["id"], lambda d: d["step"] >= FAULT_AFTER_STEP and d["checkpoints"], 600, give_up_on=ENDED
    )
    first = checkpointed["checkpoints"][0]
    assert first["step"] == CHECKPOINT_EVERY and [s["stage_index"] for s in first["stages"]] == [0, 1]
    for stage in first["stages"]:
        assert stage["size_bytes"] > STAGE_STATE_FLOOR, stage  # more than one gRPC message may carry
    assert [(s["layer_start"], s["layer_end"]) for s in first["stages"]] == [(0, 5), (5, 10)]
    placed = placement(checkpointed)
    victim = next(a for a in agents if a.node_id == placed[1])
    spare = next(a for a in agents if a.node_id not in placed.values())
    peaks = {victim.name: peak_rss(victim.child.process.pid)}
    cluster.crash(victim.child.name)

    def training_on_the_spare(d: dict[str, Any]) -> bool:
        resumed = d["step"] > (d["resumed_from_step"] or 0)
        return d["status"] == "running" and placement(d)[1] == spare.node_id and resumed

    resumed = cluster.wait_for_job(job["id"], training_on_the_spare, 300, give_up_on=ENDED)
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] % CHECKPOINT_EVERY == 0
    sample = client.sample(job["id"], prompt="And God", length=12, temperature=0.0)
    assert sample["text"].startswith("And God") and len(sample["text"]) == len("And God") + 12  # a char vocabulary

    final = client.wait(job["id"], timeout=600)
    assert final["status"] == "succeeded", final["error"]
    assert placement(final) == {**placed, 1: spare.node_id}
    curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
    assert sorted(curve) == list(range(1, len(reference.losses) + 1))  # every step once, the replays included
    for step, want in enumerate(reference.losses, 1):
        assert math.isclose(curve[step], want, rel_tol=1e-5), f"step {step}: {curve[step]!r} != {want!r}"
    assert math.isclose(final["val_loss"], reference.val_loss, rel_tol=1e-5)

    # The owner downloads the model as a stream: the uninterrupted run's weights (Adam makes float rounding of
    # gradients that are zero in exact arithmetic lr-sized, hence the absolute slack).
    path = tmp_path / "model.safetensors"
    client.save_model(job["id"], path)
    with safe_open(str(path), framework="pt") as model:
        assert sorted(model.keys()) == sorted(reference.weights)
        for name, want in reference.weights.items():
            torch.testing.assert_close(model.get_tensor(name), want, rtol=1e-4, atol=1e-4)
        downloaded = {name: model.get_tensor(name) for name in model.keys()}  # noqa: SIM118 (safe_open has no iter)

    # Served after it finished: its two stages go back onto the two live agents, and sample as one process does.
    serving_began = time.monotonic()
    assert client.serve_job(job["id"])["serving"] is True
    served = client.wait_served(job["id"], timeout=300)
    live = {a.node_id for a in agents if a is not victim}
    active = [p for p in served["placements"] if p["generation"] == served["generation"]]
    assert sorted(p["stage_index"] for p in active) == [0, 1] and {p["node_id"] for p in active} == live
    greedy = client.sample(job["id"], prompt="And God", length=24, temperature=0.0)
    tokenizer = dataset_tokenizer(validate_dataset_config(job_body["dataset_config"]))
    want = sample_text(final["model_config"], downloaded, tokenizer, prompt="And God", length=24, temperature=0.0)
    assert greedy == {"text": want, "step": final["step"]}
    client.stop_serving(job["id"])
    give_up = time.monotonic() + 60
    while held := [n["name"] for n in client.nodes() if n["id"] in live and n["current_stage"] is not None]:
        assert time.monotonic() < give_up, f"{held} still hold the served job's stages a minute after it stopped"
        time.sleep(0.2)
    with pytest.raises(ApiError) as stopped:
        client.sample(job["id"], prompt="And God", length=1)
    assert stopped.value.status == 409 and "is not served" in str(stopped.value)
    record_property("serving_seconds", round(time.monotonic() - serving_began, 1))  # what serving adds to the test

    peaks.update({a.name: peak_rss(a.child.process.pid) for a in agents if a is not victim})
    trained = {victim.name: 1, spare.name: 1, **{a.name: 0 for a in agents if a.node_id == placed[0]}}
    predicted = predicted_peaks(final, trained, {a.name: a.node_id for a in agents}, client.nodes())
    for name, peak in peaks.items():
        record_property(f"{name}_peak_rss_mib", peak // 2**20)
        record_property(f"{name}_predicted_peak_mib", predicted[name] // 2**20)
    print(f"agents' peak RSS (MiB): { {n: p // 2**20 for n, p in peaks.items()} }, "
          f"the memory model's: { {n: p // 2**20 for n, p in predicted.items()} }, stages: {trained}, "
          f"killed: {victim.name}, spare: {spare.name}")
    for name, peak in peaks.items():
        tolerance = PEAK_TOLERANCE if name == victim.name else REBUILT_TOLERANCE
        assert abs(predicted[name] / peak - 1) <= tolerance, (name, peak, predicted[name])


def predicted_peaks(
    final: dict[str, Any], stage_of: dict[str, int], node_of: dict[str, str], nodes: list[dict[str, Any]]
) -> dict[str, int]:
    """The memory model's peak of each agent that trained a stage: what it held at registration (its runtime
    bytes) plus `stage_memory` of its stage's layers, holding what the job's schedule has in flight there."""
    layers = layer_profiles(model_spec_from_config(final["model_config"]))
    ranges = {p["stage_index"]: (p["layer_start"], p["layer_end"]) for p in final["placements"]}
    batch = final["dataset_config"]["batch_size"]
    workload = Workload(-(-batch // final["micro_batches"]), final["micro_batches"], final["schedule"],
                        optimizer=optimizer_kind(final["optimizer"], final["momentum"]), precision=final["precision"],
                        activation_checkpointing=final["activation_checkpointing"])
    runtime = {node["id"]: node["runtime_memory_bytes"] for node in nodes}
    return {
        name: runtime[node_of[name]] + stage_memory(
            layers[ranges[stage][0] : ranges[stage][1]], workload,
            in_flight=workload.in_flight(stage, len(ranges)),
        )
        for name, stage in stage_of.items()
    }

