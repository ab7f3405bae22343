"""A GPT whose stage 1 is a tensor-parallel pair, submitted over REST and trained by the real system.

Gunicorn on PostgreSQL, a Celery worker and beat on Redis, and three node agents: the reconciler puts
stage 0 on one agent and splits stage 1 (the last block and the head) over the other two, 2 of the 4
heads each. The job succeeds with the losses of single-process training, step for step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from arceus.data.text_config import BUNDLED_TEXT
from devtools.cluster import LocalCluster
from devtools.reference import reference_run

pytestmark = pytest.mark.slow


def test_a_job_with_a_tensor_parallel_stage_trains_over_rest_like_one_process(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    source = tmp_path / "genesis.txt"
    source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    agents = [cluster.start_agent(f"node-{i}") for i in range(3)]
    spec: dict[str, Any] = {
        "name": "e2e-tensor-parallel",
        "model_config": {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16},
        "dataset_config": {
            "name": "text", "source": cluster.add_data_file(source), "batch_size": 16, "val_batch_size": 64
        },
        "epochs": 1,
        "learning_rate": 0.003,
        "optimizer": "adam",
        "micro_batches": 2,
        "seed": 7,
        "stages": 2,
        "tensor_parallel": {"size": 2, "stages": [1]},
    }
    job = cluster.client.submit_job(spec)
    assert job["tensor_parallel"] == {"size": 2, "stages": [1]} and job["audit_rate"] == 0.0
    cluster.client.start_job(job["id"])

    final = cluster.client.wait(job["id"], timeout=120)

    assert final["status"] == "succeeded", (final.get("error"), final["conditions"])
    placements = [(p["stage_index"], p["rank"], p["node_id"]) for p in final["placements"]]
    assert [(i, r) for i, r, _ in placements] == [(0, 0), (1, 0), (1, 1)]
    assert {n for _, _, n in placements} == {a.node_id for a in agents}  # every rank on its own agent
    assert all(p["samples"] > 0 and p["compute_seconds"] > 0 for p in final["placements"])
    losses = [point["loss"] for point in final["loss_curve"]]
    assert final["step"] == final["total_steps"] == len(losses) > 5
    assert losses[-1] < losses[0] - 0.2
    expected = reference_run({**spec, "model_config": final["model_config"], "dataset_config": final["dataset_config"]})
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != single-process {want!r}"
    # Both ranks of the split stage are metered and billed as contributors.
    contributors = {(c["stage_index"], c["node_id"]) for c in final["contributions"]}
    assert contributors == {(i, n) for i, _, n in placements}
