"""Any PyTorch model, captured: three models the project did not write for itself (one defined here, a ResNet-18
of torchvision's shape at small width, a Hugging Face GPT-2 built from a config) are captured with torch.export,
cut into layers, shipped as JSON + safetensors, rebuilt from those bytes alone into pipeline stages (the agents'
`StageRuntime`, micro-batched) and trained 10 steps: every step's loss and the final weights match training the
original module in one process to 1e-5 (fp32, SGD with momentum and Adam). A GPT-2 with its default tied embeddings
splits as its untied twin does: the first and last layers each hold a copy, their gradients summed every step. A
graph naming a forbidden operator is refused, with the operator's name, before anything is built."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as safetensors_load
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from arceus import DistributedTrainer
from arceus.contracts.assignment import OptimizerConfig
from arceus.errors import SpecError
from arceus.model.build import build_layers
from arceus.model.exported.capture import CapturedModel, capture
from arceus.model.exported.operators import graph_check
from arceus.model.exported.program import program_layers
from arceus.model.optimizers import make_optimizer
from arceus.model.registry import model_spec_from_config
from arceus.model.spec import ModelSpec
from arceus.model.tied import tied_groups, tied_sum
from arceus.trainer import DeviceClass, Peers
from devtools.foreign_models import GPT2Logits, ResNet18
from devtools.hostile_program import forged_program
from nodeagent.runtime import StageRuntime

STEPS = 10
BATCH = 8
OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": OptimizerConfig("adam", lr=0.01),
}


class ResidualNet(nn.Module):
    """The model defined in the test file: digits-shaped rows in, a residual MLP with LayerNorm, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(torch.tanh(h))


