"""A stage's tied weights (nodeagent.tied): what it sends where, what it takes (exactly the copies it lacks, as
fp32 of their shape), and the sum every copy steps with."""

from __future__ import annotations

import pytest
import torch

from arceus.contracts.assignment import Assignment
from arceus.v1 import stage_pb2
from arceus.wire.compression import encode
from arceus.wire.incoming_push import IncomingPush
from arceus.wire.proto_tensor import write_encoded_header
from devtools.pipeline import pipeline_assignments
from nodeagent.rpc import RpcFailure
from nodeagent.tied import TiedGradients

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 2, "d_model": 8, "block_size": 4, "vocab_size": 5,
         "tie_word_embeddings": True}
EMBEDDING, HEAD = "layers.0.wte.weight", "layers.3.lm_head.weight"


def stages(boundaries: list[int]) -> list[Assignment]:
    return [Assignment.from_json(a) for a in pipeline_assignments(
        job_id="job", model_config=MODEL, boundaries=boundaries,
        addresses=[f"127.0.0.1:{5000 + i}" for i in range(len(boundaries) - 1)], optimizer={"name": "sgd", "lr": 0.1},
        seed=0, micro_batches=2, max_micro_batch_size=4,
    )]


def push(copy: int, tensor: torch.Tensor, encoding: str = "fp32") -> IncomingPush:
    header = stage_pb2.PushTensorRequest(kind=stage_pb2.TIED_GRADIENT, step=3, micro_batch=copy)
    encoded = encode(tensor, encoding)
    write_encoded_header(header.tensor, encoded)
    return IncomingPush(header, memoryview(bytes(encoded.data)), memoryview(bytes(encoded.scales)),
                        memoryview(bytes(encoded.indices)))


def test_the_first_and_last_stage_send_each_other_their_copy_and_both_step_with_the_same_sum() -> None:
    first, middle, last = stages([0, 1, 3, 4])
    ends = [TiedGradients(first, first.spec), TiedGradients(last, last.spec)]
    assert [a.tied[0].stage_index for a in (first, last)] == [2, 0] and middle.tied == ()
    assert not TiedGradients(middle, middle.spec)
    grads = {EMBEDDING: torch.randn(5, 8), HEAD: torch.randn(5, 8)}
    sent: list[tuple[int, int, IncomingPush]] = []
    for tied in ends:
        tied.send(grads.__getitem__, lambda to, copy, encoded: sent.append((to, copy, encoded)))
    assert [(to, copy) for to, copy, _ in sent] == [(2, 0), (0, 1)]
    taken = {copy: ends[1 - i].decode(push(copy, grads[name])) for i, (copy, name) in enumerate(
        [(0, EMBEDDING), (1, HEAD)])}
    stepped: dict[str, torch.Tensor] = {}
    for tied in ends:
        tied.sum(grads.__getitem__, taken.__getitem__, stepped.__setitem__)
    assert torch.equal(stepped[EMBEDDING], stepped[HEAD])
    assert torch.equal(stepped[EMBEDDING], grads[EMBEDDING] + grads[HEAD])


def test_one_stage_holding_both_copies_sums_them_itself() -> None:
    (only,) = stages([0, 4])
    tied = TiedGradients(only, only.spec)
    assert only.tied == () and tied.mailbox_slots() == 0
    grads = {EMBEDDING: torch.ones(5, 8), HEAD: torch.full((5, 8), 2.0)}
    stepped: dict[str, torch.Tensor] = {}
    tied.send(grads.__getitem__, lambda *_: pytest.fail("a stage holding every copy pushes nothing"))
    tied.sum(grads.__getitem__, lambda _: pytest.fail("nothing to take"), stepped.__setitem__)
    assert torch.equal(stepped[EMBEDDING], torch.full((5, 8), 3.0)) and torch.equal(stepped[HEAD], stepped[EMBEDDING])


@pytest.mark.parametrize(
    ("copy", "tensor", "encoding", "fragment"),
    [
        (0, torch.zeros(5, 8), "fp32", "expects no tied gradient 0"),  # its own copy
        (1, torch.zeros(8, 5), "fp32", "must be float32 [5, 8]"),
        (1, torch.zeros(5, 8), "bf16", "uncompressed"),
    ],
)
def test_a_push_that_is_not_a_copy_it_lacks_exactly_is_refused(
    copy: int, tensor: torch.Tensor, encoding: str, fragment: str
) -> None:
    first = stages([0, 2, 4])[0]
    with pytest.raises(RpcFailure) as info:
        TiedGradients(first, first.spec).decode(push(copy, tensor, encoding))
    assert fragment in str(info.value)
