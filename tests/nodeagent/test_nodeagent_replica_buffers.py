"""Replicas of a model with BatchNorm and dropout (a developer's module captured as an exported model: the
architecture whose layers have buffers and draw random numbers) train like one process on the same micro-batches.

The stages are the agents' `StageRuntime`s, rebuilt from the shipped program: 2 stages, of 2 and 3 replicas,
4 micro-batches a step (not divisible by 3), each micro-batch's forward and backward on the replicas its route
names (SGD keeping activations; Adam recomputing them in the backward); each stage's replicas then replace their
partial vectors (gradients, buffer changes and micro-batch count) with their ascending sum, which the exchange
computes (tests/nodeagent/test_nodeagent_replicas.py). Losses, weights and buffers equal
`devtools.reference.micro_batched_run` (one process) to 1e-5, and the replicas of a stage hold the same bits
(weights, optimizer state, buffers) after every step. A joiner's copy of a sibling's state carries the buffers, and so
do a stage's checkpoints and its state digest; a RunStep's draws follow its training step, not its call id; and a
sibling recomputing a replica's partial vector for an audit draws the same masks and starts from the same buffers."""

from __future__ import annotations

import copy
import io
import json
import threading
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load as safetensors_load
from torch import nn

from arceus.checkpoint import decode_checkpoint, encode_checkpoint
from arceus.contracts.assignment import Assignment, InitialWeightsRef, OptimizerConfig
from arceus.model.buffers import persistent_buffers
from arceus.model.build import build_layers
from arceus.model.expected_state import expected_stage_state, optimizer_kind, stage_file_check
from arceus.model.exported.capture import CapturedModel, capture
from arceus.model.exported.program import program_layers
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import StageStateError
from arceus.swarm.exchange import exchange_elements
from arceus.v1 import stage_pb2
from arceus.verify.receipts import ReceiptSigner
from devtools.pipeline import pipeline_assignments
from devtools.reference import micro_batched_run
from nodeagent.replica_servicer import state_digest
from nodeagent.runtime import StageRuntime
from nodeagent.stage import build_hosted_stage
from nodeagent.step import StepRun

BATCH, MICRO_BATCHES, STEPS, SEED = 16, 4, 4, 11
OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": OptimizerConfig("adam", lr=0.01),
}
STAGES = [(0, 2, 2), (2, 5, 3)]  # (layer_start, layer_end, replicas)


class NormedNet(nn.Module):
    """Digits-shaped rows in, 10 classes out: Linear, BatchNorm, ReLU, Dropout, then again, then a head. (No bias
    before a BatchNorm, as is usual: its gradient would be 0 but for rounding, which Adam divides by its own size.)"""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.25))
        self.mid = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.stem(x)))


@pytest.fixture(scope="module")
def captured() -> CapturedModel:
    torch.manual_seed(0)
    return capture(NormedNet(), torch.randn(BATCH, 64))


_BUILT: dict[tuple[bytes, int, int], nn.Sequential] = {}


def _layers(cap: CapturedModel, start: int, end: int) -> nn.Sequential:
    """Layers [start, end) rebuilt from the shipped bytes alone, as an agent builds them, with the uploaded weights
    (a copy of the ones built the first time: the graphs and buffers of a copy are its own)."""
    key = (cap.program, start, end)
    if key not in _BUILT:
        spec = model_spec_from_config(json.loads(json.dumps(cap.model_config)))
        documents = program_layers(cap.program, [layer.sha256 for layer in spec.layers])
        layers = build_layers(spec.with_documents(dict(enumerate(documents))), start, end, seed=0)
        weights = {k.removeprefix("layers."): v for k, v in safetensors_load(cap.weights).items()
                   if start <= int(k.split(".")[1]) < end}
        layers.load_state_dict(weights, strict=False)  # the buffers come with the program
        _BUILT[key] = layers
    layers = copy.deepcopy(_BUILT[key])
    assert all(layer._graph.get_parameter(name) is param  # the copy's graph computes with the copy's parameters
               for layer in layers for name, param in layer.named_parameters())
    return layers


