"""What an architecture gives the registry, torch-free: how to parse, fit and split a model of its type, and its
Hugging Face format. Its torch layers are `arceus.model.build`'s (`ArchitectureLayers`), so the control plane
and the contracts reason about any model without loading torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from arceus.model.layout import TensorLayout
from arceus.model.spec import ModelSpec


@dataclass(frozen=True)
class Shard:
    """This rank's place in its tensor-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a tensor-parallel group has at least 1 rank, got size {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")


@dataclass(frozen=True)
class TensorParallelSplit:
    """Whether and how an architecture's `split_layers()` divide over the ranks of a tensor-parallel group."""

    # What the ranks all-reduce, per sample.
    reduced_layout: Callable[[Any], TensorLayout]
    # SpecError("tensor_parallel.size", why) unless the split layers divide over that many ranks.
    check_size: Callable[[Any, int], None]


@dataclass(frozen=True)
class HuggingFaceFormat:
    """How a model is a Hugging Face `transformers` folder: `config.json` and `model.safetensors`."""

    config: Callable[[Any], dict[str, Any]]  # spec -> the contents of config.json
    # (spec, pipeline parameter name "layers.<i>.<name>") -> its `transformers` name; ValueError for a name
    # the model lacks.
    name: Callable[[Any, str], str]
    # (spec, pipeline parameter name) -> whether `transformers` stores that matrix transposed (GPT-2's Conv1D
    # weights are [in, out], a torch Linear's [out, in]).
    transposed: Callable[[Any, str], bool] = lambda spec, name: False
    # The config.json keys that change what the model computes but no tensor's shape (an activation, an epsilon,
    # tied embeddings), each with `transformers`' default where a config.json leaves it out: a checkpoint whose
    # config differs from `config(spec)` in one of them is another function, whatever its tensors.
    computes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Architecture:
    type: str  # model_config.type
    # Validate a model_config; SpecError naming the field ("model_config.<key>").
    from_config: Callable[[dict[str, Any]], ModelSpec]
    # (spec, completed model_config, validated and completed dataset_config) for a submitted pair, each
    # completing what it takes from the other (a vocabulary, an image size); SpecError naming the field
    # that does not fit.
    fit_dataset: Callable[[dict[str, Any], Any], tuple[ModelSpec, dict[str, Any], dict[str, Any]]]
    tensor_parallel: TensorParallelSplit | None = None
    # Its specs are `TextModelSpec`s: it reads and predicts tokens, so it can write text.
    writes_text: bool = False
    # Its trained weights download as a `transformers` folder (None: as our safetensors file only).
    hugging_face: HuggingFaceFormat | None = None
    # Its layers are graphs shipped as data (`arceus.model.exported`): the job carries a program (uploaded,
    # checked, each layer's document hashed in the model config) that an agent fetches and attaches to the
    # spec (`with_documents`) before building its stage, and it starts from uploaded weights under the
    # pipeline's own names.
    ships_program: bool = False
