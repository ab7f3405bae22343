"""A real agent process under bad gRPC input: the right status codes, and it keeps serving.

One agent hosts both stages of a two-stage job (its stages push to each other over loopback gRPC),
plus stage 0 of a job whose stage 1 address is dead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import pytest
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arceus.checkpoint import decode_checkpoint
from arceus.contracts.certificates import AGENT_TLS_NAME
from arceus.data.config import validate_dataset_config
from arceus.training.driver import DriverError, train
from arceus.training.plan import StageEndpoint, TrainPlan
from arceus.training.recording import RecordingSink
from arceus.v1 import stage_pb2, stage_pb2_grpc
from arceus.wire.channels import open_channel
from arceus.wire.proto_tensor import to_proto
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents
from devtools.pipeline import driver_token, identity_for, pipeline_assignments

pytestmark = pytest.mark.slow

MODEL = {"layer_sizes": [64, 32, 10]}
MAX_MB = 16
JOB = "grpc-job"
ORPHAN = "orphan-job"
DATASET = validate_dataset_config({"name": "digits", "batch_size": 32, "val_batch_size": 64})


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    own, dead = (f"127.0.0.1:{p}" for p in free_ports(2))
    common = {
        "model_config": MODEL,
        "boundaries": [0, 1, 2],
        "optimizer": {"name": "sgd", "lr": 0.1},
        "seed": 0,
        "micro_batches": 4,
        "max_micro_batch_size": MAX_MB,
    }
    both = pipeline_assignments(job_id=JOB, addresses=[own, own], **common)
    orphan = pipeline_assignments(job_id=ORPHAN, addresses=[own, dead], **common)[:1]
    [started] = spawn_static_agents([both + orphan], [own], tmp_path_factory.mktemp("grpc-agent"))
    try:
        yield started
    finally:
        codes = stop_agents([started])
    assert codes == [0], "SIGTERM must stop the agent gracefully"
    # Every rejection in this module is an expected outcome, logged as a warning, never a crash.
    assert "Traceback" not in started.log_text()


@pytest.fixture(scope="module")
def stub(agent: AgentProcess) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    """The driver's: calls carry the job's driver token."""
    with open_channel(agent.grpc_address, token=driver_token(JOB), certificate=agent.certificate) as channel:
        yield stage_pb2_grpc.StageServiceStub(channel)


@pytest.fixture(scope="module")
def orphan_stub(agent: AgentProcess) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    with open_channel(agent.grpc_address, token=driver_token(ORPHAN), certificate=agent.certificate) as channel:
        yield stage_pb2_grpc.StageServiceStub(channel)


def ref(stage_index: int = 0, generation: int = 1, job_id: str = JOB) -> stage_pb2.StageRef:
    return stage_pb2.StageRef(job_id=job_id, stage_index=stage_index, generation=generation)


def push(
    stub: stage_pb2_grpc.StageServiceStub,
    tensor: stage_pb2.Tensor,
    *,
    kind: int = stage_pb2.ACTIVATION,
    target: stage_pb2.StageRef | None = None,
    step: int = 1000,
    micro_batch: int = 0,
) -> None:
    stub.PushTensor(
        stage_pb2.PushTensorRequest(
            target=target or ref(), kind=kind, step=step, micro_batch=micro_batch, tensor=tensor
        ),
        timeout=10,
    )


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:  # noqa: ANN001 - any stub method
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def plan(agent: AgentProcess, job_id: str = JOB, **overrides: object) -> TrainPlan:
    fields = {
        "job_id": job_id,
        "generation": 1,
        "stages": (
            StageEndpoint(0, agent.grpc_address, "n", 0, 1, certificate=agent.certificate),
            StageEndpoint(1, agent.grpc_address, "n", 1, 2, certificate=agent.certificate),
        ),
        "dataset": DATASET,
        "epochs": 1,
        "learning_rate": 0.1,
        "micro_batches": 4,
        "seed": 0,
        "rpc_timeout_seconds": 20.0,
        "max_steps": 2,
    }
    fields.update(overrides)
    fields.setdefault("credential", driver_token(str(fields["job_id"]), int(fields["generation"])))  # type: ignore[call-overload]
    return TrainPlan(**fields)  # type: ignore[arg-type]


BAD_PUSHES = {
    "wrong dtype": (to_proto(torch.zeros(2, 64, dtype=torch.float64).to(torch.int64)), {}, "must be float32"),
    "wrong feature count": (to_proto(torch.zeros(2, 63)), {}, "shape [batch, 64]"),
    "wrong rank": (to_proto(torch.zeros(2, 64, 1)), {}, "shape [batch, 64]"),
    "batch above max_micro_batch_size": (to_proto(torch.zeros(MAX_MB + 1, 64)), {}, "max_micro_batch_size"),
    "empty batch": (to_proto(torch.zeros(0, 64)), {}, "batch dimension"),
    "bytes do not match the shape": (
        stage_pb2.Tensor(dtype="float32", shape=[2, 64], data=b"\0" * 100),
        {},
        "needs exactly 512 bytes",
    ),
    "oversized payload": (
        stage_pb2.Tensor(dtype="float32", shape=[2, 64], data=b"\0" * (3 << 20)),
        {},
        "above the limit",
    ),
    "unknown dtype": (stage_pb2.Tensor(dtype="complex64", shape=[2, 64], data=b""), {}, "must be float32"),
    "micro-batch out of range": (to_proto(torch.zeros(2, 64)), {"micro_batch": 4}, "micro_batch must be in"),
    "labels to the first stage": (
        to_proto(torch.zeros(2, dtype=torch.int64)),
        {"kind": stage_pb2.LABELS},
        "only the last stage",
    ),
    "labels out of range": (
        to_proto(torch.tensor([3, 10])),
        {"kind": stage_pb2.LABELS, "target": ref(1)},
        "class indices in [0, 10)",
    ),
    "labels of the wrong dtype": (
        to_proto(torch.tensor([1.0, 2.0])),
        {"kind": stage_pb2.LABELS, "target": ref(1)},
        "must be int64",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_invalid_push_is_rejected_with_invalid_argument(
    stub: stage_pb2_grpc.StageServiceStub, case: str
) -> None:
    tensor, extra, fragment = BAD_PUSHES[case]
    error = rpc_error(push, stub, tensor, **extra)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert fragment in error.details()


@pytest.mark.parametrize(
    "extra",
    [{"kind": stage_pb2.GRADIENT, "target": ref(1)}, {"kind": stage_pb2.TENSOR_KIND_UNSPECIFIED}],
    ids=["gradient to the last stage", "unspecified kind"],
)
def test_a_push_of_a_kind_the_driver_does_not_send_is_denied(
    stub: stage_pb2_grpc.StageServiceStub, extra: dict
) -> None:
    """Gradients come from the next stage only (the last stage has none), and a kind nobody sends is nobody's."""
    error = rpc_error(push, stub, to_proto(torch.zeros(2, 10)), **extra)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()


