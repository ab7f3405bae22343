"""A GPT stage: token ids checked before torch sees them, and micro-batched training equal to one batch."""

from __future__ import annotations

import grpc
import pytest
import torch
import torch.nn.functional as F

from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_full_model, build_layers
from arceus.model.registry import model_spec_from_config
from arceus.v1 import stage_pb2
from arceus.wire.incoming_push import IncomingPush, parse_push
from arceus.wire.proto_tensor import to_proto
from nodeagent.rpc import RpcFailure
from nodeagent.runtime import StageRuntime
from nodeagent.stage_io import StageIO
from nodeagent.validation import decode_push

SPEC = model_spec_from_config(
    {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 8, "block_size": 6, "vocab_size": 7}
)
SGD = OptimizerConfig(name="sgd", lr=0.1)


def io(start: int, end: int) -> StageIO:
    return StageIO(
        input_layout=SPEC.input_layout(start),
        output_layout=SPEC.output_layout(end - 1),
        label_layout=SPEC.label_layout(),
        max_micro_batch_size=4,
        micro_batches=2,
        schedule="gpipe",
        stage_index=0 if start == 0 else 1,
        num_stages=2,
        is_first=start == 0,
        is_last=end == SPEC.num_layers,
    )


def request(kind: int, tensor: torch.Tensor) -> IncomingPush:
    wire = stage_pb2.PushTensorRequest(kind=kind, step=1, micro_batch=0, tensor=to_proto(tensor)).SerializeToString()
    push = parse_push(wire)
    assert isinstance(push, IncomingPush)
    return push


def test_the_first_stage_takes_token_ids_in_the_vocabulary() -> None:
    tokens = torch.randint(0, 7, (3, 6))
    assert torch.equal(decode_push(io(0, 2), request(stage_pb2.ACTIVATION, tokens)), tokens)
    for bad, fragment in [
        (torch.full((3, 6), 7), "ACTIVATION ids must be in [0, 7), got values in [7, 7]"),
        (tokens.float(), "ACTIVATION tensors must be int64"),
        (tokens[:, :5], "must have shape [batch, 6]"),
    ]:
        with pytest.raises(RpcFailure) as info:
            decode_push(io(0, 2), request(stage_pb2.ACTIVATION, bad))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.message


def test_later_stages_take_hidden_states_and_the_last_next_token_labels() -> None:
    hidden = torch.randn(2, 6, 8)
    assert decode_push(io(2, 4), request(stage_pb2.ACTIVATION, hidden)).shape == (2, 6, 8)
    assert decode_push(io(0, 2), request(stage_pb2.GRADIENT, hidden)).shape == (2, 6, 8)
    labels = torch.randint(0, 7, (2, 6))
    assert torch.equal(decode_push(io(2, 4), request(stage_pb2.LABELS, labels)), labels)
    with pytest.raises(RpcFailure, match=r"labels must be class indices in \[0, 7\)"):
        decode_push(io(2, 4), request(stage_pb2.LABELS, labels + 7))
    with pytest.raises(RpcFailure, match=r"LABELS tensor must have shape \[batch, 6\]"):
        decode_push(io(2, 4), request(stage_pb2.LABELS, labels[:, 0]))


def test_two_gpt_stages_with_micro_batches_equal_one_full_batch_step() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 7, (4, 6), generator=g), torch.randint(0, 7, (4, 6), generator=g)
    stages = [
        StageRuntime(
            build_layers(SPEC, a, b, seed=2),
            optimizer=SGD,
            is_first=a == 0,
            is_last=b == SPEC.num_layers,
            input_layout=SPEC.input_layout(a),
            max_micro_batch_size=4,
            device=torch.device("cpu"),
        )
        for a, b in [(0, 2), (2, 4)]
    ]
    first, last = stages
    loss_sum, correct = 0.0, 0
    for m, (xm, ym) in enumerate(zip(x.tensor_split(2), y.tensor_split(2), strict=True)):
        hidden = first.forward((1, m), xm)
        s, c = last.forward_loss((1, m), hidden, ym, batch_size=4)
        loss_sum, correct = loss_sum + s, correct + c
        first.backward((1, m), last.backward((1, m)))
    for stage in stages:
        stage.optimizer_step()

    reference = build_full_model(SPEC, seed=2)
    logits = reference(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert loss_sum / y.numel() == pytest.approx(loss.item(), rel=1e-6)
    assert correct == int((logits.argmax(-1) == y).sum())
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    got = {**first.named_weights(), **last.named_weights()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got[f"layers.{name}"], param.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected int64 input"):
        first.eval_forward(x.float())

