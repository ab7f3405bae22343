"""The CNN spec: conv layers that each halve the image, then a linear head. Torch-free sizes and costs.

Pipeline layers: one per entry of `channels` (Conv2d with same padding + activation + MaxPool2d(2)), then
the head (flatten + Linear to the classes). Layer 0 reads the dataset's flat rows, so the driver feeds a
CNN exactly what it feeds an MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from arceus.errors import SpecError
from arceus.model.activations import KEEPS_OUTPUT, activation_from_config
from arceus.model.layout import TensorLayout
from arceus.model.spec import LayerStash
from arceus.model.spec_fields import known_keys_check

DEFAULT_CHANNELS = (8, 16)
MAX_CHANNELS = 4096
MAX_CONV_LAYERS = 32
MAX_KERNEL_SIZE = 7
MAX_IMAGE_SIDE = 65536
MAX_CLASSES = 1_000_000
_KEYS = frozenset({"type", "channels", "kernel_size", "activation", "input_shape", "classes"})

Shape = tuple[int, int, int]  # (channels, height, width) of one sample


@dataclass(frozen=True)
class ConvNetSpec:
    """`channels` (8, 16) on (1, 8, 8) images means Conv(1→8) to (8, 4, 4), Conv(8→16) to (16, 2, 2), then
    Linear(64→classes)."""

    type: ClassVar[str] = "convnet"
    input_shape: Shape
    classes: int
    channels: tuple[int, ...] = DEFAULT_CHANNELS
    kernel_size: int = 3
    activation: str = "relu"

    @property
    def num_layers(self) -> int:
        return len(self.channels) + 1

    @property
    def input_features(self) -> int:
        return math.prod(self.input_shape)

    def shapes(self) -> list[Shape]:
        """The image entering each conv layer, then the one entering the head."""
        shapes = [self.input_shape]
        for out_channels in self.channels:
            _, height, width = shapes[-1]
            shapes.append((out_channels, height // 2, width // 2))
        return shapes

    def layer_params(self) -> list[int]:
        """Conv weight + bias of each conv layer, then the head's weight + bias."""
        k2 = self.kernel_size**2
        convs = [c_in * k2 * c_out + c_out for (c_in, _, _), c_out in self._convs()]
        return [*convs, math.prod(self.shapes()[-1]) * self.classes + self.classes]

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each parameter's shape in `layer`, by its name in the layer (`arceus.model.convnet.layers`)."""
        if layer == self.num_layers - 1:
            return {"linear.weight": [self.classes, math.prod(self.shapes()[-1])], "linear.bias": [self.classes]}
        (c_in, _, _), c_out = self._convs()[layer]
        return {"conv.weight": [c_out, c_in, self.kernel_size, self.kernel_size], "conv.bias": [c_out]}

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """None: its layers hold no persistent buffer."""
        return {}

    def layer_stash(self) -> list[LayerStash]:
        """A conv layer keeps its activation's output (which pooling keeps too) or, for GELU, its input and the
        output pooling keeps, and the pooling's argmax indices (int64, a quarter as many); the head the log-
        softmax of the logits its loss keeps."""
        images = 1 if KEEPS_OUTPUT[self.activation] else 2
        convs = [LayerStash(4 * images * c_out * height * width + 8 * c_out * (height // 2) * (width // 2))
                 for (_, height, width), c_out in self._convs()]
        return [*convs, LayerStash(4 * self.classes)]

    def layer_flops_per_sample(self) -> list[int]:
        """2·MACs: a conv computes c_in·k²·c_out at every pixel of its (unpooled, same-size) output, the head
        features·classes. Bias, activation and pooling are ignored (linear in the outputs, negligible)."""
        k2 = self.kernel_size**2
        convs = [2 * c_in * k2 * c_out * height * width for (c_in, height, width), c_out in self._convs()]
        return [*convs, 2 * math.prod(self.shapes()[-1]) * self.classes]

    def input_layout(self, layer: int) -> TensorLayout:
        if layer == 0:
            return TensorLayout("float32", (self.input_features,))  # the dataset's flattened image
        return TensorLayout("float32", self.shapes()[layer])

    def output_layout(self, layer: int) -> TensorLayout:
        if layer == self.num_layers - 1:
            return TensorLayout("float32", (self.classes,))  # logits
        return TensorLayout("float32", self.shapes()[layer + 1])

    def label_layout(self) -> TensorLayout:
        """One class index per sample."""
        return TensorLayout("int64", (), bound=self.classes)

    def split_layers(self) -> frozenset[int]:
        """A tensor-parallel group splits none of a CNN's layers."""
        return frozenset()

    def tied_parameters(self) -> tuple[tuple[str, ...], ...]:
        return ()

    def _convs(self) -> list[tuple[Shape, int]]:
        """(input image, output channels) of each conv layer."""
        return list(zip(self.shapes()[:-1], self.channels, strict=True))


def convnet_from_config(config: dict[str, Any]) -> ConvNetSpec:
    known_keys_check(config, _KEYS, "a convnet")
    channels = _channels(config.get("channels", list(DEFAULT_CHANNELS)))
    kernel_size = config.get("kernel_size", 3)
    if not _is_int(kernel_size) or not 1 <= kernel_size <= MAX_KERNEL_SIZE or kernel_size % 2 == 0:
        raise SpecError(
            "model_config.kernel_size",
            f"must be an odd integer from 1 to {MAX_KERNEL_SIZE} (so a conv keeps the image size), got {kernel_size!r}",
        )
    activation = activation_from_config(config)
    input_shape = _input_shape(config)
    _, height, width = input_shape
    fits = min(height, width).bit_length() - 1  # halvings before a side pools down to nothing
    if len(channels) > fits:
        raise SpecError(
            "model_config.channels",
            f"has {len(channels)} conv layers but the {height}x{width} image is too small for that many layers: "
            f"each halves it, so use at most {fits}",
        )
    return ConvNetSpec(
        input_shape=input_shape,
        classes=_classes(config),
        channels=channels,
        kernel_size=kernel_size,
        activation=activation,
    )


def _channels(value: Any) -> tuple[int, ...]:
    field = "model_config.channels"
    if not isinstance(value, list | tuple):
        raise SpecError(field, f"must be a list of positive integers (one per conv layer), got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_CONV_LAYERS:
        raise SpecError(field, f"must have 1 to {MAX_CONV_LAYERS} entries (one per conv layer), got {len(value)}")
    for index, channels in enumerate(value):
        if not _is_int(channels) or not 1 <= channels <= MAX_CHANNELS:
            raise SpecError(f"{field}[{index}]", f"must be an integer from 1 to {MAX_CHANNELS}, got {channels!r}")
    return tuple(value)


def _input_shape(config: dict[str, Any]) -> Shape:
    field = "model_config.input_shape"
    if "input_shape" not in config:
        raise SpecError(field, "is required; job submission fills it in (the dataset's [channels, height, width])")
    shape = config["input_shape"]
    if not isinstance(shape, list | tuple) or len(shape) != 3:
        raise SpecError(field, f"must be [channels, height, width], got {shape!r}")
    for index, side in enumerate(shape):
        if not _is_int(side) or not 1 <= side <= MAX_IMAGE_SIDE:
            raise SpecError(f"{field}[{index}]", f"must be an integer from 1 to {MAX_IMAGE_SIDE}, got {side!r}")
    return (shape[0], shape[1], shape[2])


def _classes(config: dict[str, Any]) -> int:
    field = "model_config.classes"
    if "classes" not in config:
        raise SpecError(field, "is required; job submission fills it in (the dataset's classes)")
    classes = config["classes"]
    if not _is_int(classes) or not 1 <= classes <= MAX_CLASSES:
        raise SpecError(field, f"must be an integer from 1 to {MAX_CLASSES:,}, got {classes!r}")
    return classes


def _is_int(value: Any) -> bool:
    """bool is an int subclass; `true` in JSON is never a size."""
    return isinstance(value, int) and not isinstance(value, bool)
