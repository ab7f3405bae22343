"""A two-stage MLP job whose stages one test agent both hosts, and the driver's stub for it: the set-up of the tests
that send RunStep to both stages themselves (chained steps, step grants)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from arceus.contracts.assignment import Assignment
from arceus.v1 import stage_pb2_grpc
from arceus.wire.channels import open_channel
from devtools.pipeline import driver_token, pipeline_assignments, remember_identity
from nodeagent.agent import Agent


@contextmanager
def two_stage_stub(agent: Agent, job_id: str, *, micro_batches: int, batch: int
                   ) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    """Assign `job_id`'s two MLP stages to `agent` and yield the driver's stub for them."""
    remember_identity(agent.advertise_address, agent.identity)
    agent.apply_assignments([Assignment.from_json(a) for a in pipeline_assignments(
        job_id=job_id, model_config={"type": "mlp", "layer_sizes": [64, 32, 10]}, boundaries=[0, 1, 2],
        addresses=[agent.advertise_address] * 2, optimizer={"name": "sgd", "lr": 0.1}, seed=0,
        micro_batches=micro_batches, max_micro_batch_size=batch // micro_batches,
    )])
    with open_channel(agent.advertise_address, token=driver_token(job_id), certificate=agent.identity.certificate) as c:
        yield stage_pb2_grpc.StageServiceStub(c)