def _runtime(cap: CapturedModel, start: int, end: int, optimizer: OptimizerConfig, recompute: bool) -> StageRuntime:
    spec = model_spec_from_config(cap.model_config)
    return StageRuntime(
        _layers(cap, start, end), optimizer=optimizer, is_first=start == 0, is_last=end == spec.num_layers,
        input_layout=spec.input_layout(start), max_micro_batch_size=BATCH, device=torch.device("cpu"),
        activation_checkpointing=recompute, seed=SEED,
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, every step (so the loss falls)."""
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)
    return [(x, y)] * STEPS


def _state(runtime: StageRuntime) -> dict[str, torch.Tensor]:
    """Weights, optimizer state and buffers."""
    return dict(runtime.state_items())


@pytest.mark.parametrize(
    ("optimizer", "recompute"), [("sgd", False), ("adam", True)], ids=["sgd-kept", "adam-recomputed"]
)
def test_replicas_with_batchnorm_and_dropout_train_as_one_process(
    captured: CapturedModel, optimizer: str, recompute: bool
) -> None:
    config, batches = OPTIMIZERS[optimizer], _batches()
    stages = [[_runtime(captured, start, end, config, recompute) for _ in range(r)] for start, end, r in STAGES]
    first_buffers = {n: b.clone() for n, b in persistent_buffers(_layers(captured, 0, 5))}
    losses = []
    for step, (x, y) in enumerate(batches, 1):
        # Call ids as the driver's: every RunStep has its own, and the training step seeds the draws.
        key_step, total = 100 + 2 * step, 0.0
        for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, MICRO_BATCHES), torch.tensor_split(y, MICRO_BATCHES),
                                         strict=True)):
            first, last = stages[0][m % len(stages[0])], stages[1][m % len(stages[1])]
            h = first.forward((key_step, m), xm, train_step=step)
            loss_sum, _ = last.forward_loss((key_step, m), h, ym, BATCH, train_step=step)
            total += loss_sum / BATCH
            first.backward((key_step, m), last.backward((key_step, m)))
        for replicas in stages:
            partials = [r.gradient_vector() for r in replicas]
            summed = partials[0].clone()
            for partial in partials[1:]:
                summed.add_(partial)
            for r in replicas:
                r.set_gradient_vector(summed)
                r.optimizer_step()
        losses.append(total)
        for index, replicas in enumerate(stages):
            states = [_state(r) for r in replicas]
            for k, state in enumerate(states[1:], 1):
                assert state.keys() == states[0].keys()
                unequal = [n for n in state if not torch.equal(state[n], states[0][n])]
                assert not unequal, f"step {step}: stage {index} replica {k} differs from replica 0 in {unequal}"

    expected = micro_batched_run(_layers(captured, 0, 5), batches, micro_batches=MICRO_BATCHES, optimizer=config,
                                 seed=SEED)
    for step, (got, want) in enumerate(zip(losses, expected.losses, strict=True), 1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got!r} != {want!r}"
    assert expected.losses[-1] < expected.losses[0]
    weights = {name: t for replicas in stages for name, t in replicas[0].state_tensors().items()
               if not name.startswith(("optimizer.", "buffer."))}
    assert weights.keys() == expected.weights.keys()
    for name, want in expected.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    buffers = {f"layers.{n}": b for replicas in stages for n, b in persistent_buffers(replicas[0].layers)}
    assert buffers.keys() == expected.buffers.keys() and len(buffers) == 6
    for name, want in expected.buffers.items():
        torch.testing.assert_close(buffers[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        if name.endswith("num_batches_tracked"):
            assert int(buffers[name]) == int(first_buffers[name.removeprefix("layers.")]) + STEPS  # once a step
        else:
            assert not torch.equal(buffers[name], first_buffers[name.removeprefix("layers.")]), name  # they moved


def test_the_running_statistics_move_once_a_step_by_the_micro_batches_mean(captured: CapturedModel) -> None:
    """One step of 4 equal micro-batches: BatchNorm's running mean moves as torch's own BatchNorm does in one
    forward over the whole batch, its running variance by the mean of the micro-batches' variances, its batch count
    by 1; an evaluation between steps changes none of them."""
    runtime = _runtime(captured, 0, 2, OPTIMIZERS["sgd"], recompute=False)
    (x, _), *_ = _batches()
    bn_input = runtime.layers[0](x).detach()
    bn = nn.BatchNorm1d(32)
    named = dict(persistent_buffers(runtime.layers))
    with torch.no_grad():
        bn.running_mean.copy_(named["1.stem.1.running_mean"])
        bn.running_var.copy_(named["1.stem.1.running_var"])
    before_var, before_count = bn.running_var.clone(), int(named["1.stem.1.num_batches_tracked"])
    bn.train()(bn_input)  # torch's one forward over the whole batch
    for m, xm in enumerate(torch.tensor_split(x, MICRO_BATCHES)):
        runtime.forward((1, m), xm)
        runtime.backward((1, m), torch.ones(len(xm), 32))
        assert int(named["1.stem.1.num_batches_tracked"]) == before_count  # the buffers wait for the step's end
    runtime.optimizer_step()

    torch.testing.assert_close(named["1.stem.1.running_mean"], bn.running_mean, rtol=1e-6, atol=1e-6)
    variances = torch.stack([part.var(dim=0) for part in torch.tensor_split(bn_input, MICRO_BATCHES)])
    torch.testing.assert_close(named["1.stem.1.running_var"], 0.9 * before_var + 0.1 * variances.mean(dim=0))
    assert int(named["1.stem.1.num_batches_tracked"]) == before_count + 1
    after = {n: b.clone() for n, b in named.items()}
    runtime.eval_forward(x)
    assert all(torch.equal(named[n], after[n]) for n in named)


def test_a_micro_batch_draws_the_same_masks_on_any_replica_and_in_a_recompute(captured: CapturedModel) -> None:
    """Micro-batch 2 of training step 5 on two replicas, under other RunStep ids and other global random states,
    and with its activations recomputed in the backward: the same output and the same input gradient, bit for bit;
    another micro-batch or step draws other masks; the global random state is as if nothing had drawn."""
    (x, _), *_ = _batches()
    xm, grad = x[:4], torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    results = []
    for key_step, recompute, global_seed in ((7, False, 1), (8, True, 2), (30, False, 3)):
        runtime = _runtime(captured, 0, 3, OPTIMIZERS["adam"], recompute)  # layer 2 holds the dropout
        torch.manual_seed(global_seed)
        out = runtime.forward((key_step, 2), xm, train_step=5)
        runtime.backward((key_step, 2), grad)
        results.append((out, runtime.gradient_vector()))
        after = torch.rand(3)
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(3))
    for out, gradients in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(gradients, results[0][1])
    others = [_runtime(captured, 0, 3, OPTIMIZERS["adam"], False) for _ in range(2)]
    assert not torch.equal(others[0].forward((7, 3), xm, train_step=5), results[0][0])  # another micro-batch
    assert not torch.equal(others[1].forward((7, 2), xm, train_step=6), results[0][0])  # another step


def test_a_joiner_copies_a_siblings_buffers_and_then_steps_as_it_does(captured: CapturedModel) -> None:
    """What a sibling's Snapshot holds (weights, optimizer state, buffers) loaded into a fresh replica: the same
    state, bit for bit, and after the next step (the same summed vector) still the same; a snapshot lacking a
    buffer, or with one of another shape, is refused naming it."""
    config = OPTIMIZERS["adam"]
    live, joiner = (_runtime(captured, 0, 2, config, False) for _ in range(2))
    (x, _), *_ = _batches()
    for step in (1, 2):
        live.forward((step, 0), x, train_step=step)
        live.backward((step, 0), torch.ones(len(x), 32))
        live.optimizer_step()
    snapshot = {n: t.clone() for n, t in live.state_items()}
    assert "buffer.layers.1.stem.1.running_mean" in snapshot
    joiner.load_state_tensors(snapshot)
    assert _state(joiner).keys() == _state(live).keys()
    assert all(torch.equal(t, _state(live)[n]) for n, t in _state(joiner).items())
    for runtime in (live, joiner):
        runtime.forward((3, 0), x, train_step=3)
        runtime.backward((3, 0), torch.ones(len(x), 32))
    summed = live.gradient_vector()
    for runtime in (live, joiner):
        runtime.set_gradient_vector(summed)
        runtime.optimizer_step()
    assert all(torch.equal(t, _state(live)[n]) for n, t in _state(joiner).items())

    lacking = {n: t for n, t in snapshot.items() if n != "buffer.layers.1.stem.1.running_var"}
    with pytest.raises(ValueError, match=r"missing \['buffer.layers.1.stem.1.running_var'\]"):
        joiner.load_state_tensors(lacking)
    reshaped = {**snapshot, "buffer.layers.1.stem.1.running_var": torch.ones(3)}
    with pytest.raises(ValueError, match="buffer.layers.1.stem.1.running_var is torch.float32 \\[3\\]"):
        joiner.load_state_tensors(reshaped)


def test_a_runstep_seeds_the_draws_by_its_training_step_not_its_call_id(captured: CapturedModel) -> None:
    """A hosted stage of the whole model runs RunStep as an agent does: two attempts at training step 5 under other
    call ids (a step run again after a lost replica) draw the same masks, so the same losses and weights; step 6
    draws others."""
    documents = program_layers(captured.program, [layer["sha256"] for layer in captured.model_config["layers"]])
    n = len(documents)
    [stage_json] = pipeline_assignments(
        job_id="drops", model_config=captured.model_config, boundaries=[0, n], addresses=["127.0.0.1:1"],
        optimizer={"name": "sgd", "lr": 0.1}, seed=SEED, micro_batches=2, max_micro_batch_size=BATCH,
    )
    assignment = replace(Assignment.from_json(stage_json), program="/program",
                         initial_weights=InitialWeightsRef(url="/weights", layer_sha256=("0" * 64,) * n))
    (x, y), *_ = _batches()

    def attempt(call_id: int, train_step: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        stage = build_hosted_stage(
            assignment, torch.device("cpu"), max_message_bytes=2**20, load_program=lambda _p, a, b: documents[a:b],
            load_initial_weights=lambda _r, _a, _b, _n: safetensors_load(captured.weights),
        )
        try:
            for m, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                stage.mailbox.put((call_id, "ACTIVATION", m), xm)
                stage.mailbox.put((call_id, "LABELS", m), ym)
            request = stage_pb2.RunStepRequest(step=call_id, mode=stage_pb2.TRAIN, num_micro_batches=2,
                                               schedule="gpipe", batch_size=BATCH, train_step=train_step)
            reply = StepRun(stage, request, replicas=None, deadline=time.monotonic() + 60, abort=threading.Event(),
                            signer=ReceiptSigner()).run()
            return list(reply.loss_sums), stage.runtime.named_weights()
        finally:
            stage.close()

    first, again, later = attempt(3, 5), attempt(9, 5), attempt(3, 6)
    assert first[0] == again[0] and first[0] != later[0]
    assert all(torch.equal(t, again[1][name]) for name, t in first[1].items())


def _trained(cap: CapturedModel, start: int, end: int, steps: int = 2) -> StageRuntime:
    """A stage of layers [start, end) after `steps` training steps (its buffers moved from the captured ones)."""
    runtime = _runtime(cap, start, end, OPTIMIZERS["adam"], recompute=False)
    (x, y), *_ = _batches()
    for step in range(1, steps + 1):
        h = _runtime(cap, 0, start, OPTIMIZERS["sgd"], False).layers(x).detach() if start else x
        if runtime.is_last:
            runtime.forward_loss((step, 0), h, y, BATCH, train_step=step)
            runtime.backward((step, 0))
        else:
            out = runtime.forward((step, 0), h, train_step=step)
            runtime.backward((step, 0), torch.ones_like(out))
        runtime.optimizer_step()
    return runtime


def test_a_stages_checkpoint_holds_its_buffers_and_resumes_them(captured: CapturedModel) -> None:
    """The state GetState and SaveState write (a checkpoint) holds the stage's buffers beside its weights and
    optimizer state; the control plane's check, from the spec alone, accepts it and refuses one lacking a buffer; a
    stage resumed from it holds the same state, bit for bit. A checkpoint saved before stages kept buffers still
    loads, as a stage's uploaded initial weights do: the buffers stay as captured."""
    live = _trained(captured, 0, 2)
    state = dict(live.state_items())
    assert {n for n in state if n.startswith("buffer.")} == {
        f"buffer.layers.1.stem.1.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")
    }
    spec = model_spec_from_config(captured.model_config)
    expected = expected_stage_state(spec, stage_index=0, layer_start=0, layer_end=2,
                                    optimizer=optimizer_kind("adam", 0.0))
    data = encode_checkpoint(state)
    stage_file_check(io.BytesIO(data), len(data), expected)
    lacking = encode_checkpoint({n: t for n, t in state.items() if n != "buffer.layers.1.stem.1.running_var"})
    with pytest.raises(StageStateError, match="missing tensor buffer.layers.1.stem.1.running_var: expected float32"):
        stage_file_check(io.BytesIO(lacking), len(lacking), expected)

    resumed = _runtime(captured, 0, 2, OPTIMIZERS["adam"], recompute=False)
    resumed.load_state_tensors(decode_checkpoint(data))
    assert all(torch.equal(t, _state(resumed)[n]) for n, t in _state(live).items())

    old = _runtime(captured, 0, 2, OPTIMIZERS["adam"], recompute=False)
    captured_buffers = {n: b.clone() for n, b in persistent_buffers(old.layers)}
    old.load_state_tensors({n: t for n, t in state.items() if not n.startswith("buffer.")})
    assert all(torch.equal(b, captured_buffers[n]) for n, b in persistent_buffers(old.layers))
    assert all(torch.equal(p, state[n]) for n, p in old.state_items(include_buffers=False))


