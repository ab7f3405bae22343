"""A stage's state file is checked, from its header alone, against exactly what the stage holds."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from arceus.checkpoint import encode_checkpoint
from arceus.contracts.assignment import OptimizerConfig
from arceus.model.build import build_layers, named_global_parameters
from arceus.model.expected_state import (
    ADAM8BIT_BLOCK,
    expected_stage_state,
    optimizer_entry_layout,
    optimizer_kind,
    stage_file_check,
)
from arceus.model.exported.capture import capture
from arceus.model.exported.program import program_layers
from arceus.model.registry import model_spec_from_config
from arceus.model.sharding import Shard
from arceus.model.spec import ModelSpec
from arceus.model.tensor_parallel import (
    build_parallel_layers,
    gather_state_tensors,
    rank_expected_state,
    slice_state_tensors,
)
from arceus.safetensors_file import CheckpointError, StageStateError, tensor_layouts
from nodeagent.runtime import StageRuntime

MLP = {"type": "mlp", "layer_sizes": [64, 32, 16, 10]}
GPT = {"type": "transformer", "n_layer": 3, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 11}
CONVNET = {"type": "convnet", "input_shape": [1, 8, 8], "classes": 10}
LLAMA = {"type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 8, "vocab_size": 11}
SGD_MOMENTUM = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)
SGD = OptimizerConfig(name="sgd", lr=0.1)
ADAM = OptimizerConfig(name="adam", lr=0.01)
ADAM8BIT = OptimizerConfig(name="adam8bit", lr=0.01)


def stepped_state(spec: ModelSpec, start: int, end: int, optimizer: OptimizerConfig, *, steps: int = 1,
                  include_optimizer_state: bool = True) -> dict[str, torch.Tensor]:
    """What an honest agent's stage of layers [start, end) writes after `steps` optimizer steps."""
    runtime = StageRuntime(
        build_layers(spec, start, end, seed=1), optimizer=optimizer, is_first=start == 0,
        is_last=end == spec.num_layers, input_layout=spec.input_layout(start), max_micro_batch_size=4,
        device=torch.device("cpu"),
    )
    for _ in range(steps):
        for param in runtime.layers.parameters():
            param.grad = torch.randn_like(param)
        runtime.optimizer_step()
    return runtime.state_tensors() if include_optimizer_state else runtime.named_weights()


def check(tensors: dict[str, torch.Tensor], spec: ModelSpec, start: int, end: int, optimizer: OptimizerConfig,
          *, stage_index: int = 1, shard: Shard | None = None) -> None:
    data = encode_checkpoint(tensors)
    expected = expected_stage_state(spec, stage_index=stage_index, layer_start=start, layer_end=end,
                                    optimizer=optimizer_kind(optimizer.name, optimizer.momentum))
    if shard is not None:
        expected = rank_expected_state(spec, expected, shard)
    stage_file_check(io.BytesIO(data), len(data), expected)


def built_layouts(layers: torch.nn.Module) -> dict[str, tuple[str, list[int]]]:
    """What a built stage's (or rank's) parameters are, as safetensors names their dtype."""
    return {name: ({torch.float32: "F32"}[p.dtype], list(p.shape)) for name, p in named_global_parameters(layers)}


def exported_config() -> dict:
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return capture(module, torch.rand(4, 64)).model_config


@pytest.mark.parametrize("config", [MLP, GPT, CONVNET, LLAMA, "exported"],
                         ids=["mlp", "transformer", "convnet", "llama", "exported"])
