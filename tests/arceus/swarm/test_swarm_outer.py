"""Replicas that sync every H steps (DiLoCo): the `replica_sync` option's checks, and the outer step every replica
applies from the members' sum, which leaves them equal and moves the anchor by Nesterov SGD."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from arceus.contracts.assignment import Assignment
from arceus.contracts.replica_sync import ReplicaSync, replica_sync_from_json
from arceus.errors import SpecError
from arceus.model.expected_state import optimizer_kind
from arceus.model.optimizers import make_optimizer
from arceus.swarm.exchange import reduce_in_order
from arceus.swarm.outer import OuterSync, sync_elements
from devtools.pipeline import replicated_pipeline_assignments


def test_replica_sync_defaults_to_exact_and_reads_every_h_steps() -> None:
    assert replica_sync_from_json(None) == ReplicaSync() == replica_sync_from_json({"every_steps": 1})
    assert ReplicaSync().exact and ReplicaSync().to_json() == {"every_steps": 1}
    sync = replica_sync_from_json({"every_steps": 4, "outer_lr": 0.5})
    assert (sync.every_steps, sync.outer_lr, sync.outer_momentum, sync.exact) == (4, 0.5, 0.9, False)
    assert [s for s in range(1, 10) if sync.syncs_at(s)] == [4, 8]
    assert replica_sync_from_json(sync.to_json()) == sync


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ([4], "replica_sync", "must be an object"),
        ({"every": 4}, "replica_sync.every", "unknown field"),
        ({"every_steps": 0}, "replica_sync.every_steps", "1: exact"),
        ({"every_steps": 2.5}, "replica_sync.every_steps", "integer"),
        ({"every_steps": True}, "replica_sync.every_steps", "integer"),
        ({"every_steps": 1, "outer_lr": 0.7}, "replica_sync.outer_lr", "every_steps > 1"),
        ({"every_steps": 8, "outer_lr": 0}, "replica_sync.outer_lr", "(0, 10]"),
        ({"every_steps": 8, "outer_lr": float("nan")}, "replica_sync.outer_lr", "(0, 10]"),
        ({"every_steps": 8, "outer_momentum": 1.0}, "replica_sync.outer_momentum", "[0, 1)"),
    ],
)
def test_replica_sync_refuses_bad_settings_naming_the_field(value: object, field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        replica_sync_from_json(value)
    assert info.value.field == field and words in info.value.message


def _assignments(replica_sync: dict[str, object] | None) -> list[dict[str, object]]:
    stages = replicated_pipeline_assignments(
        job_id="j", model_config={"type": "mlp", "layer_sizes": [4, 8, 3]}, boundaries=[0, 2],
        addresses=[["127.0.0.1:1", "127.0.0.1:2"]], optimizer={"name": "sgd", "lr": 0.1}, seed=0, micro_batches=2,
        max_micro_batch_size=4, replica_sync=replica_sync,
    )
    return stages[0]


def test_an_assignment_carries_replica_sync_for_replicas_only() -> None:
    exact, every = _assignments(None)[0], _assignments({"every_steps": 3})[1]
    assert "replica_sync" not in exact and Assignment.from_json(exact).replica_sync.exact
    assert Assignment.from_json(every).replica_sync == ReplicaSync(every_steps=3)
    alone = {key: value for key, value in every.items() if key != "replica"}
    with pytest.raises(SpecError) as info:
        Assignment.from_json(alone)
    assert info.value.field == "assignment.replica_sync" and "replicated stage only" in info.value.message


def _replica(seed: int, optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same weights on every replica
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    inner = make_optimizer(list(model.parameters()), optimizer, 0.05, momentum=0.9, weight_decay=0.0)
    torch.manual_seed(seed)  # each replica's own data
    for _ in range(3):
        inner.zero_grad()
        model(torch.randn(4, 5)).square().sum().backward()
        inner.step()
    return model, inner


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_replicas_leave_a_sync_equal_with_the_outer_nesterov_step(optimizer: str) -> None:
    config = ReplicaSync(every_steps=3, outer_lr=0.7, outer_momentum=0.9)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).parameters()]
    replicas = []
    for seed in (1, 2, 3):
        model, inner = _replica(seed, optimizer)
        sync = OuterSync(list(model.parameters()), inner, config)
        for anchor, p0 in zip(sync.anchor, start, strict=True):
            anchor.copy_(p0)  # the weights at the last sync, before the three local steps
        replicas.append((model, inner, sync))
    vectors = {k: sync.local_vector() for k, (_, _, sync) in enumerate(replicas)}
    kind = optimizer_kind(optimizer, 0.9)
    assert all(len(v) == sync_elements(sum(p.numel() for p in start), kind) for v in vectors.values())
    local = [[p.detach().clone() for p in model.parameters()] for model, _, _ in replicas]
    summed = reduce_in_order(vectors)
    for _, _, sync in replicas:
        sync.apply(summed, len(replicas))

    # Nesterov SGD (first step: momentum buffer = the gradient) on the start with gradient start - mean.
    for p0, after, *weights in zip(start, replicas[0][0].parameters(), *local, strict=True):
        g = p0 - sum(weights) / 3
        torch.testing.assert_close(after.detach(), p0 - 0.7 * (g + 0.9 * g), rtol=1e-5, atol=1e-6)
    states = [
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                  + [t.reshape(-1) for p in model.parameters() for t in inner.state[p].values() if t.dim()])
        for model, inner, _ in replicas
    ]
    assert all(torch.equal(states[0], s) for s in states[1:])  # the same bits on every replica
    with pytest.raises(ValueError, match="syncs"):
        replicas[0][2].apply(summed[:-1], 3)
    with pytest.raises(ValueError, match="no outer optimizer"):
        OuterSync(list(replicas[0][0].parameters()), replicas[0][1], ReplicaSync())


def test_a_sync_sets_every_replicas_floating_point_buffers_to_their_mean() -> None:
    """BatchNorm's running statistics, which each replica's own micro-batches moved, are averaged like the
    optimizer state; its batch count (an integer, the same on every replica) is not sent."""
    config = ReplicaSync(every_steps=2)
    replicas = []
    for seed in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
        inner = make_optimizer(list(model.parameters()), "sgd", 0.05, momentum=0.0, weight_decay=0.0)
        sync = OuterSync(list(model.parameters()), inner, config, list(model.buffers()))
        torch.manual_seed(seed)
        for _ in range(2):
            inner.zero_grad()
            model(torch.randn(6, 5)).square().sum().backward()
            inner.step()
        replicas.append((model, sync))
    norms = [model[1] for model, _ in replicas]
    mean, var = (sum(getattr(n, key).clone() for n in norms) / 2 for key in ("running_mean", "running_var"))
    assert not torch.equal(norms[0].running_mean, norms[1].running_mean)
    vectors = {k: sync.local_vector() for k, (_, sync) in enumerate(replicas)}
    parameters = sum(p.numel() for p in replicas[0][0].parameters())
    assert all(len(v) == sync_elements(parameters, "sgd", buffer_elements=8) for v in vectors.values())
    summed = reduce_in_order(vectors)
    for _, sync in replicas:
        sync.apply(summed, 2)
    for norm in norms:
        torch.testing.assert_close(norm.running_mean, mean)
        torch.testing.assert_close(norm.running_var, var)
        assert int(norm.num_batches_tracked) == 2
    assert torch.equal(norms[0].running_mean, norms[1].running_mean)
    assert torch.equal(norms[0].running_var, norms[1].running_var)