def _digits_rows(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def _images(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def _tokens(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (BATCH, 17), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# name -> (model, batches, input bound, micro-batches).
# The ResNet trains with one micro-batch: BatchNorm normalises over what one forward sees (as in any pipeline).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Any], int | None, int]] = {
    "test-file-net": (ResidualNet, _digits_rows, None, 2),
    "resnet18": (ResNet18, _images, None, 1),
    "hf-gpt2": (lambda: GPT2Logits(vocab_size=50), _tokens, 50, 2),
    "hf-gpt2-tied": (lambda: GPT2Logits(vocab_size=50, tied=True), _tokens, 50, 2),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def captured(request: pytest.FixtureRequest) -> tuple[str, nn.Module, CapturedModel, list[Any]]:
    make, data, bound, _ = MODELS[request.param]
    torch.manual_seed(0)
    module = make()
    generator = torch.Generator().manual_seed(1)
    batches = [data(generator) for _ in range(STEPS)]
    return request.param, module, capture(module, batches[0][0], input_bound=bound), batches


def _reference(module: nn.Module, config: OptimizerConfig, batches: list[Any]) -> tuple[list[float], dict]:
    model = copy.deepcopy(module).train()
    optimizer = make_optimizer(model.parameters(), config.name, config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay)  # the one the stages step with
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def _stages(cap: CapturedModel, config: OptimizerConfig) -> list[StageRuntime]:
    """The model rebuilt from its shipped bytes only, in three stages, as agents build theirs."""
    spec = model_spec_from_config(json.loads(json.dumps(cap.model_config)))
    documents = program_layers(cap.program, [layer.sha256 for layer in spec.layers])
    weights = safetensors_load(cap.weights)
    n = spec.num_layers
    bounds = sorted({0, max(1, n // 3), max(2, 2 * n // 3), n})
    runtimes = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        layers = build_layers(spec.with_documents(dict(enumerate(documents))), start, end, seed=0)
        runtime = StageRuntime(
            layers,
            optimizer=config,
            is_first=index == 0,
            is_last=end == n,
            input_layout=spec.input_layout(start),
            max_micro_batch_size=BATCH,
            device=torch.device("cpu"),
        )
        runtime.load_state_tensors({k: v for k, v in weights.items() if start <= int(k.split(".")[1]) < end})
        runtimes.append(runtime)
    assert len(runtimes) >= 2
    return runtimes


def _holds(runtime: StageRuntime, name: str) -> bool:
    try:
        runtime.layers.get_parameter(name.removeprefix("layers."))
    except AttributeError:
        return False
    return True


def _pipeline(runtimes: list[StageRuntime], batches: list[Any], micro_batches: int, spec: ModelSpec) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches):
        total = 0.0
        for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            key = (step, m)
            for runtime in runtimes[:-1]:
                xm = runtime.forward(key, xm)
            loss_sum, _ = runtimes[-1].forward_loss(key, xm, ym, BATCH)
            total += loss_sum / y.numel()
            grad = runtimes[-1].backward(key)
            for runtime in reversed(runtimes[:-1]):
                grad = runtime.backward(key, grad)
        for group in tied_groups(spec):  # as the agents' TIED_GRADIENT pushes do (nodeagent.tied)
            holder = {m: next(r for r in runtimes if _holds(r, m)) for m in group.members}
            summed = tied_sum([holder[m].parameter_gradient(m) for m in group.members])
            for m in group.members:
                holder[m].set_parameter_gradient(m, summed.clone())
        for runtime in runtimes:
            runtime.optimizer_step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_rebuilt_stages_train_as_the_original_module(
    captured: tuple[str, nn.Module, CapturedModel, list[Any]], optimizer: str
) -> None:
    name, module, cap, batches = captured
    config = OPTIMIZERS[optimizer]
    expected, expected_weights = _reference(module, config, batches)
    runtimes = _stages(cap, config)
    losses = _pipeline(runtimes, batches, MODELS[name][3], model_spec_from_config(cap.model_config))
    assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) <= 1e-5, (losses, expected)
    trained = {cap.names[k]: v for r in runtimes for k, v in r.state_tensors().items() if k in cap.names}
    assert trained.keys() <= expected_weights.keys() and len(trained) == len(list(module.parameters()))
    # Weights to 1e-4: micro-batches sum a gradient in another order, and Adam divides a near-zero gradient
    # by its own size, so a rounding difference in one can move a weight by a fraction of the learning rate.
    assert max((trained[k] - expected_weights[k]).abs().max().item() for k in trained) <= 1e-4
    initial = dict(module.named_parameters(remove_duplicate=False))
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-3  # it trained


def test_a_model_is_cut_at_module_boundaries_into_several_layers(
    captured: tuple[str, nn.Module, CapturedModel, list[Any]],
) -> None:
    """Layers begin where modules begin; a block whose residual spans it (two tensors inside) stays whole."""
    name, module, cap, _ = captured
    blocks = {
        "test-file-net": [f"blocks.{i}." for i in range(3)],
        "resnet18": [f"layer{i}.{j}." for i in range(1, 5) for j in (0, 1)],
        "hf-gpt2": [f"model.transformer.h.{i}." for i in range(2)],
        "hf-gpt2-tied": [f"model.transformer.h.{i}." for i in range(2)],
    }[name]
    layers = [set(layer["parameters"]) for layer in cap.model_config["layers"]]
    for block in blocks:
        holding = [i for i, names in enumerate(layers) if any(n.startswith(block) for n in names)]
        assert len(holding) == 1, f"{block} is cut across layers {holding}"
    assert len(layers) >= len(blocks) + 2
    tied = cap.model_config.get("tied", [])
    assert sum(len(names) for names in layers) == len(list(module.parameters())) + sum(len(g) - 1 for g in tied)
    if name == "hf-gpt2-tied":  # as many layers as untied, the embedding's copy in the first and the last
        untied = capture(GPT2Logits(vocab_size=50), torch.zeros(2, 16, dtype=torch.int64), input_bound=50)
        assert len(layers) == len(untied.model_config["layers"])
        assert tied == [["layers.0.model.lm_head.weight", f"layers.{len(layers) - 1}.model.lm_head.weight"]]
    safetensors_load(cap.weights)  # the weights are safetensors, the program JSON: nothing is pickled
    assert json.loads(cap.program)["format"] == "arceus.exported-program/1"


def test_a_hugging_face_gpt2_as_it_comes_splits_under_the_trainer_as_its_untied_twin() -> None:
    """`DistributedTrainer(model=GPT2LMHeadModel(GPT2Config(...)))`: the bare model (its output a `ModelOutput`, a
    key/value cache kept by default, its LM head tied to its embedding) is captured into as many layers as its
    untied twin, so it spreads over as many devices; the tied weight's copies are the first and last layers'."""
    config = {"vocab_size": 50, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2}
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    gpt2 = GPT2LMHeadModel(GPT2Config(**config))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight and gpt2.config.use_cache
    trainer = DistributedTrainer(model=gpt2, example_input=tokens, input_bound=50, url="http://127.0.0.1:9", token="t")
    trainer.peers = Peers("http://127.0.0.1:9", "given", [DeviceClass("cpu-small", ready_nodes=8, price_per_hour=0.0)])
    untied = capture(GPT2LMHeadModel(GPT2Config(**config, tie_word_embeddings=False)), tokens, input_bound=50)
    layers = len(untied.model_config["layers"])
    assert trainer.partition().stages == layers >= 4
    tied = capture(gpt2, tokens, input_bound=50).model_config["tied"]
    assert tied == [["layers.0.lm_head.weight", f"layers.{layers - 1}.lm_head.weight"]]
    assert gpt2.config.use_cache  # the developer's model is left as it was


@pytest.mark.parametrize(
    ("target", "named"),
    [
        ("torch.ops.aten.from_file.default", "aten::from_file"),
        ("torch.ops.mylib.custom.default", "mylib::custom"),
        ("torch.ops.higher_order.cond", "higher_order::cond"),
        ("builtins.eval", "builtins.eval"),
    ],
)
def test_a_forbidden_operator_is_refused_with_its_name_before_anything_is_built(
    captured: tuple[str, nn.Module, CapturedModel, list[Any]], target: str, named: str
) -> None:
    _, _, cap, _ = captured
    config, layers, _ = forged_program(cap, 1, target)
    with pytest.raises(SpecError, match=f"uses operator {named}, which agents do not run"):
        graph_check(json.loads(layers[1])["graph"], "layer 1")
    spec = model_spec_from_config(config).with_documents({1: layers[1]})
    with pytest.raises(SpecError, match=f"layer 1: uses operator {named}"):
        build_layers(spec, 1, 2, seed=0)


def test_code_hidden_in_a_shape_expression_or_guards_is_refused(
    captured: tuple[str, nn.Module, CapturedModel, list[Any]],
) -> None:
    _, _, cap, _ = captured
    graph = json.loads(json.loads(cap.program)["layers"][0])["graph"]
    graph_check(graph, "layer 0")
    hostile = copy.deepcopy(graph)
    hostile["range_constraints"]["__import__('os').system('true')"] = {"min_val": 1, "max_val": 2}
    with pytest.raises(SpecError, match="is not integer shape arithmetic"):
        graph_check(hostile, "layer 0")
    hostile = copy.deepcopy(graph)
    hostile["guards_code"] = ["import os"]
    with pytest.raises(SpecError, match="carries guards_code"):
        graph_check(hostile, "layer 0")