def test_the_torch_free_expectation_is_what_the_built_layers_hold(config: dict | str) -> None:
    """The control plane checks files against the specs' declared parameters, never building a layer: they
    must be exactly the built stage's, for every range of layers (and its parameter count the spec's)."""
    spec = model_spec_from_config(exported_config() if config == "exported" else config)
    for start in range(spec.num_layers):
        for end in range(start + 1, spec.num_layers + 1):
            with torch.device("meta"):
                layers = build_layers(spec, start, end, seed=0)
            expected = expected_stage_state(spec, stage_index=0, layer_start=start, layer_end=end, optimizer="adam")
            assert expected.weights == built_layouts(layers), (start, end)
    for index in range(spec.num_layers):
        assert sum(math.prod(shape) for shape in spec.layer_parameters(index).values()) == spec.layer_params()[index]


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["transformer", "llama"])
def test_a_tensor_parallel_ranks_expectation_is_what_its_built_layers_hold(config: dict) -> None:
    spec = model_spec_from_config({**config, "n_head": 4} if config is GPT else config)
    for rank in range(2):
        shard = Shard(rank, 2)
        with torch.device("meta"):
            layers = build_parallel_layers(spec, 0, spec.num_layers, 0, shard, all_reduce=lambda t: t)
        whole = expected_stage_state(spec, stage_index=0, layer_start=0, layer_end=spec.num_layers, optimizer="sgd")
        assert rank_expected_state(spec, whole, shard).weights == built_layouts(layers)


@pytest.mark.parametrize("config", [MLP, GPT, CONVNET, LLAMA], ids=["mlp", "gpt", "convnet", "llama"])
@pytest.mark.parametrize(
    "optimizer", [SGD_MOMENTUM, ADAM, SGD, ADAM8BIT], ids=["sgd-momentum", "adam", "sgd", "adam8bit"]
)
def test_an_honest_stages_state_is_accepted(config: dict, optimizer: OptimizerConfig) -> None:
    spec = model_spec_from_config(config)
    start, end = 1, spec.num_layers - 1
    check(stepped_state(spec, start, end, optimizer), spec, start, end, optimizer)
    check(stepped_state(spec, start, end, optimizer, include_optimizer_state=False), spec, start, end, optimizer)
    check(stepped_state(spec, start, end, optimizer, steps=0), spec, start, end, optimizer)  # no state yet
    check(stepped_state(spec, 0, spec.num_layers, optimizer), spec, 0, spec.num_layers, optimizer)


def test_a_tensor_parallel_ranks_state_is_its_part_and_the_gathered_state_the_stages() -> None:
    spec = model_spec_from_config({**GPT, "n_head": 4})
    full = stepped_state(spec, 0, 3, ADAM, steps=2)
    ranks = [slice_state_tensors(spec, Shard(r, 2), full) for r in range(2)]
    for rank, part in enumerate(ranks):
        check(part, spec, 0, 3, ADAM, shard=Shard(rank, 2))
    rank_of_it = r"layers.1.attn.c_attn.bias: expected float32 \[24\], got float32 \[48\]"
    with pytest.raises(StageStateError, match=rank_of_it):
        check(full, spec, 0, 3, ADAM, shard=Shard(1, 2))  # the whole stage is not a rank's part
    check(dict(gather_state_tensors(spec, ranks)), spec, 0, 3, ADAM)


SPEC = model_spec_from_config(MLP)