@pytest.mark.parametrize(
    "wire", [b"\x0a\xff\x01", b"\x00\x00", b"\x2a\x03\x1a\x05ab"], ids=["past the end", "field 0", "tensor cut"]
)
def test_bytes_that_are_no_push_request_are_invalid_argument(agent: AgentProcess, wire: bytes) -> None:
    """Both push methods parse with parse_push, which names the problem (gRPC's own deserializer
    failure would be INTERNAL); the stream ends there, having nothing to ack the bytes by."""
    with open_channel(agent.grpc_address, token=driver_token(JOB), certificate=agent.certificate) as channel:
        unary = channel.unary_unary("/arceus.v1.StageService/PushTensor")
        stream = channel.stream_stream("/arceus.v1.StageService/PushStream")
        errors = [rpc_error(unary, wire, timeout=10), rpc_error(lambda: list(stream(iter([wire]), timeout=10)))]
        for error in errors:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert "not a PushTensorRequest" in error.details()


def test_another_generation_is_denied_without_naming_the_current_one(stub: stage_pb2_grpc.StageServiceStub) -> None:
    error = rpc_error(push, stub, to_proto(torch.zeros(2, 64)), target=ref(generation=2))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "generation" not in error.details()
    def get_state(request: stage_pb2.GetStateRequest, timeout: float) -> list[stage_pb2.StateChunk]:
        return list(stub.GetState(request, timeout=timeout))

    error = rpc_error(get_state, stage_pb2.GetStateRequest(target=ref(generation=0)), timeout=10)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("target", [ref(job_id="no-such-job"), ref(stage_index=5), ref(job_id=ORPHAN)])
