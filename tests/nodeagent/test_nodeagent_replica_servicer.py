"""What a joining replica checks after it loads a live replica's state (nodeagent/replica_servicer.py): the digest
of its own state, written in the copied file's tensor order, equals the copied file's exactly when it holds every
tensor bit for bit, whatever order its optimizer keeps its entries in."""

from __future__ import annotations

import hashlib

import pytest
import torch

from arceus.checkpoint import decode_checkpoint, state_chunks
from arceus.contracts.assignment import OptimizerConfig
from nodeagent.replica_servicer import state_digest
from nodeagent.runtime import StageRuntime
from tests.nodeagent.test_nodeagent_runtime import runtime

OPTIMIZERS = [OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), OptimizerConfig(name="adam", lr=0.01)]


def snapshot(stage: StageRuntime) -> bytes:
    """The state file Snapshot streams."""
    _, chunks = state_chunks(dict(stage.state_items(include_optimizer_state=True)))
    return b"".join(bytes(chunk) for chunk in chunks)


def trained(optimizer: OptimizerConfig) -> StageRuntime:
    stage = runtime(0, 2, optimizer)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 8, generator=g), torch.randint(0, 4, (10,), generator=g)
    stage.forward_loss((1, 0), x, y, 10)
    stage.backward((1, 0), None)
    stage.optimizer_step()
    return stage


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_joiner_that_loaded_its_peers_state_holds_its_digest(optimizer: OptimizerConfig) -> None:
    data = snapshot(trained(optimizer))
    joiner = runtime(0, 2, optimizer)
    joiner.load_state_tensors(decode_checkpoint(data))
    assert state_digest(joiner, order=data) == hashlib.sha256(data).hexdigest()
    # one bit off in one tensor, and the digests differ
    with torch.no_grad():
        weight = next(joiner.layers.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
    assert state_digest(joiner, order=data) != hashlib.sha256(data).hexdigest()


def test_a_joiner_without_its_peers_optimizer_state_does_not_hold_its_digest() -> None:
    optimizer = OPTIMIZERS[0]
    data = snapshot(trained(optimizer))
    joiner = runtime(0, 2, optimizer)
    joiner.load_state_tensors({k: v for k, v in decode_checkpoint(data).items() if not k.startswith("optimizer.")})
    assert state_digest(joiner, order=data) != hashlib.sha256(data).hexdigest()