def honest() -> dict[str, torch.Tensor]:
    return stepped_state(SPEC, 1, 2, SGD_MOMENTUM)  # layer 1: 32 -> 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update({"layers.1.weight": torch.zeros(16, 64)}),
         "stage 1: layers.1.weight: expected float32 [16, 32], got float32 [16, 64]"),
        (lambda t: t.update({"layers.1.bias": torch.zeros(16, dtype=torch.float64)}),
         "stage 1: layers.1.bias: expected float32 [16], got float64 [16]"),
        (lambda t: t.update({"layers.0.weight": torch.zeros(32, 64)}),  # another stage's weights
         "stage 1: unexpected tensor layers.0.weight: the stage holds layers [1, 2)"),
        (lambda t: t.update({"filler": torch.zeros(1000)}),
         "stage 1: unexpected tensor filler: the stage holds layers [1, 2)"),
        (lambda t: t.pop("layers.1.bias"),
         "stage 1: missing tensor layers.1.bias: expected float32 [16] (the stage holds layers [1, 2))"),
        (lambda t: t.update({"optimizer.layers.1.weight.exp_avg": torch.zeros(16, 32)}),
         "stage 1: unexpected tensor optimizer.layers.1.weight.exp_avg: a sgd-momentum optimizer keeps "
         "momentum_buffer"),
        (lambda t: t.update({"optimizer.layers.2.weight.momentum_buffer": torch.zeros(10, 16)}),
         "stage 1: unexpected tensor optimizer.layers.2.weight.momentum_buffer: optimizer state of no parameter "
         "it holds (the stage holds layers [1, 2))"),
        (lambda t: t.update({"optimizer.layers.1.weight.momentum_buffer": torch.zeros(16, 33)}),
         "stage 1: optimizer.layers.1.weight.momentum_buffer: expected float32 [16, 32], got float32 [16, 33]"),
    ],
    ids=["shape", "dtype", "another stage", "filler", "missing", "foreign optimizer key", "optimizer of no param",
         "optimizer shape"],
)
def test_each_kind_of_mismatch_is_refused_naming_the_tensor(change, message: str) -> None:  # noqa: ANN001
    tensors = honest()
    change(tensors)
    with pytest.raises(StageStateError) as refused:
        check(tensors, SPEC, 1, 2, SGD_MOMENTUM)
    assert str(refused.value) == message and refused.value.stage_index == 1