def test_a_stage_outside_the_callers_credential_is_denied(
    stub: stage_pb2_grpc.StageServiceStub, target: stage_pb2.StageRef
) -> None:
    error = rpc_error(push, stub, to_proto(torch.zeros(2, 64)), target=target)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"num_micro_batches": 5}, "num_micro_batches must be in [1, 4]"),
        ({"num_micro_batches": 0}, "num_micro_batches"),
        ({"schedule": "zigzag"}, "unknown schedule"),
        ({"mode": stage_pb2.STEP_MODE_UNSPECIFIED}, "mode must be TRAIN or EVAL"),
        ({"batch_size": 2 * MAX_MB + 1}, "batch_size must be in [1, 32] for 2 micro-batches"),
        ({"learning_rate": -1.0}, "learning_rate"),
        # samples a stage reads itself (arceus.data.step_data)
        ({"data": stage_pb2.StepData(dataset_json=json.dumps(DATASET), indices=range(3))},
         "data.indices names 3 samples for a batch_size of 8"),
        ({"data": stage_pb2.StepData(dataset_json=json.dumps(DATASET), indices=[0, 1, 2, 3, 4, 5, 6, 99999])},
         "data.indices: index 99999 is outside the split's 1438 samples"),
        ({"data": stage_pb2.StepData(dataset_json="{", indices=range(8))}, "data.dataset_json: is not JSON"),
        ({"data": stage_pb2.StepData(dataset_json=json.dumps({"name": "uploaded", "dataset_id": "a" * 32}),
                                     indices=range(8))}, "names 'uploaded' data that the stages read only with its"),
        ({"data": stage_pb2.StepData(dataset_json=json.dumps({"name": "uploaded", "dataset_id": "a" * 32}),
                                     indices=range(8), layout_json="{}")},
         "data.layout_json: must be an object of dataset_id, kind, size, train and validation"),
    ],
)
def test_invalid_run_step_is_rejected(
    stub: stage_pb2_grpc.StageServiceStub, fields: dict, fragment: str
) -> None:
    request = {
        "target": ref(),
        "step": 1,
        "mode": stage_pb2.TRAIN,
        "num_micro_batches": 2,
        "schedule": "gpipe",
        "batch_size": 8,
        "learning_rate": 0.1,
        **fields,
    }
    error = rpc_error(stub.RunStep, stage_pb2.RunStepRequest(**request), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.details()


@pytest.mark.parametrize(
    ("config", "weights", "fragment"),
    [
        (MODEL, b"", "need 8,320"),  # no weights: nothing is built
        (MODEL, b"\0" * (2 << 20), "exceed"),  # more than those layers'
        (MODEL, b"\0" * 8320, "not a valid safetensors"),
    ],
)
def test_verify_forward_takes_only_weights_of_the_layers_it_recomputes(
    stub: stage_pb2_grpc.StageServiceStub, config: dict, weights: bytes, fragment: str
) -> None:
    def messages() -> Iterator[stage_pb2.VerifyForwardRequest]:
        yield stage_pb2.VerifyForwardRequest(
            model_config_json=json.dumps(config), layer_start=0, layer_end=1, input=to_proto(torch.zeros(1, 64))
        )
        for start in range(0, len(weights), 1 << 20):
            yield stage_pb2.VerifyForwardRequest(weights_chunk=weights[start : start + (1 << 20)])

    error = rpc_error(stub.VerifyForward, messages(), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in error.details(), error.details()


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (torch.zeros(MAX_MB + 1, 64), f"input batch dimension must be in [1, {MAX_MB}]"),
        (torch.zeros(1, 4096), "input tensor must have shape [batch, 64]"),
        (torch.zeros(1, 64, dtype=torch.int64), "input tensors must be float32"),
    ],
)
def test_verify_forward_takes_only_inputs_the_jobs_stages_take(
    stub: stage_pb2_grpc.StageServiceStub, tensor: torch.Tensor, fragment: str
) -> None:
    first = stage_pb2.VerifyForwardRequest(
        model_config_json=json.dumps(MODEL), layer_start=0, layer_end=1, input=to_proto(tensor)
    )
    error = rpc_error(stub.VerifyForward, iter([first]), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in error.details(), error.details()


def test_verify_forward_recomputes_only_the_callers_model(stub: stage_pb2_grpc.StageServiceStub) -> None:
    """A 781-byte request for a huge transformer once cost an agent 1.5 GB; now it builds nothing."""
    huge = {"type": "transformer", "n_layer": 256, "d_model": 65536, "vocab_size": 10, "block_size": 8}
    first = stage_pb2.VerifyForwardRequest(
        model_config_json=json.dumps(huge), layer_start=0, layer_end=1, input=to_proto(torch.zeros(1, 8))
    )
    error = rpc_error(stub.VerifyForward, iter([first]), timeout=10)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "only the model" in error.details()


def test_a_missing_input_times_out_naming_what_it_waited_for(stub: stage_pb2_grpc.StageServiceStub) -> None:
    request = stage_pb2.RunStepRequest(
        target=ref(), step=2000, mode=stage_pb2.TRAIN, num_micro_batches=1, batch_size=2
    )
    error = rpc_error(stub.RunStep, request, timeout=4.0)
    # the agent's answer, sent before the caller's deadline (nodeagent.rpc.call_deadline), not the caller's own
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ACTIVATION of step 2000 micro-batch 0 from the driver" in error.details()


def test_a_failed_push_to_the_next_stage_fails_the_step(orphan_stub: stage_pb2_grpc.StageServiceStub) -> None:
    orphan = ref(job_id=ORPHAN)
    push(orphan_stub, to_proto(torch.zeros(2, 64)), target=orphan, step=3000)
    request = stage_pb2.RunStepRequest(
        target=orphan, step=3000, mode=stage_pb2.TRAIN, num_micro_batches=1, batch_size=2
    )
    error = rpc_error(orphan_stub.RunStep, request, timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # (a one-agent neighbour: its activations go on a neighbour stream, which the step opens first)
    assert "could not ask stage 1 at" in error.details() and "where it takes its neighbour stream" in error.details()


def test_driver_names_the_unreachable_stage(agent: AgentProcess) -> None:
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    broken = plan(
        agent,
        job_id=ORPHAN,
        rpc_timeout_seconds=5.0,
        stages=(
            StageEndpoint(0, agent.grpc_address, "n0", 0, 1, certificate=agent.certificate),
            StageEndpoint(1, dead, "n1", 1, 2, certificate=identity_for(dead).certificate),
        ),
    )
    with pytest.raises(DriverError) as info:
        train(broken, RecordingSink())
    assert info.value.code == "UNAVAILABLE"
    # Its own RunStep's failure, or stage 0's as it opens its neighbour stream to it: whichever the driver sees first.
    # Stage 0 names the address its assignment gives stage 1 (the fixture's), not the one this plan dials.
    named = {1: f"stage 1 (node n1 at {dead})", 0: "could not ask stage 1 at 127.0.0.1:"}
    assert named[info.value.stage_index] in str(info.value)


def test_agent_still_trains_and_exports_metrics_after_bad_input(
    agent: AgentProcess, stub: stage_pb2_grpc.StageServiceStub
) -> None:
    # Leftovers from the rejected and failed calls above must not disturb a real step.
    push(stub, to_proto(torch.zeros(2, 64)), step=4000, micro_batch=1)
    result = train(plan(agent), RecordingSink())
    assert result.steps == 2 and math.isfinite(result.final_loss) and 0 <= result.val_accuracy <= 1
    chunks = stub.GetState(stage_pb2.GetStateRequest(target=ref(1)), timeout=10)
    assert sorted(decode_checkpoint(b"".join(c.data for c in chunks))) == ["layers.1.bias", "layers.1.weight"]

    scraped = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token}, timeout=10)
    text = scraped.text
    for name in (
        "arceus_stage_step_seconds_bucket",
        "arceus_samples_processed_total",
        "arceus_micro_batches_processed_total",
        "arceus_tensor_bytes_sent_total",
        "arceus_tensor_bytes_received_total",
        "arceus_device_memory_used_bytes",
        "arceus_device_memory_peak_bytes",
        "arceus_stage_assigned",
        "arceus_heartbeat_age_seconds",
        "arceus_compute_seconds_total",
        "arceus_stage_info",
    ):
        assert f"\n{name}" in text, name
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["arceus_stage_assigned"] == 3
    assert values["arceus_samples_processed_total"] > 0
    assert values["arceus_tensor_bytes_sent_total"] > 0
    assert values["arceus_device_memory_used_bytes"] > 0
    assert values["arceus_device_memory_peak_bytes"] > 0


def test_health_service_reports_serving_over_tls_to_anyone(agent: AgentProcess) -> None:
    """Health needs no credential (it says nothing about jobs); but even it speaks only TLS."""
    tls = grpc.ssl_channel_credentials(root_certificates=agent.certificate.encode())
    with grpc.insecure_channel(agent.grpc_address) as plaintext, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    options = [("grpc.ssl_target_name_override", AGENT_TLS_NAME)]
    with grpc.secure_channel(agent.grpc_address, tls, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "arceus.v1.StageService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
