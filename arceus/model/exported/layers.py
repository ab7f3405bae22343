"""An exported model's layer rebuilt from data: its parameters as the spec declares them (float32, loaded from
the job's initial weights) and, where its document is attached, its graph, checked against the operator
allow-list and deserialized from torch's schema-based JSON, with its buffers and constants from safetensors.
Nothing is unpickled and no developer code runs: the forward runs the graph's ATen operators through autograd.
"""

from __future__ import annotations

import torch
import torch._export.serde.serialize as serde
from safetensors.torch import load as safetensors_load
from torch import nn

from arceus.errors import SpecError
from arceus.model.buffers import persistent_buffers
from arceus.model.exported.program import layer_parsed
from arceus.model.exported.spec import ExportedSpec

# The allowed operators (arceus.model.exported.operators) that draw random numbers: seeded per training step,
# micro-batch and layer (arceus.model.seeding.draw_seed) by whoever runs the layer.
_RANDOM_OPERATORS = frozenset({"torch.ops.aten.dropout.default", "torch.ops.aten.native_dropout.default"})


class ExportedLayerModule(nn.Module):
    """Its parameters are the declared ones under the developer's names; the graph computes with those very
    tensors (it is not a registered child, so each parameter is named once)."""

    def __init__(self, spec: ExportedSpec, index: int) -> None:
        super().__init__()
        self.index = index
        declared = spec.layers[index].parameters
        for name, shape in declared:
            owner, _, leaf = name.rpartition(".")
            _module_at(self, owner).register_parameter(leaf, nn.Parameter(torch.empty(shape)))
        document = spec.attached.get(index)
        graph, self.draws_random = (
            (None, False) if document is None else _graph(spec, index, document, dict(self.named_parameters()))
        )
        object.__setattr__(self, "_graph", graph)  # not a child: its parameters are these ones
        self._share_buffers()
        if graph is not None:
            _buffers_check(spec, index, graph)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._graph is None:
            raise RuntimeError(f"layer {self.index}'s graph is not attached; build it from the job's program")
        return self._graph(x)

    def share_parameter(self, name: str, param: nn.Parameter) -> None:
        """Compute with `param` as its parameter `name` (a tied weight the one-process reference shares)."""
        owner, _, leaf = name.rpartition(".")
        setattr(_module_at(self, owner), leaf, param)
        if self._graph is not None:
            setattr(_module_at(self._graph, owner), leaf, param)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Moves (or casts) the graph's buffers and constants along with the parameters it shares."""
        super()._apply(fn, recurse)
        if self._graph is not None:
            self._graph._apply(fn, recurse)
            self._share_buffers()
        return self

    def _share_buffers(self) -> None:
        """The graph's persistent buffers (a BatchNorm's running statistics: state its forward updates) as this
        layer's own, the very tensors, so whatever handles a layer's buffers (arceus.model.buffers) finds them."""
        if self._graph is None:
            return
        for name, buffer in persistent_buffers(self._graph):
            owner, _, leaf = name.rpartition(".")
            _module_at(self, owner).register_buffer(leaf, buffer)


def exported_layer(spec: ExportedSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer `index`; `generator` is unused: an exported model starts from its uploaded weights."""
    return ExportedLayerModule(spec, index)


def _graph(
    spec: ExportedSpec, index: int, document: str, params: dict[str, nn.Parameter]
) -> tuple[nn.Module, bool]:
    """The layer's graph as a module computing with `params`, and whether its forward draws random numbers."""
    where = f"layer {index}"
    graph, tensor_bytes = layer_parsed(document, spec.layers[index].sha256, where)
    draws = False
    for node in graph["graph_module"]["graph"]["nodes"]:
        node["metadata"] = {}  # only names and traces; nothing an agent needs
        draws = draws or node.get("target") in _RANDOM_OPERATORS
    tensors = safetensors_load(tensor_bytes) if tensor_bytes else {}
    serialized = serde._dict_to_dataclass(serde.ExportedProgram, graph)
    signature = serialized.graph_module.signature
    declared = set(params)
    graph_params = {s.parameter.parameter_name for s in signature.input_specs if s.type == "parameter"}
    if graph_params != declared:
        raise SpecError(where, f"graph's parameters {sorted(graph_params)} are not the declared {sorted(declared)}")
    state: dict[str, torch.Tensor] = dict(params)
    constants = {}
    for input_spec in signature.input_specs:
        if input_spec.type == "buffer":  # a persistent buffer is state, another a constant (torch's split)
            name = input_spec.buffer.buffer_name
            (state if input_spec.buffer.persistent else constants)[name] = _tensor(tensors, name, where)
        elif input_spec.type == "tensor_constant":
            name = input_spec.tensor_constant.tensor_constant_name
            constants[name] = _tensor(tensors, name, where)
        elif input_spec.type not in ("parameter", "user_input"):
            raise SpecError(where, f"graph takes a {input_spec.type} input, which agents do not build")
    program = serde.ExportedProgramDeserializer().deserialize(serialized, state, constants, None)
    module = program.module()
    for name, param in params.items():
        owner, _, leaf = name.rpartition(".")
        setattr(_module_at(module, owner), leaf, param)
    return module, draws


def _buffers_check(spec: ExportedSpec, index: int, graph: nn.Module) -> None:
    """SpecError unless the graph's persistent buffers are the ones the spec declares (a stage's state holds them,
    and what checks a state file, or counts a replica's partial gradient, knows them from the spec alone)."""
    held = {name: (str(b.dtype).removeprefix("torch."), list(b.shape)) for name, b in persistent_buffers(graph)}
    declared = spec.layer_buffers(index)
    if held != declared:
        raise SpecError(
            f"model_config.layers[{index}].buffers",
            f"declares {declared} but the layer's graph holds persistent buffers {held}; capture the model again "
            "(arceus.model.exported.capture declares them)",
        )


def _tensor(tensors: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in tensors:
        raise SpecError(where, f"graph needs tensor {name}, which its document lacks")
    return tensors[name]


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule at `path` ("" is `root`), made (empty) where missing."""
    module = root
    for part in filter(None, path.split(".")):
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module