def test_a_stage_with_batchnorm_holds_exactly_its_declared_buffers() -> None:
    """An exported model's BatchNorm buffers ("buffer.<name>") are part of its stage's state, checked from the spec's
    declaration as weights are: its honest state passes; a buffer of another layer, of another layout or missing is
    refused by name (a buffer is never optional: the stage always writes its own)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10))
    cap = capture(module, torch.rand(4, 64), split_points=["2"])
    spec = model_spec_from_config(cap.model_config)
    documents = program_layers(cap.program, [layer["sha256"] for layer in cap.model_config["layers"]])
    runtime = StageRuntime(
        build_layers(spec.with_documents(dict(enumerate(documents))), 0, 2, seed=0), optimizer=SGD, is_first=True,
        is_last=True, input_layout=spec.input_layout(0), max_micro_batch_size=4, device=torch.device("cpu"),
    )
    honest = runtime.state_tensors()
    assert "buffer.layers.0.1.running_var" in honest
    check(honest, spec, 0, 2, SGD)
    refusals = {
        "buffer.layers.1.1.running_var": "unexpected tensor buffer.layers.1.1.running_var: no buffer of the layers "
                                         "it holds (the stage holds layers [0, 2))",
        "buffer.layers.0.1.running_mean": "buffer.layers.0.1.running_mean: expected float32 [16], got float32 [17]",
    }
    for name, message in refusals.items():
        with pytest.raises(StageStateError) as refused:
            check({**honest, name: torch.zeros(17)}, spec, 0, 2, SGD)
        assert str(refused.value) == f"stage 1: {message}"
    with pytest.raises(StageStateError, match="missing tensor buffer.layers.0.1.num_batches_tracked: expected int64 "):
        check({n: t for n, t in honest.items() if not n.endswith("num_batches_tracked")}, spec, 0, 2, SGD)


def test_adam_state_needs_a_scalar_step_and_all_its_entries() -> None:
    spec = model_spec_from_config(GPT)
    tensors = stepped_state(spec, 1, 2, ADAM)
    tensors["optimizer.layers.1.ln_1.weight.step"] = torch.zeros(16)
    with pytest.raises(StageStateError, match=r"optimizer.layers.1.ln_1.weight.step: expected float32 \[\], got "
                                              r"float32 \[16\]"):
        check(tensors, spec, 1, 2, ADAM)
    tensors = stepped_state(spec, 1, 2, ADAM)
    del tensors["optimizer.layers.1.ln_1.weight.exp_avg_sq"]
    with pytest.raises(StageStateError, match="missing tensor optimizer.layers.1.ln_1.weight.exp_avg_sq: a adam"):
        check(tensors, spec, 1, 2, ADAM)


def test_8bit_adam_state_is_one_byte_an_element_and_a_scale_per_block() -> None:
    spec = model_spec_from_config(GPT)
    tensors = stepped_state(spec, 1, 2, ADAM8BIT)
    weight = "layers.1.mlp.c_fc.weight"  # 64 x 16: 1024 elements, 4 blocks of 256
    assert tensors[f"optimizer.{weight}.state1"].dtype == torch.uint8
    assert tensors[f"optimizer.{weight}.state1"].shape == tensors[weight].shape
    assert tensors[f"optimizer.{weight}.absmax2"].shape == (-(-tensors[weight].numel() // ADAM8BIT_BLOCK),)
    assert optimizer_entry_layout("adam8bit", "absmax1", [64, 16]) == ("F32", [4])
    assert optimizer_entry_layout("adam8bit", "state2", [64, 16]) == ("U8", [64, 16])
    tensors[f"optimizer.{weight}.state1"] = tensors[f"optimizer.{weight}.state1"].float()  # a full-width moment
    with pytest.raises(StageStateError, match=rf"optimizer.{weight}.state1: expected uint8 \[64, 16\], got float32"):
        check(tensors, spec, 1, 2, ADAM8BIT)
    with pytest.raises(StageStateError, match="a adam optimizer keeps exp_avg, exp_avg_sq, step"):
        check(stepped_state(spec, 1, 2, ADAM8BIT), spec, 1, 2, ADAM)


def raw_file(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8 + 4096),
         "its tensors hold 8 bytes of data, but the file carries 4104"),  # small tensors, more bytes
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16),
         "tensor 'a' starts at data offset 8, expected 0"),  # a gap
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
         "tensor 'b' starts at data offset 0, expected 8"),  # overlapping
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8),
         "tensor 'a' of 16 bytes at offsets [0, 8]"),  # shape and size disagree
    ],
    ids=["trailing bytes", "gap", "overlap", "size"],
)
def test_a_header_whose_offsets_do_not_tile_the_data_is_refused(header: dict, data: bytes, message: str) -> None:
    file = raw_file(header, data)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tensor_layouts(io.BytesIO(file), len(file))


def test_checking_a_100m_parameter_stage_loads_no_weights(tmp_path) -> None:
    """A GPT stage of ~100M parameters (a 400 MB file, sparse on disk) is checked from its header: the
    process's peak resident memory grows by far less than one of its weight matrices."""
    script = textwrap.dedent(
        """
        import json, resource, sys, torch
        from arceus.model.build import build_layers, named_global_parameters
        from arceus.model.expected_state import expected_stage_state, stage_file_check
        from arceus.model.registry import model_spec_from_config
        spec = model_spec_from_config({"type": "transformer", "n_layer": 12, "n_head": 12, "d_model": 768,
                                       "block_size": 256, "vocab_size": 50000})
        with torch.device("meta"):
            names = [(n, list(p.shape)) for n, p in build_layers(spec, 1, 14, seed=0).named_parameters()]
        header, offset = {}, 0
        for name, shape in names:
            size = 4 * torch.Size(shape).numel()
            header["layers." + name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header).encode()
        path = sys.argv[1]
        with open(path, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            out.truncate(8 + len(encoded) + offset)
        expected_stage_state(spec, stage_index=0, layer_start=1, layer_end=14, optimizer="adam")  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        expected = expected_stage_state(spec, stage_index=0, layer_start=1, layer_end=14, optimizer="adam")
        with open(path, "rb") as handle:
            stage_file_check(handle, 8 + len(encoded) + offset, expected)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({"parameters": offset // 4, "peak_growth_kib": grown}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "stage.safetensors")],
                          capture_output=True, text=True, check=True)
    measured = json.loads(done.stdout)
    assert measured["parameters"] > 100_000_000
    assert measured["peak_growth_kib"] < 32 * 1024  # one 768 x 3072 float32 matrix alone is 9 MiB; all, 400 MB
