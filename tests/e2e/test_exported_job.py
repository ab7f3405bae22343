"""Any PyTorch model over REST: a module defined here is captured (torch.export, cut into layers), submitted with
`ArceusClient.submit_captured` (its program and initial weights uploaded as JSON and safetensors), and trained by
the real system on three agents that rebuild its layers from those bytes alone: every step's loss is the one of
training the module itself in one process. A program naming a forbidden operator is refused with the operator's
name, and the job cannot start: nothing runs."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn

from arceus import DistributedTrainer
from arceus.model.exported.capture import capture
from arceus.sdk import ApiError
from devtools.cluster import LocalCluster
from devtools.hostile_program import forged_program
from devtools.reference import reference_run

pytestmark = pytest.mark.slow


class DigitsNet(nn.Module):
    """Digits' 64 pixels as an 8x8 image: a conv, a residual MLP block, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.proj = nn.Linear(4 * 16, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = torch.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 8, 8))), 2)
        h = self.proj(image.flatten(1))
        return self.head(h + self.block(h))


def first_digits_net() -> DigitsNet:
    """The module as the developer first made it (the same initial weights each call)."""
    torch.manual_seed(5)
    return DigitsNet()


def _wait_ready(trainer: DistributedTrainer, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while trainer.discover_peers().ready_devices < count:
        assert time.monotonic() < deadline, f"{count} devices not ready in {timeout} s: {trainer.peers}"
        time.sleep(0.5)


def test_a_captured_module_trains_through_distributed_trainer_on_three_agents_like_one_process(
    cluster: LocalCluster,
) -> None:
    module = first_digits_net()
    captured = capture(module, torch.rand(4, 64))
    assert len(captured.model_config["layers"]) >= 3
    spec: dict[str, Any] = {
        "name": "e2e-exported",
        "dataset_config": {"name": "digits", "batch_size": 64},
        "epochs": 1,
        "learning_rate": 0.01,
        "optimizer": "adam",
        "micro_batches": 2,
        "seed": 3,
        "stages": 3,
    }
    # A forged program (hashes consistent, one operator swapped for aten::from_file) is refused on upload.
    forged_config, _, forged = forged_program(captured, 1, "torch.ops.aten.from_file.default")
    job = cluster.client.submit_job({**spec, "model_config": forged_config})
    with pytest.raises(ApiError) as refused:
        cluster.client.upload_program(job["id"], forged)
    assert refused.value.status == 400 and "uses operator aten::from_file" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        cluster.client.start_job(job["id"])
    assert refused.value.status == 409 and "upload its program" in str(refused.value)

    # The developer's own way: DistributedTrainer captures the module, submits it over REST and loads the trained
    # weights back into it.
    cluster.start_agents([f"node-{i}" for i in range(3)])
    token = cluster.client.session.headers["Authorization"].removeprefix("Token ")
    trainer = DistributedTrainer(model=module, url=cluster.api_url, token=token, discovery_method="url",
                                 example_input=torch.rand(4, 64), progress=False, name=spec["name"])
    _wait_ready(trainer, 3)
    assert trainer.partition().stages == 3  # a stage per ready device
    history = trainer.train(dataset=spec["dataset_config"], epochs=1, timeout=180,
                            **{k: spec[k] for k in ("learning_rate", "optimizer", "micro_batches", "seed")})
    final = history.detail
    assert final["audit_rate"] == 0.0 and final["initial_weights_sha256"] and final["program_sha256"]
    assert len({p["node_id"] for p in final["placements"]}) == 3
    expected = reference_run({**spec, "dataset_config": final["dataset_config"]}, model=first_digits_net())
    assert history.steps == len(history.losses) == len(expected.losses) >= 10
    for step, (got, want) in enumerate(zip(history.losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=0, abs_tol=1e-5), f"step {step}: {got!r} != one process's {want!r}"
    assert history.losses[-1] < history.losses[0]
    # The trained weights are in the developer's module (trainer.model is it), under its own names.
    assert trainer.model is module
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor, expected.weights[f"layers.{name}"], rtol=0, atol=1e-4)
