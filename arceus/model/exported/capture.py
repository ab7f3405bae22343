"""A developer's `nn.Module` as an exported model: captured with `torch.export` into a graph of ATen operators,
cut at module boundaries into pipeline layers, each layer its own exported program shipped as JSON.

The cut follows `torch.distributed.pipelining`: a layer begins where a module begins (its `SplitPoint.BEGINNING`),
by default at every "block" (the root's children, descending into containers such as `nn.Sequential` and
`nn.ModuleList` and into any module holding one), or at the module names the developer gives. A cut is kept
only where the stage boundary is one tensor (the wire carries one tensor per boundary), batch first; a
developer-named cut that is not such a place is refused, naming why. A parameter used on both sides of a cut (tied
weights: a GPT-2's embedding and LM head) is a copy in each layer that uses it, the copies a tied group of the
model config (`tied`, arceus.model.tied), kept equal in training by summing their gradients. Symbolic batch sizes
a later layer needs are read again from its input there.

What runs here is the developer's own code, on the developer's machine: contributors get only the JSON.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._export.serde.serialize as serde
from safetensors.torch import save as safetensors_save
from torch import fx, nn
from torch.export import Dim, export
from torch.utils.flop_counter import FlopCounterMode

from arceus.errors import SpecError
from arceus.model.exported.operators import graph_check
from arceus.model.exported.program import layer_document, program_document
from arceus.model.exported.spec import SPEC_TYPE, exported_from_config

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_WIRE_DTYPES = {torch.float32: "float32", torch.int64: "int64"}


@dataclass(frozen=True)
class CapturedModel:
    """What a job of this model needs: its `model_config`, the program to upload (`PUT .../program`) and the
    initial weights (`PUT .../initial-weights`, safetensors under the pipeline's names `layers.<i>.<name>`);
    `names` maps each pipeline name back to the developer's module's parameter name."""

    model_config: dict[str, Any]
    program: bytes
    weights: bytes
    names: dict[str, str]

    def module_weights(self, trained: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A trained job's weights (its model download: pipeline names) under the module's own names, for
        `module.load_state_dict(..., strict=False)` (the download holds the parameters: buffers such as
        BatchNorm's running statistics stay the module's own). KeyError for a name the capture did not write."""
        return {self.names[name]: tensor for name, tensor in trained.items()}


def capture(
    module: nn.Module,
    example_input: torch.Tensor,
    *,
    split_points: Sequence[str] | None = None,
    input_bound: int | None = None,
) -> CapturedModel:
    """Capture `module` (train mode, as it trains) on `example_input` (a batch: dim 0 is the batch, at least 2
    samples), float32 or int64 (token ids in [0, `input_bound`)). Its output must be one float32 tensor of
    logits, [batch, classes] or [batch, positions, classes], or a Hugging Face model's output holding them (its
    key/value cache turned off). SpecError naming what does not fit."""
    if not isinstance(example_input, torch.Tensor) or example_input.dtype not in _WIRE_DTYPES:
        raise SpecError("example_input", "must be one float32 or int64 tensor whose dim 0 is the batch")
    if example_input.dim() < 1 or len(example_input) < 2:
        raise SpecError("example_input", "must hold a batch of at least 2 samples (dim 0 is the batch)")
    if (example_input.dtype == torch.int64) != (input_bound is not None):
        raise SpecError("input_bound", "is required for int64 inputs (ids are in [0, input_bound)), and only for them")
    module = copy.deepcopy(module).train()  # tracing and the example runs must not touch the developer's module
    if getattr(getattr(module, "config", None), "use_cache", False):
        module.config.use_cache = False  # a Hugging Face model training keeps no key/value cache (and returns none)
    module.register_forward_hook(_logits_of)
    batch = Dim("batch", min=1, max=1 << 20)
    program = export(module, (example_input,), dynamic_shapes=({0: batch},))
    graph_module = program.module()
    graph = graph_module.graph
    # Batch sizes and what is computed from them and constants alone (a transformer's attention mask) are not
    # placed: each layer that needs one computes it again from its own input.
    recomputable = _recomputable(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function" and n not in recomputable]
    names_of_parameters = {n for n, _ in module.named_parameters(remove_duplicate=False)}  # a tied one by any name
    cuts = _weighted(nodes, _cuts(nodes, module, split_points, recomputable), names_of_parameters)
    (model_input,) = [n for n in graph.nodes if n.op == "placeholder"]
    (model_output,) = _single_output(graph)
    boundaries = [model_input, *(_crossing(nodes, at, recomputable)[0] for at in cuts), model_output]
    layers, weights, names, layer_configs = [], {}, {}, []
    value = example_input
    for index, (start, end) in enumerate(zip([0, *cuts], [*cuts, len(nodes)], strict=True)):
        layer = _segment_module(
            graph_module, nodes[start:end], boundaries[index], boundaries[index + 1], recomputable
        )
        value, config, document = _layer(layer, value, batch)
        layers.append(document)
        layer_configs.append(config)
        for name, param in layer.named_parameters():
            weights[f"layers.{index}.{name}"] = param.detach().clone().contiguous()
            names[f"layers.{index}.{name}"] = name
    if value.dtype != torch.float32 or value.dim() not in (2, 3):
        raise SpecError("module", f"must return float32 logits [batch, classes] or [batch, positions, classes], got "
                        f"{value.dtype} {list(value.shape)}")
    program_bytes = program_document(layers)
    copies: dict[str, list[str]] = {}  # the module's parameter -> its pipeline names, by layer
    for pipeline, name in names.items():
        copies.setdefault(name, []).append(pipeline)
    model_config = {
        "type": SPEC_TYPE,
        "input": _layout(example_input, input_bound),
        "labels": {"dtype": "int64", "shape": list(value.shape[1:-1]), "bound": value.shape[-1]},
        "layers": layer_configs,
        "program_sha256": hashlib.sha256(program_bytes).hexdigest(),
        **({"tied": tied} if (tied := [group for group in copies.values() if len(group) > 1]) else {}),
    }
    exported_from_config(model_config)  # what the control plane will check, checked here first
    return CapturedModel(model_config, program_bytes, safetensors_save(weights), names)


def _logits_of(module: nn.Module, args: Any, output: Any) -> Any:
    """A Hugging Face model's output (a `ModelOutput`, a mapping holding its logits) as its logits alone, so
    `GPT2LMHeadModel(config)` is captured as it is, not only behind a wrapper returning `.logits`."""
    return output["logits"] if isinstance(output, Mapping) and "logits" in output else output


def _cuts(
    nodes: list[fx.Node], module: nn.Module, split_points: Sequence[str] | None, recomputable: set[fx.Node]
) -> list[int]:
    """Indices into `nodes` where a layer begins (never 0), in order."""
    owners = [_owner(node) for node in nodes]
    if split_points is None:
        units = _units(module)
        wanted = {i for i in range(1, len(nodes)) if _unit(owners[i], units) not in (None, _unit(owners[i - 1], units))}
    else:
        wanted = set()
        for name in split_points:
            starts = [i for i, owner in enumerate(owners) if owner == name or owner.startswith(f"{name}.")]
            if not starts:
                raise SpecError(f"split_points[{name!r}]", "names no module the forward runs")
            if starts[0] == 0:
                raise SpecError(f"split_points[{name!r}]", "is where the model begins; a cut there cuts nothing")
            if (why := _not_cuttable(nodes, starts[0], recomputable)) is not None:
                raise SpecError(f"split_points[{name!r}]", f"cannot begin a layer: {why}")
            wanted.add(starts[0])
    return sorted(i for i in wanted if _not_cuttable(nodes, i, recomputable) is None)


def _weighted(nodes: list[fx.Node], cuts: list[int], parameters: set[str]) -> list[int]:
    """`cuts` less those that would leave a layer without parameters (a dropout, a pooling): such a layer joins
    the next one (the last, the one before), so every layer, and so every stage, has weights to train."""
    def weighted(start: int, end: int) -> bool:
        return any(a.op == "get_attr" and a.target in parameters for n in nodes[start:end] for a in n.all_input_nodes)

    kept = list(cuts)
    changed = True
    while changed:
        changed = False
        bounds = [0, *kept, len(nodes)]
        for i in range(len(bounds) - 1):
            if kept and not weighted(bounds[i], bounds[i + 1]):
                kept.remove(bounds[i + 1] if i < len(kept) else bounds[i])
                changed = True
                break
    return kept


def _not_cuttable(nodes: list[fx.Node], at: int, recomputable: set[fx.Node]) -> str | None:
    """Why no layer may begin at `nodes[at]`, or None."""
    crossing = _crossing(nodes, at, recomputable)
    tensors = [n for n in crossing if isinstance(n.meta.get("val"), torch.Tensor)]
    if len(crossing) != 1 or len(tensors) != 1:
        return f"{len(crossing)} values cross it ({', '.join(sorted(n.name for n in crossing))}); a stage boundary " \
               "carries exactly one tensor"
    value = tensors[0].meta["val"]
    if value.dim() < 1 or not isinstance(value.shape[0], torch.SymInt):
        return f"{tensors[0].name} crosses it but its dim 0 is not the batch"
    if value.dtype != torch.float32:
        return (
            f"{tensors[0].name} crosses it as {value.dtype}; a boundary between layers carries float32 (its "
            "gradient flows back)"
        )
    return None


def _crossing(nodes: list[fx.Node], at: int, recomputable: set[fx.Node]) -> list[fx.Node]:
    """The values computed before `nodes[at]` (or the model's input) that it or a later node uses, by name;
    what a layer computes again for itself left out."""
    before = set(nodes[:at])
    crossing = {
        arg
        for node in nodes[at:]
        for arg in node.all_input_nodes
        if (arg in before or arg.op == "placeholder") and arg not in recomputable
    }
    crossing |= {n for n in nodes[:at] if any(u.op == "output" for u in n.users)}
    return sorted(crossing, key=lambda n: n.name)


def _single_output(graph: fx.Graph) -> list[fx.Node]:
    (output,) = [n for n in graph.nodes if n.op == "output"]
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    if len(values) != 1 or not isinstance(values[0], fx.Node):
        raise SpecError("module", f"must return one tensor (the logits), returns {len(values)} values")
    return list(values)


def _is_batch_size(node: fx.Node) -> bool:
    """`sym_size(x, 0)`: a later layer reads its batch size from its own input instead of receiving it."""
    return node.op == "call_function" and node.target == torch.ops.aten.sym_size.int and node.args[1] == 0


def _recomputable(graph: fx.Graph) -> set[fx.Node]:
    """Batch sizes, and the pure, deterministic values computed from them and constants alone: any layer can
    compute these itself (same ops on the same sizes: the same values), so they never cross a boundary."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        pure = schema is not None and not schema.is_mutable and not seeded
        if _is_batch_size(node) or pure and all(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _segment_module(
    graph_module: fx.GraphModule, segment: list[fx.Node], source: fx.Node, result: fx.Node, recomputable: set[fx.Node]
) -> fx.GraphModule:
    """The nodes of one layer as a module taking `source`'s value and returning `result`'s, sharing the
    model's parameters (same names), computing again what it needs of `recomputable`."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: new.placeholder("x")}

    def value(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op == "get_attr":
                env[arg] = new.get_attr(arg.target)
            elif _is_batch_size(arg):  # this layer's own batch size
                env[arg] = new.call_function(torch.ops.aten.sym_size.int, (env[source], 0))
            elif arg in recomputable:
                env[arg] = new.node_copy(arg, value)
            else:
                raise AssertionError(f"{arg.name} crosses into a layer beside its input")
        return env[arg]

    if any(_mutates(node, source) for node in segment):
        # An in-place operator (ReLU(inplace=True)) on the layer's input: autograd refuses that on the leaf a
        # stage receives, so the layer works on a copy.
        env[source] = new.call_function(torch.ops.aten.clone.default, (env[source],))
    for node in segment:
        env[node] = new.node_copy(node, value)
    new.output(env[result])
    return fx.GraphModule(graph_module, new)


def _mutates(node: fx.Node, value: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        argument.alias_info is not None and argument.alias_info.is_write and given is value
        for argument, given in zip(schema.arguments, node.args, strict=False)
    )


def _layer(layer: fx.GraphModule, value: torch.Tensor, batch: Any) -> tuple[torch.Tensor, dict[str, Any], str]:
    """(the layer's output on `value`, its model_config entry, its shipped document)."""
    program = export(layer, (value,), dynamic_shapes=({0: batch},))
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size() if t.data_ptr() != value.data_ptr() else 0
        return t

    probe = copy.deepcopy(layer)
    params = {id(p) for p in probe.parameters()}
    inp = value.detach().requires_grad_(value.is_floating_point())
    with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        output = probe(inp)
    saved = {k: v for k, v in saved.items() if k not in params}
    samples = len(value)
    state = program.state_dict
    signature = program.graph_signature
    tensors = {name: state[name] for name in signature.buffers if name in state}  # persistent ones
    tensors |= {name: t for name, t in program.constants.items() if isinstance(t, torch.Tensor)}
    if len(tensors) != len({*signature.buffers, *program.constants}):
        raise SpecError("module", "holds a non-tensor constant (a script object), which cannot be shipped as data")
    serialized = serde.serialize(  # the graph only: torch would pickle the tensors, which travel as safetensors
        program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
    )
    artifact = json.loads(serialized.exported_program)
    for node in artifact["graph_module"]["graph"]["nodes"]:
        node["metadata"] = {}  # stack traces and module paths: the developer's, of no use to an agent
    artifact["guards_code"] = []  # guards are Python source; the agent checks its inputs itself
    graph_check(artifact, "module")
    shipped = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    document = layer_document(artifact, safetensors_save(shipped))
    config = {
        "sha256": hashlib.sha256(document.encode()).hexdigest(),
        "output": _layout(output.detach(), None),
        "parameters": {name: list(p.shape) for name, p in layer.named_parameters()},
        "buffers": {name: {"dtype": str(state[name].dtype).removeprefix("torch."), "shape": list(state[name].shape)}
                    for name in signature.buffers if name in state},  # persistent ones: a stage's state
        "flops_per_sample": max(1, flops.get_total_flops() // samples),
        "stash_bytes_per_sample": sum(saved.values()) // samples,
    }
    return output.detach(), config, document


def _layout(value: torch.Tensor, bound: int | None) -> dict[str, Any]:
    layout: dict[str, Any] = {"dtype": _WIRE_DTYPES[value.dtype], "shape": list(value.shape[1:])}
    if bound is not None:
        layout["bound"] = bound
    return layout


def _owner(node: fx.Node) -> str:
    """The innermost module the node ran in ("" for the root's own code)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _units(module: nn.Module) -> set[str]:
    """The modules a layer may begin at by default: the root's children, descending into containers and into
    any module that holds one (a transformer's body holds its blocks' ModuleList)."""
    def expands(m: nn.Module) -> bool:
        return isinstance(m, _CONTAINERS) or any(isinstance(d, _CONTAINERS) for d in m.modules())

    units: set[str] = set()
    pending = [("", module)]
    while pending:
        prefix, parent = pending.pop()
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if expands(child):
                pending.append((f"{path}.", child))
            else:
                units.add(path)
    return units


def _unit(owner: str, units: set[str]) -> str | None:
    parts = owner.split(".")
    for end in range(1, len(parts) + 1):
        if ".".join(parts[:end]) in units:
            return ".".join(parts[:end])
    return None
