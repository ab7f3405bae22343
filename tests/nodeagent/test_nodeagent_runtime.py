from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arceus.checkpoint import decode_checkpoint, encode_checkpoint
from arceus.contracts.assignment import Assignment, CheckpointRef, OptimizerConfig
from arceus.model.build import build_full_model, build_layers
from arceus.model.mlp.spec import MLPSpec
from arceus.safetensors_file import CheckpointError
from devtools.pipeline import certificates_for, rank_credentials
from nodeagent.runtime import StageRuntime
from nodeagent.stage import build_hosted_stage

SPEC = MLPSpec((8, 16, 4))
SGD = OptimizerConfig(name="sgd", lr=0.1)


def runtime(start: int, end: int, optimizer: OptimizerConfig = SGD, precision: str = "fp32") -> StageRuntime:
    return StageRuntime(
        build_layers(SPEC, start, end, seed=1),
        optimizer=optimizer,
        is_first=start == 0,
        is_last=end == SPEC.num_layers,
        input_layout=SPEC.input_layout(start),
        max_micro_batch_size=10,
        device=torch.device("cpu"),
        precision=precision,
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(10, 8, generator=g), torch.randint(0, 4, (10,), generator=g)


def test_two_stages_with_micro_batches_equal_one_full_batch_step() -> None:
    x, y = batch()
    first, last = runtime(0, 1), runtime(1, 2)
    losses = []
    for m, (xm, ym) in enumerate(zip(x.tensor_split(3), y.tensor_split(3), strict=True)):
        hidden = first.forward((1, m), xm)
        losses.append(last.forward_loss((1, m), hidden, ym, batch_size=len(x)))
    for m in reversed(range(3)):
        grad = last.backward((1, m))
        assert grad is not None and grad.shape == (len(x.tensor_split(3)[m]), 16)
        assert first.backward((1, m), grad) is None  # the first stage has nobody to send to
    first.optimizer_step()
    last.optimizer_step()

    reference = build_full_model(SPEC, seed=1)
    logits = reference(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    assert abs(sum(s for s, _ in losses) / len(x) - loss.item()) < 1e-6
    assert sum(c for _, c in losses) == int((logits.argmax(1) == y).sum())
    weights = {**first.named_weights(), **last.named_weights()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(weights[f"layers.{name}"], param.detach(), rtol=1e-6, atol=1e-7)


def test_learning_rate_override_and_counters() -> None:
    x, y = batch()
    stage = runtime(0, 2)
    before = stage.named_weights()["layers.0.bias"]
    stage.forward_loss((1, 0), x, y, batch_size=10)
    stage.backward((1, 0))
    stage.optimizer_step(learning_rate=0.0)  # 0 keeps the configured lr
    assert not torch.equal(stage.named_weights()["layers.0.bias"], before)
    assert stage.optimizer.param_groups[0]["lr"] == 0.1
    stage.forward_loss((2, 0), x, y, batch_size=10)
    stage.backward((2, 0))
    stage.optimizer_step(learning_rate=0.5)
    assert stage.optimizer.param_groups[0]["lr"] == 0.5
    assert (stage.counters.samples, stage.counters.micro_batches) == (20, 2)
    assert stage.counters.compute_seconds > 0


def test_eval_keeps_no_graph_and_changes_nothing() -> None:
    x, y = batch()
    stage = runtime(0, 2)
    before = stage.named_weights()
    loss_sum, correct = stage.eval_loss(x, y)
    out = runtime(0, 1).eval_forward(x)
    assert not out.requires_grad and out.shape == (10, 16)
    assert loss_sum > 0 and 0 <= correct <= 10
    assert all(torch.equal(before[k], v) for k, v in stage.named_weights().items())


def test_abort_step_drops_graphs_and_partial_gradients() -> None:
    x, y = batch()
    stage = runtime(0, 2, OptimizerConfig(name="adam", lr=0.01))
    stage.forward_loss((1, 0), x, y, batch_size=10)
    stage.backward((1, 0))
    stage.forward_loss((1, 1), x, y, batch_size=10)
    stage.abort_step()
    assert all(p.grad is None for p in stage.layers.parameters())
    assert not stage._pending


def test_inputs_are_checked_against_the_stage() -> None:
    stage = runtime(1, 2)
    with pytest.raises(ValueError, match=r"expected input of shape \[batch, 16\], got \[2, 8\]"):
        stage.eval_forward(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="this stage takes 1 to 10"):
        stage.forward((1, 0), torch.zeros(11, 16))
    first = runtime(0, 1)
    first.forward((1, 0), torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"gradient of shape \[3, 16\] for an output of shape \[2, 16\]"):
        first.backward((1, 0), torch.zeros(3, 16))


# --- checkpoints: state_tensors / load_state_tensors ---------------------------------------------
SGD_MOMENTUM = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
ADAM = OptimizerConfig(name="adam", lr=0.01, weight_decay=0.01)
ADAM8BIT = OptimizerConfig(name="adam8bit", lr=0.01, weight_decay=0.01)
OPTIMIZER_ENTRIES = {
    "sgd": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"},
    "adam8bit": {"step", "state1", "state2", "absmax1", "absmax2"},
}


def seeded_runtime(start: int, end: int, optimizer: OptimizerConfig, seed: int) -> StageRuntime:
    return StageRuntime(
        build_layers(SPEC, start, end, seed=seed),
        optimizer=optimizer,
        is_first=start == 0,
        is_last=end == SPEC.num_layers,
        input_layout=SPEC.input_layout(start),
        max_micro_batch_size=10,
        device=torch.device("cpu"),
    )


def pipeline(optimizer: OptimizerConfig, seed: int = 1) -> list[StageRuntime]:
    return [seeded_runtime(0, 1, optimizer, seed), seeded_runtime(1, 2, optimizer, seed)]


def train_step(stages: list[StageRuntime], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)  # a different batch every step
    x, y = torch.randn(10, 8, generator=g), torch.randint(0, 4, (10,), generator=g)
    for m, (xm, ym) in enumerate(zip(x.tensor_split(2), y.tensor_split(2), strict=True)):
        h = xm
        for stage in stages[:-1]:
            h = stage.forward((step, m), h)
        stages[-1].forward_loss((step, m), h, ym, batch_size=len(x))
    for m in range(2):
        grad = None
        for stage in reversed(stages):
            grad = stage.backward((step, m), grad)
    for stage in stages:
        stage.optimizer_step()


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_fresh_runtime_has_weights_only_and_state_tensors_are_copies() -> None:
    stage = seeded_runtime(1, 2, SGD_MOMENTUM, seed=1)
    state = stage.state_tensors()
    assert set(state) == {"layers.1.weight", "layers.1.bias"}  # model-wide names, no optimizer state yet
    state["layers.1.bias"].add_(1.0)
    assert not torch.equal(stage.named_weights()["layers.1.bias"], state["layers.1.bias"])


@pytest.mark.parametrize("optimizer", [SGD_MOMENTUM, ADAM, ADAM8BIT], ids=["sgd-momentum", "adam", "adam8bit"])
def test_a_runtime_restored_from_state_tensors_continues_exactly_like_the_original(
    optimizer: OptimizerConfig,
) -> None:
    original = pipeline(optimizer)
    for step in (1, 2):
        train_step(original, step)
    saved = [decode_checkpoint(encode_checkpoint(stage.state_tensors())) for stage in original]
    for index, state in enumerate(saved):
        entries = {k for k in state if k.startswith("optimizer.")}
        params = [f"layers.{index}.weight", f"layers.{index}.bias"]
        assert entries == {f"optimizer.{p}.{e}" for p in params for e in OPTIMIZER_ENTRIES[optimizer.name]}

    resumed = pipeline(optimizer, seed=2)  # other initial weights: everything must come from the checkpoint
    for stage, state in zip(resumed, saved, strict=True):
        stage.load_state_tensors(state)
    for a, b in zip(original, resumed, strict=True):
        assert_same_tensors(a.state_tensors(), b.state_tensors())
    # Only the weights, without the optimizer state: the next steps differ (the state matters).
    weights_only = pipeline(optimizer, seed=2)
    for stage, state in zip(weights_only, saved, strict=True):
        stage.load_state_tensors({k: v for k, v in state.items() if not k.startswith("optimizer.")})

    for step in (3, 4):
        for stages in (original, resumed, weights_only):
            train_step(stages, step)
    for a, b, c in zip(original, resumed, weights_only, strict=True):
        assert_same_tensors(a.state_tensors(), b.state_tensors())
        without_state = c.named_weights()
        assert all(not torch.equal(w, without_state[name]) for name, w in a.named_weights().items())


def trained_stage(optimizer: OptimizerConfig = SGD_MOMENTUM) -> StageRuntime:
    stage = seeded_runtime(0, 2, optimizer, seed=1)
    train_step([stage], 1)
    return stage


def bad(changes: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The state of a trained stage with entries replaced (or, with None, removed)."""
    state = trained_stage().state_tensors()
    for name, value in changes.items():
        if value is None:
            del state[name]
        else:
            state[name] = value
    return state


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        pytest.param(bad({"layers.0.bias": None}), r"missing \['layers.0.bias'\], unexpected \[\]", id="missing"),
        pytest.param(
            bad({"layers.2.weight": torch.zeros(4, 4)}), r"missing \[\], unexpected \['layers.2.weight'\]", id="extra"
        ),
        pytest.param(
            seeded_runtime(1, 2, SGD_MOMENTUM, seed=1).state_tensors(),
            r"missing \['layers.0.bias', 'layers.0.weight'\], unexpected \[\]",
            id="another-stage",
        ),
        pytest.param(
            bad({"layers.0.weight": torch.zeros(16, 4)}),
            r"layers.0.weight is torch.float32 \[16, 4\]; this stage has torch.float32 \[16, 8\]",
            id="shape",
        ),
        pytest.param(
            bad({"layers.1.bias": torch.zeros(4, dtype=torch.float64)}),
            r"layers.1.bias is torch.float64 \[4\]; this stage has torch.float32 \[4\]",
            id="dtype",
        ),
        pytest.param(
            bad({"optimizer.layers.7.weight.momentum_buffer": torch.zeros(4)}),
            "optimizer entry optimizer.layers.7.weight.momentum_buffer names no parameter of this stage",
            id="optimizer-name",
        ),
        pytest.param(
            bad({"optimizer.layers.1.weight.momentum_buffer": torch.zeros(16, 4)}),
            r"optimizer.layers.1.weight.momentum_buffer is \[16, 4\]; parameter layers.1.weight is \[4, 16\]",
            id="optimizer-shape",
        ),
        pytest.param(
            trained_stage(ADAM).state_tensors(),
            r"has \['exp_avg', 'exp_avg_sq', 'step'\]; this stage's sgd-momentum optimizer keeps \['momentum_buffer'\]",
            id="another-optimizer",
        ),
    ],
)
def test_a_mismatched_checkpoint_is_refused_and_changes_nothing(tensors: dict, message: str) -> None:
    stage = trained_stage()
    train_step([stage], 2)  # its own state now differs from the one `tensors` was made from
    before = stage.state_tensors()
    with pytest.raises(ValueError, match=message):
        stage.load_state_tensors(tensors)
    assert_same_tensors(stage.state_tensors(), before)
    # And it still trains.
    train_step([stage], 3)


def test_loading_replaces_optimizer_state_rather_than_merging() -> None:
    source = seeded_runtime(0, 2, ADAM, seed=1)  # never stepped: weights only, no optimizer state
    target = trained_stage(ADAM)
    target.load_state_tensors(source.state_tensors())
    assert_same_tensors(target.state_tensors(), source.state_tensors())
    assert not target.optimizer.state  # Adam starts its moments (and step count) from zero again


def test_uploaded_weights_in_bf16_or_fp16_widen_exactly_and_a_checkpoint_may_not() -> None:
    """A Hugging Face checkpoint's half-precision weights (the job's uploaded initial weights) load into the fp32
    stage as exactly the values they hold; a checkpoint of the stage's own is its dtype or refused."""
    for half in (torch.bfloat16, torch.float16):
        weights = {k: t.to(half) for k, t in seeded_runtime(0, 2, ADAM, seed=3).state_tensors().items()}
        stage = seeded_runtime(0, 2, ADAM, seed=1)
        with pytest.raises(ValueError, match=f"layers.0.weight is {half} \\[16, 8\\]; this stage has torch.float32"):
            stage.load_state_tensors(weights)
        stage.load_state_tensors(weights, widen=True)
        assert_same_tensors(stage.state_tensors(), {k: t.float() for k, t in weights.items()})
        train_step([stage], 1)  # and it trains in fp32
        assert all(t.dtype == torch.float32 for t in stage.state_tensors().values() if t.dim())
    wider = {k: t.double() for k, t in seeded_runtime(0, 2, ADAM, seed=3).state_tensors().items()}
    with pytest.raises(ValueError, match="is torch.float64"):  # widening only: nothing is narrowed
        seeded_runtime(0, 2, ADAM, seed=1).load_state_tensors(wider, widen=True)


# --- build_hosted_stage with a checkpoint --------------------------------------------------------
def middle_assignment(checkpoint: dict | None) -> Assignment:
    spec = MLPSpec((8, 16, 16, 4))
    return Assignment.from_json(
        {
            "stage_id": "j-stage-1",
            "job_id": "j",
            "stage_index": 1,
            "num_stages": 3,
            "generation": 4,
            "model": {"type": "mlp", "layer_sizes": list(spec.layer_sizes)},
            "layer_start": 1,
            "layer_end": 2,
            "seed": 5,
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "micro_batches": 2,
            "max_micro_batch_size": 5,
            "prev_address": "127.0.0.1:1",
            "next_address": "127.0.0.1:2",
            "credentials": rank_credentials("job", 4, 1, 0, [1, 1, 1]).to_json(),
            "certificates": certificates_for(["127.0.0.1:1", "127.0.0.1:2"]),
            "checkpoint": checkpoint,
        }
    )


REF = {"step": 40, "url": "/api/agent/checkpoints/abc", "sha256": "ab" * 32}


def middle_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(16, 16, generator=g), torch.randn(16, generator=g)
    return {
        "layers.1.weight": weight,
        "layers.1.bias": bias,
        "optimizer.layers.1.weight.momentum_buffer": torch.full((16, 16), 0.25),
        "optimizer.layers.1.bias.momentum_buffer": torch.full((16,), -0.5),
    }


def test_build_hosted_stage_loads_the_named_checkpoint() -> None:
    asked: list[CheckpointRef] = []

    def loader(ref: CheckpointRef) -> dict[str, torch.Tensor]:
        asked.append(ref)
        return middle_state()

    stage = build_hosted_stage(
        middle_assignment(REF), torch.device("cpu"), max_message_bytes=2**20, load_checkpoint=loader
    )
    try:
        assert asked == [CheckpointRef(step=40, url="/api/agent/checkpoints/abc", sha256="ab" * 32)]
        assert_same_tensors(stage.runtime.state_tensors(), middle_state())
    finally:
        stage.close()


def test_build_hosted_stage_without_a_checkpoint_starts_from_the_seed_and_fetches_nothing() -> None:
    def loader(ref: CheckpointRef) -> dict[str, torch.Tensor]:
        raise AssertionError("no checkpoint to fetch")

    stage = build_hosted_stage(
        middle_assignment(None), torch.device("cpu"), max_message_bytes=2**20, load_checkpoint=loader
    )
    try:
        seeded = build_layers(MLPSpec((8, 16, 16, 4)), 1, 2, seed=5)
        assert_same_tensors(stage.runtime.state_tensors(), {f"layers.{k}": v for k, v in seeded.state_dict().items()})
    finally:
        stage.close()


def test_build_hosted_stage_with_a_checkpoint_needs_a_loader() -> None:
    with pytest.raises(ValueError, match="j-stage-1 resumes from a checkpoint, but this agent cannot fetch one"):
        build_hosted_stage(middle_assignment(REF), torch.device("cpu"), max_message_bytes=2**20)


def test_build_hosted_stage_passes_on_a_bad_checkpoint() -> None:
    def corrupt(ref: CheckpointRef) -> dict[str, torch.Tensor]:
        return decode_checkpoint(b"not safetensors", sha256=ref.sha256)

    with pytest.raises(CheckpointError, match="corrupt or replaced"):
        build_hosted_stage(
            middle_assignment(REF), torch.device("cpu"), max_message_bytes=2**20, load_checkpoint=corrupt
        )

    def other_stage(ref: CheckpointRef) -> dict[str, torch.Tensor]:
        return {k.replace("layers.1.", "layers.0."): v for k, v in middle_state().items()}

    with pytest.raises(ValueError, match="checkpoint does not match this stage"):
        build_hosted_stage(
            middle_assignment(REF), torch.device("cpu"), max_message_bytes=2**20, load_checkpoint=other_stage
        )


def test_bf16_stages_compute_under_autocast_and_exchange_float32() -> None:
    x, y = batch()
    fp32, bf16 = runtime(0, 1), runtime(0, 1, precision="bf16")
    hidden32, hidden16 = fp32.forward((1, 0), x), bf16.forward((1, 0), x)
    # What a bf16 stage sends is float32 (the wire and the next stage's checks expect it), rounded as bf16
    # matmuls round: close to the fp32 stage's output, and not equal to it.
    assert hidden16.dtype == torch.float32
    assert not torch.equal(hidden16, hidden32)
    torch.testing.assert_close(hidden16, hidden32, rtol=2e-2, atol=2e-2)
    assert torch.equal(hidden16.to(torch.bfloat16).float(), hidden16)

    last = runtime(1, 2, precision="bf16")
    loss_sum, _ = last.forward_loss((1, 0), hidden16, y, batch_size=len(x))
    grad = last.backward((1, 0))
    assert grad is not None and grad.dtype == torch.float32 and grad.shape == hidden16.shape
    assert bf16.backward((1, 0), grad) is None
    # Weights and optimizer state stay float32, and the step moves them.
    before = bf16.named_weights()
    bf16.optimizer_step()
    for name, weight in bf16.named_weights().items():
        assert weight.dtype == torch.float32 and not torch.equal(weight, before[name])
    assert loss_sum > 0
