from __future__ import annotations

import pytest
import torch

from arceus.contracts.transfer import TransferConfig, transfer_config_from_json
from arceus.errors import SpecError
from arceus.v1 import stage_pb2
from arceus.wire.codec import TensorValidationError
from arceus.wire.compression import decode_payload
from arceus.wire.proto_tensor import encoded_to_proto, from_proto, to_proto
from arceus.wire.transfer import TransferEncoder


def test_defaults_and_round_trip() -> None:
    assert transfer_config_from_json(None) == transfer_config_from_json({}) == TransferConfig()
    config = transfer_config_from_json({"activations": "int8", "gradients": "topk", "block_size": 128, "topk_ratio": 1})
    assert config == TransferConfig("int8", "topk", 128, 1.0)
    assert transfer_config_from_json(config.to_json()) == config


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([], "transfer"),
        ({"activations": "topk"}, "transfer.activations"),
        ({"gradients": "int4"}, "transfer.gradients"),
        ({"block_size": 4}, "transfer.block_size"),
        ({"block_size": 64.0}, "transfer.block_size"),
        ({"topk_ratio": 0}, "transfer.topk_ratio"),
        ({"topk_ratio": 1.5}, "transfer.topk_ratio"),
        ({"topk_ratio": True}, "transfer.topk_ratio"),
        ({"compress": True}, "transfer.compress"),
    ],
)
def test_bad_settings_name_their_field(value: object, field: str) -> None:
    with pytest.raises(SpecError) as info:
        transfer_config_from_json(value)
    assert info.value.field == field


def test_encoder_uses_error_feedback_per_stream_for_topk_gradients() -> None:
    encoder = TransferEncoder(TransferConfig(activations="int8", gradients="topk", topk_ratio=0.5))
    assert encoder.encode(torch.ones(64), gradient=False, stream=0).encoding == "int8"
    g = torch.tensor([4.0, 3.0, 2.0, 1.0])
    first = decode_payload(encoder.encode(g, gradient=True, stream=0))
    assert torch.equal(first, torch.tensor([4.0, 3.0, 0.0, 0.0]))
    # another stream has no residual yet; the same stream sends what it dropped last time
    assert torch.equal(decode_payload(encoder.encode(g, gradient=True, stream=1)), first)
    assert torch.equal(decode_payload(encoder.encode(g, gradient=True, stream=0)), torch.tensor([4.0, 0.0, 4.0, 0.0]))


def test_fp32_message_is_byte_identical_to_the_plain_path() -> None:
    x = torch.randn(8, 16)
    encoder = TransferEncoder(TransferConfig())
    plain = to_proto(x).SerializeToString()
    assert encoded_to_proto(encoder.encode(x, gradient=False, stream=0)).SerializeToString() == plain
    assert encoded_to_proto(encoder.encode(x, gradient=True, stream=0)).SerializeToString() == plain


@pytest.mark.parametrize("encoding", ["fp16", "bf16", "int8", "topk"])
def test_compressed_messages_survive_serialization(encoding: str) -> None:
    x = torch.randn(8, 100)
    config = TransferConfig(activations="fp32", gradients=encoding, block_size=32)
    encoded = TransferEncoder(config).encode(x, gradient=True, stream=0)
    message = stage_pb2.Tensor.FromString(encoded_to_proto(encoded).SerializeToString())
    nbytes = len(message.data) + len(message.scales) + len(message.indices)
    assert message.encoding == encoding and nbytes == encoded.nbytes
    assert torch.equal(from_proto(message), decode_payload(encoded))
    assert nbytes < 4 * x.numel() / (1.9 if encoding.endswith("16") else 3.5)


def test_from_proto_refuses_mixed_up_fields() -> None:
    with pytest.raises(TensorValidationError, match="only float32"):
        from_proto(stage_pb2.Tensor(dtype="int64", shape=[2], data=b"\x00" * 2, encoding="int8", block_size=8,
                                    scales=b"\x00" * 4))
    with pytest.raises(TensorValidationError, match="without an encoding"):
        from_proto(stage_pb2.Tensor(dtype="float32", shape=[1], data=b"\x00" * 4, scales=b"\x00" * 4))
