"""An agent builds an exported model's stage only from the layer documents it fetched, and refuses a layer whose
graph names a forbidden operator: the assignment fails with the operator's name and nothing is built."""

from __future__ import annotations

from dataclasses import replace

import torch
from safetensors.torch import load as safetensors_load
from torch import nn

from arceus.contracts.assignment import Assignment, InitialWeightsRef
from arceus.contracts.observed import ObservedState
from arceus.model.exported.capture import CapturedModel, capture
from arceus.model.exported.program import program_layers
from devtools.hostile_program import forged_program
from devtools.pipeline import pipeline_assignments
from nodeagent.hosting import HostedStages

CPU = torch.device("cpu")
PROGRAM = "/api/agent/jobs/exported/program"


def _assignment(model_config: dict, layers: int) -> Assignment:
    [stage] = pipeline_assignments(
        job_id="exported", model_config=model_config, boundaries=[0, layers], addresses=["127.0.0.1:1"],
        optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=1, max_micro_batch_size=4,
    )
    return replace(Assignment.from_json(stage), program=PROGRAM)


def _captured() -> tuple[nn.Module, CapturedModel]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return module, capture(module, torch.randn(4, 6))


def test_an_agent_builds_an_exported_stage_from_the_documents_it_fetches() -> None:
    module, captured = _captured()
    layers = program_layers(captured.program, [layer["sha256"] for layer in captured.model_config["layers"]])
    fetched: list[tuple[str, int, int]] = []

    def load_program(path: str, start: int, end: int) -> list[str]:
        fetched.append((path, start, end))
        return layers[start:end]

    weights = safetensors_load(captured.weights)
    asked: list[tuple[int, int]] = []

    def load_initial_weights(_ref: InitialWeightsRef, start: int, end: int, _bound: int) -> dict[str, torch.Tensor]:
        asked.append((start, end))
        return weights

    registry = HostedStages(
        CPU, max_message_bytes=2**20, load_program=load_program, load_initial_weights=load_initial_weights
    )
    uploaded = InitialWeightsRef(url="/api/agent/jobs/exported/initial-weights", layer_sha256=("0" * 64,) * len(layers))
    assignment = replace(_assignment(captured.model_config, len(layers)), initial_weights=uploaded)
    try:
        registry.apply([assignment])
        [observed] = registry.observed()
        assert observed.state == ObservedState.READY, observed.message
        assert fetched == [(PROGRAM, 0, len(layers))] and asked == [(0, len(layers))]
        x = torch.randn(4, 6)
        with torch.no_grad():  # no reference to the stage kept: the close below would wait for it to go
            torch.testing.assert_close(registry.stages()[0].runtime.eval_forward(x), module(x), rtol=0, atol=1e-6)
    finally:
        registry.close()


def test_an_agent_refuses_a_forbidden_operator_and_builds_nothing() -> None:
    config, layers, _ = forged_program(_captured()[1], 1, "torch.ops.aten.from_file.default")
    registry = HostedStages(
        CPU, max_message_bytes=2**20, load_program=lambda _path, start, end: layers[start:end]
    )
    try:
        registry.apply([_assignment(config, len(layers))])
        [observed] = registry.observed()
        assert observed.state == ObservedState.FAILED
        assert "layer 1: uses operator aten::from_file, which agents do not run" in observed.message
        assert registry.stages() == []
    finally:
        registry.close()
