"""A developer uploads their own tensors (the digits as a pair of tensors, through `uploadable`), the upload is
interrupted and resumed from the control plane's offset, and a job naming the dataset by id trains to success on
two agents: stage 0 and the last stage read their rows of the upload by byte range through the control plane's
`dataset-reads` (the driver, in the Celery worker, reads the file's header only).

Real processes throughout: gunicorn on PostgreSQL, Celery on Redis, agents over gRPC.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arceus.data.loader import load_dataset
from arceus.data.uploadable import uploadable
from devtools.cluster import LocalCluster

pytestmark = pytest.mark.slow
PIECE = 64 << 10


class Interrupted(Exception):
    pass


def test_an_interrupted_upload_resumes_and_a_job_trains_on_it(cluster: LocalCluster, tmp_path: Path) -> None:
    train_x, train_y, val_x, val_y = load_dataset({"name": "digits"})
    path, fmt = uploadable((torch.cat([train_x, val_x]), torch.cat([train_y, val_y])), tmp_path)
    size = path.stat().st_size
    client = cluster.client

    def stop_after_two_pieces(sent: int, total: int) -> None:
        if sent >= 2 * PIECE:
            raise Interrupted

    with pytest.raises(Interrupted):
        client.upload_dataset(path, fmt, chunk_bytes=PIECE, on_progress=stop_after_two_pieces)
    [partial] = [d for d in client.datasets() if d["status"] == "uploading"]
    assert partial["uploaded_bytes"] == 2 * PIECE

    sent: list[int] = []
    dataset = client.upload_dataset(path, fmt, chunk_bytes=PIECE, on_progress=lambda s, _: sent.append(s))
    assert dataset["id"] == partial["id"] and dataset["status"] == "ready"
    assert sent[0] == 3 * PIECE and sent[-1] == size  # resumed: the first two pieces were not sent again
    assert dataset["facts"] == {"kind": "tensors", "samples": 1797, "features": 64, "image_shape": None,
                                "classes": 10}

    cluster.start_agents(["upload-a", "upload-b"])
    job = client.submit_job({
        "model_config": {"layer_sizes": [64, 64, 10]},
        "dataset_config": {"name": "uploaded", "dataset_id": dataset["id"], "batch_size": 64, "val_batch_size": 180},
        "epochs": 2, "learning_rate": 0.05, "optimizer": "sgd", "momentum": 0.9, "micro_batches": 2, "stages": 2,
        "requirements": {"owner_diversity": False},  # both agents are one owner's
    })
    client.start_job(job["id"])
    final = client.wait(job["id"], timeout=240)
    assert final["status"] == "succeeded", final.get("error")
    assert final["total_steps"] == 2 * -(-int(1797 * 0.9) // 64)
    assert final["val_accuracy"] >= 0.8
    assert client.session.delete(f"{cluster.api_url}/api/datasets/{dataset['id']}").status_code == 204