def test_replicas_whose_buffers_differ_have_different_state_digests(captured: CapturedModel) -> None:
    """The state digest a joiner's copy is checked by (and replicas compare) covers the buffers: two replicas of
    the same weights and optimizer state whose running statistics differ do not digest alike."""
    live = _trained(captured, 0, 2)
    twin = _runtime(captured, 0, 2, OPTIMIZERS["adam"], recompute=False)
    twin.load_state_tensors({n: t.clone() for n, t in live.state_items()})
    order = encode_checkpoint(dict(live.state_items()))
    assert state_digest(twin, order=order) == state_digest(live, order=order)
    dict(persistent_buffers(twin.layers))["1.stem.1.running_mean"].add_(1e-3)
    assert state_digest(twin, order=order) != state_digest(live, order=order)


@pytest.mark.parametrize(("start", "end"), [(0, 3), (2, 5)], ids=["first-stage", "last-stage"])
def test_a_sibling_recomputes_a_replicas_partial_with_the_steps_buffers_and_masks(
    captured: CapturedModel, start: int, end: int
) -> None:
    """Two replicas of a stage with a BatchNorm and a dropout (layer 2), their buffers moved by earlier steps: replica
    A takes micro-batches 1 and 3 of training step 3 (under its own call id), its sibling B micro-batches 0 and 2.
    B's recomputation of A's micro-batches (for an audit) equals A's partial vector (gradients, buffer changes and
    count: as many elements as the driver counts from the spec), and leaves B's own step as it was. With another
    training step (other masks) it differs."""
    a, b = _trained(captured, start, end), _trained(captured, start, end)
    (x, y), *_ = _batches()
    h = _runtime(captured, 0, start, OPTIMIZERS["sgd"], False).layers(x).detach() if start else x
    xs, ys = torch.tensor_split(h, MICRO_BATCHES), torch.tensor_split(y, MICRO_BATCHES)
    grads = [torch.randn(len(xm), 32, generator=torch.Generator().manual_seed(m)) for m, xm in enumerate(xs)]

    def run(runtime: StageRuntime, call: int, micro_batches: list[int]) -> None:
        for m in micro_batches:
            if runtime.is_last:
                runtime.forward_loss((call, m), xs[m], ys[m], BATCH, train_step=3)
                runtime.backward((call, m))
            else:
                runtime.forward((call, m), xs[m], train_step=3)
                runtime.backward((call, m), grads[m])

    run(a, 40, [1, 3])
    run(b, 41, [0, 2])
    partial, own = a.gradient_vector(), b.gradient_vector()
    items = [(m, xs[m], ys[m] if b.is_last else grads[m]) for m in (1, 3)]
    recomputed = b.recompute_partial(items, batch_size=BATCH, train_step=3)

    spec = model_spec_from_config(captured.model_config)
    assert recomputed.shape == partial.shape == (exchange_elements(spec, start, end),)
    assert exchange_elements(spec, start, end) == b.exchange_elements()
    torch.testing.assert_close(recomputed, partial, rtol=1e-5, atol=1e-6)
    assert torch.equal(b.gradient_vector(), own)  # B's own step: its gradients and buffer changes as they were
    assert all(torch.equal(buffer, start_value) for buffer, start_value in zip(b.buffers.buffers, b.buffers.start,
                                                                                   strict=True))
    other_masks = b.recompute_partial(items, batch_size=BATCH, train_step=4)
    assert not torch.allclose(other_masks, partial, rtol=1e-5, atol=1e-6)
