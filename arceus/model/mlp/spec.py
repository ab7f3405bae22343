"""The MLP spec: a stack of Linear layers, each a pipeline layer. Torch-free sizes and costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from arceus.errors import SpecError
from arceus.model.activations import KEEPS_OUTPUT, activation_from_config
from arceus.model.layout import TensorLayout
from arceus.model.spec import LayerStash
from arceus.model.spec_fields import known_keys_check

MAX_LAYER_WIDTH = 1_000_000
_MLP_KEYS = frozenset({"type", "layer_sizes", "activation"})


@dataclass(frozen=True)
class MLPSpec:
    """A stack of Linear layers; every layer but the last is followed by the activation.

    `layer_sizes` [64, 128, 10] means two layers: Linear(64→128)+act, Linear(128→10).
    """

    type: ClassVar[str] = "mlp"
    layer_sizes: tuple[int, ...]
    activation: str = "relu"

    @property
    def num_layers(self) -> int:
        return len(self.layer_sizes) - 1

    @property
    def input_features(self) -> int:
        return self.layer_sizes[0]

    @property
    def output_features(self) -> int:
        return self.layer_sizes[-1]

    def layer_params(self) -> list[int]:
        """Parameters (weight + bias) of each layer."""
        return [i * o + o for i, o in self._pairs()]

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each parameter's shape in `layer`, by its name in the layer (`arceus.model.mlp.layers`)."""
        i, o = self._pairs()[layer]
        return {"weight": [o, i], "bias": [o]}

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """None: its layers hold no persistent buffer."""
        return {}

    def layer_flops_per_sample(self) -> list[int]:
        """Forward FLOPs per sample of each layer: 2·in·out (one multiply and one add per weight).

        Bias and activation are ignored (O(out), negligible). Backward costs about twice the forward.
        """
        return [2 * i * o for i, o in self._pairs()]

    def layer_stash(self) -> list[LayerStash]:
        """A hidden layer's activation keeps its output (the layer's own) or its input; the last layer's loss
        keeps the logits' log-softmax."""
        keeps_output = KEEPS_OUTPUT[self.activation]
        hidden = [LayerStash(0 if keeps_output else 4 * o, keeps_output) for o in self.layer_sizes[1:-1]]
        return [*hidden, LayerStash(4 * self.layer_sizes[-1])]

    def layer_input_features(self) -> list[int]:
        return list(self.layer_sizes[:-1])

    def layer_output_features(self) -> list[int]:
        return list(self.layer_sizes[1:])

    @property
    def num_classes(self) -> int:
        return self.output_features

    def input_layout(self, layer: int) -> TensorLayout:
        return TensorLayout("float32", (self.layer_sizes[layer],))

    def output_layout(self, layer: int) -> TensorLayout:
        return TensorLayout("float32", (self.layer_sizes[layer + 1],))

    def label_layout(self) -> TensorLayout:
        """One class index per sample."""
        return TensorLayout("int64", (), bound=self.num_classes)

    def split_layers(self) -> frozenset[int]:
        """A tensor-parallel group splits none of an MLP's layers."""
        return frozenset()

    def tied_parameters(self) -> tuple[tuple[str, ...], ...]:
        return ()

    def _pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.layer_sizes[:-1], self.layer_sizes[1:], strict=True))


def mlp_from_config(config: dict[str, Any]) -> MLPSpec:
    known_keys_check(config, _MLP_KEYS, "an mlp")
    if "layer_sizes" not in config:
        raise SpecError(
            "model_config.layer_sizes", "is required, e.g. [64, 128, 10] (input, hidden..., output)"
        )
    sizes = config["layer_sizes"]
    field = "model_config.layer_sizes"
    if not isinstance(sizes, list | tuple):
        raise SpecError(field, f"must be a list of positive integers, got {type(sizes).__name__}")
    if len(sizes) < 2:
        raise SpecError(field, f"needs at least 2 entries (input and output), got {len(sizes)}")
    for index, size in enumerate(sizes):
        # bool is an int subclass; `true` in JSON is never a width.
        if isinstance(size, bool) or not isinstance(size, int):
            raise SpecError(f"{field}[{index}]", f"must be a positive integer, got {size!r}")
        if size < 1:
            raise SpecError(f"{field}[{index}]", f"must be at least 1, got {size}")
        if size > MAX_LAYER_WIDTH:
            raise SpecError(f"{field}[{index}]", f"must be at most {MAX_LAYER_WIDTH:,}, got {size:,}")
    return MLPSpec(layer_sizes=tuple(sizes), activation=activation_from_config(config))
