"""`Infer` on a real agent: what a sampler may ask of a stage, and what it is refused (before torch sees it)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from arceus.contracts.assignment import Assignment
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import from_proto, to_proto
from devtools.pipeline import driver_token, pipeline_assignments
from nodeagent.agent import Agent
from nodeagent.inference import MAX_SESSIONS

GPT = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 5}


def assignments(job_id: str, model: dict, boundaries: list[int], *, inference: bool = False) -> list[Assignment]:
    return [
        Assignment.from_json({**a, "inference": inference})
        for a in pipeline_assignments(
            job_id=job_id, model_config=model, boundaries=boundaries, addresses=["127.0.0.1:1"] * (len(boundaries) - 1),
            optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=1, max_micro_batch_size=2,
        )
    ]


class Drivers:
    """Both jobs' drivers: a call goes out with the driver token of the job it addresses."""

    def __init__(self, address: str, certificate: str, jobs: list[str]) -> None:
        self.channels = {job: open_channel(address, token=driver_token(job), certificate=certificate) for job in jobs}

    def Infer(self, request: stage_pb2.InferRequest, timeout: float) -> stage_pb2.InferReply:  # noqa: N802
        return self.stub(request.target.job_id).Infer(request, timeout=timeout)

    def stub(self, job: str) -> stage_pb2_grpc.StageServiceStub:
        channel = self.channels.get(job, self.channels["gpt"])  # another job: gpt's driver tries
        return stage_pb2_grpc.StageServiceStub(channel)


@pytest.fixture(scope="module")
def stub() -> Iterator[Drivers]:
    agent = Agent(device=torch.device("cpu"))
    agent.start()
    agent.apply_assignments(
        assignments("gpt", GPT, [0, 2, 4]) + assignments("mlp", {"layer_sizes": [4, 3]}, [0, 1])
        + assignments("served", GPT, [0, 4], inference=True)
    )
    drivers = Drivers(agent.grpc_address, agent.identity.certificate, ["gpt", "mlp", "served"])
    try:
        yield drivers
    finally:
        for channel in drivers.channels.values():
            channel.close()
        agent.stop(grace=1)


def infer(stub, x: torch.Tensor, *, session: str = "s", start: int = 0, stage: int = 0, job: str = "gpt"):
    target = stage_pb2.StageRef(job_id=job, stage_index=stage, generation=1)
    request = stage_pb2.InferRequest(target=target, session=session, start=start, input=to_proto(x))
    return from_proto(stub.Infer(request, timeout=10).output)


def refused(stub, x: torch.Tensor, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        infer(stub, x, **kwargs)
    return info.value


def test_a_session_decodes_position_by_position_through_both_stages(stub) -> None:
    ids = torch.tensor([[1, 2, 3]])
    hidden = infer(stub, ids, session="a")
    assert hidden.shape == (1, 3, 16)
    assert infer(stub, hidden, session="a", stage=1).shape == (1, 5)  # the last position's logits
    step = infer(stub, torch.tensor([[4]]), session="a", start=3)
    assert infer(stub, step, session="a", stage=1, start=3).shape == (1, 5)


@pytest.mark.parametrize(
    ("x", "kwargs", "code", "message"),
    [
        (torch.tensor([[1, 5]]), {}, grpc.StatusCode.INVALID_ARGUMENT, "token ids must lie in [0, 5)"),
        (torch.tensor([[1.0, 2.0]]), {}, grpc.StatusCode.INVALID_ARGUMENT, "expected int64 input"),
        (torch.zeros(1, 9, dtype=torch.int64), {}, grpc.StatusCode.INVALID_ARGUMENT, "past the model's window of 8"),
        (torch.zeros(3, 1, dtype=torch.int64), {}, grpc.StatusCode.INVALID_ARGUMENT, "decodes 1 to 2"),
        (torch.zeros(1, 2, 7), {"stage": 1}, grpc.StatusCode.INVALID_ARGUMENT, "expected input of shape"),
        (torch.tensor([[1]]), {"session": "never", "start": 4}, grpc.StatusCode.NOT_FOUND, "no session 'never'"),
        (torch.tensor([[1]]), {"session": "x" * 65}, grpc.StatusCode.INVALID_ARGUMENT, "1 to 64 characters"),
        (torch.tensor([[1]]), {"start": -1}, grpc.StatusCode.INVALID_ARGUMENT, "start must be 0 or more"),
        (torch.zeros(1, 4), {"job": "mlp"}, grpc.StatusCode.INVALID_ARGUMENT, "do not decode"),
        (torch.tensor([[1]]), {"job": "nope"}, grpc.StatusCode.PERMISSION_DENIED, "does not allow Infer"),
    ],
)
def test_what_a_stage_refuses_to_decode(stub, x: torch.Tensor, kwargs: dict, code, message: str) -> None:
    error = refused(stub, x, **kwargs)
    assert error.code() == code and message in error.details(), error.details()


def test_a_session_continues_only_where_it_stopped(stub) -> None:
    infer(stub, torch.tensor([[1, 2]]), session="b")
    error = refused(stub, torch.tensor([[3]]), session="b", start=1)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "continue it at 2" in error.details()
    infer(stub, torch.tensor([[3]]), session="b", start=2)  # the refusal kept the session


def test_a_stage_keeps_only_its_newest_sessions(stub) -> None:
    for i in range(MAX_SESSIONS + 1):
        infer(stub, torch.tensor([[1]]), session=f"many-{i}")
    assert refused(stub, torch.tensor([[2]]), session="many-0", start=1).code() == grpc.StatusCode.NOT_FOUND
    infer(stub, torch.tensor([[2]]), session=f"many-{MAX_SESSIONS}", start=1)


def test_a_served_stage_decodes_and_refuses_everything_else_its_driver_may_ask(stub) -> None:
    assert infer(stub, torch.tensor([[1, 2, 3]]), job="served").shape == (1, 5)  # the whole model: logits
    target = stage_pb2.StageRef(job_id="served", stage_index=0, generation=1)
    with pytest.raises(grpc.RpcError) as info:
        stub.stub("served").SaveState(stage_pb2.SaveStateRequest(target=target), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == (
        "stage 0 of job served (generation 1) is served for inference: it only decodes (Infer)"
    )
