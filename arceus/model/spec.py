"""What every model spec answers, whatever its architecture: torch-free sizes, costs and boundary layouts.

A spec is declarative: the only thing a contributor builds its stage from. The partitioner, the placement
solver, the agents' input checks and the ledger read these answers; none of them asks which architecture
a spec is (the registry, `arceus.model.registry`, is the one place that maps a model type to its code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from arceus.model.layout import TensorLayout


@dataclass(frozen=True)
class LayerStash:
    """What one sample's training forward through a layer keeps for its backward (autograd's saved tensors,
    fp32) besides its input, which every layer keeps: `beside` bytes, and whether its output is kept too (by
    the layer itself; a next layer's input is that same tensor)."""

    beside: int
    keeps_output: bool = False


@runtime_checkable
class ModelSpec(Protocol):
    @property
    def type(self) -> str:
        """The `model_config.type` this spec was parsed from (its registry key)."""
        ...

    @property
    def num_layers(self) -> int:
        """Pipeline layers: the units stages are cut between."""
        ...

    def layer_params(self) -> list[int]:
        """Parameters of each layer."""
        ...

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each parameter's shape in `layer`, by its name in the layer's torch module (all float32)."""
        ...

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """Each persistent buffer of `layer` (state its training forward updates, arceus.model.buffers): (torch dtype
        name, shape), by its name in the layer's torch module; a stage's state holds them beside its weights."""
        ...

    def layer_flops_per_sample(self) -> list[int]:
        """Forward FLOPs per sample of each layer (a backward costs about twice as much)."""
        ...

    def layer_stash(self) -> list[LayerStash]:
        """What each layer's training forward keeps for its backward; the last layer's includes what its loss
        keeps of the logits."""
        ...

    def input_layout(self, layer: int) -> TensorLayout:
        """One sample's tensor entering `layer` (layer 0: the dataset's inputs)."""
        ...

    def output_layout(self, layer: int) -> TensorLayout:
        """One sample's tensor leaving `layer` (the last layer's: the logits)."""
        ...

    def label_layout(self) -> TensorLayout:
        """One sample's labels, as the last stage takes them."""
        ...

    def split_layers(self) -> frozenset[int]:
        """The layers whose weights and compute a tensor-parallel group divides (empty: none can)."""
        ...

    def tied_parameters(self) -> tuple[tuple[str, ...], ...]:
        """Groups of pipeline parameter names that are one weight (`arceus.model.tied`), each by layer; () for a
        model without tied weights."""
        ...


@runtime_checkable
class TextModelSpec(ModelSpec, Protocol):
    """The spec of an architecture that `writes_text`: it reads and predicts tokens."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def block_size(self) -> int: ...


def split_global_param_name(name: str) -> tuple[int, str]:
    """A model-wide parameter name ("layers.2.weight", arceus.model.build.global_param_name) as its layer index and
    its name in the layer (2, "weight"); ValueError for a name of another form. Here, torch-free, for the
    architectures' Hugging Face name maps."""
    prefix, layer, rest = (name.split(".", 2) + ["", ""])[:3]
    if prefix != "layers" or not layer.isdigit() or not rest:
        raise ValueError(f"{name!r} is not a pipeline parameter name (layers.<i>.<name>)")
    return int(layer), rest
