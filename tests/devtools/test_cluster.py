"""What a wait for a job says when it times out: enough to tell why from a CI log's tail."""

from __future__ import annotations

from devtools.cluster import job_summary


def test_a_job_summary_names_each_placement_and_each_condition() -> None:
    detail = {
        "status": "running", "step": 41, "generation": 1,
        "placements": [
            {"stage_index": 0, "replica": 0, "node_id": "5e0c", "node_name": "grow-0", "activity": "training",
             "micro_batches": 164},
            {"stage_index": 0, "replica": 1, "node_id": "77aa", "node_name": None, "activity": "joining",
             "micro_batches": 0},
        ],
        "conditions": [
            {"type": "Placed", "status": "True", "reason": "Placed", "message": "1 stage on grow-0 (layers 0-2)"},
            {"type": "Training", "status": "True", "reason": "DriverStarting", "message": "the driver starts"},
        ],
    }
    assert job_summary(detail) == (
        "running at step 41 (generation 1); placements: stage 0 replica 0 on grow-0: training, 164 micro-batches; "
        "stage 0 replica 1 on 77aa: joining, 0 micro-batches; conditions: Placed=True Placed: 1 stage on grow-0 "
        "(layers 0-2); Training=True DriverStarting: the driver starts"
    )
    assert job_summary({**detail, "placements": [], "conditions": []}).endswith("placements: none; conditions: none")
