"""Tied parameters, torch-free: one weight a model uses in two or more pipeline layers (a GPT's or a Llama's token
embedding and LM head under `tie_word_embeddings`, a captured module's shared weight). Each layer holds a copy under
its own pipeline name ("layers.<i>.<name>"); the copies start equal and stay bit-identical because every holder
steps with the same gradient: the sum of every copy's gradient, added in the group's one order (its members, by
layer), as Megatron sums the embedding's gradient between the first and the last stage. A stage that holds every
member of a group sums them itself; stages that share a group send each other their members' gradients after their
own replica exchange (`nodeagent.tied`), each stage's replicas hold the same sum by then, so the result is the same
bits on every copy. The one-process reference shares one parameter between the members instead
(`arceus.model.build.build_full_model`): autograd sums the same gradients there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, TypeVar

from arceus.errors import SpecError
from arceus.model.spec import ModelSpec, split_global_param_name

T = TypeVar("T")


@dataclass(frozen=True)
class TiedGroup:
    """One tied weight: its copies' pipeline names, by layer (the first is its canonical copy: what the others are
    initialised from and what a Hugging Face folder stores)."""

    members: tuple[str, ...]

    def layers(self) -> tuple[int, ...]:
        return tuple(split_global_param_name(name)[0] for name in self.members)

    def held(self, layer_start: int, layer_end: int) -> tuple[str, ...]:
        """The members layers [layer_start, layer_end) hold."""
        layers = self.layers()
        return tuple(m for m, layer in zip(self.members, layers, strict=True) if layer_start <= layer < layer_end)


def tied_groups(spec: ModelSpec) -> tuple[TiedGroup, ...]:
    """The model's tied weights (none for most): its spec's `tied_parameters()`."""
    return tuple(TiedGroup(tuple(members)) for members in spec.tied_parameters())


def tied_groups_check(groups: Sequence[Sequence[str]], layer_parameters: Callable[[int], dict[str, list[int]]],
                      num_layers: int, field: str) -> None:
    """SpecError(`field`) unless every group names at least two parameters of the model, by layer, of one shape,
    and no parameter is in two groups."""
    seen: set[str] = set()
    for g, members in enumerate(groups):
        where = f"{field}[{g}]"
        if not isinstance(members, list | tuple) or len(members) < 2 or not all(isinstance(m, str) for m in members):
            raise SpecError(where, "must list at least two pipeline parameter names (layers.<i>.<name>)")
        shapes = []
        for name in members:
            try:
                layer, rest = split_global_param_name(name)
            except ValueError as exc:
                raise SpecError(where, str(exc)) from None
            if layer >= num_layers or rest not in layer_parameters(layer):
                raise SpecError(where, f"{name} is no parameter of this model")
            if name in seen:
                raise SpecError(where, f"{name} is in two groups (or twice in one)")
            seen.add(name)
            shapes.append(layer_parameters(layer)[rest])
        if any(shape != shapes[0] for shape in shapes):
            raise SpecError(where, f"ties parameters of different shapes {shapes}")
        layers = [split_global_param_name(m)[0] for m in members]
        if layers != sorted(layers):
            raise SpecError(where, "must list its members by layer (the first is the canonical copy)")


def tied_sum(parts: Sequence[T]) -> T:
    """The sum of a group's copies' gradients, `parts` in member order, added left to right: the one order every
    holder adds them in, so every copy steps with the same bits."""
    return reduce(lambda total, part: total + part, parts[1:], parts[0])


def stages_sharing(spec: ModelSpec, ranges: Sequence[tuple[int, int]], stage_index: int) -> tuple[int, ...]:
    """The other stages (by index) that hold a member of a group stage `stage_index` holds one of, in a pipeline
    whose stage i holds layers `ranges[i]`: those it sends its members' gradients to and takes theirs from."""
    start, end = ranges[stage_index]
    found: set[int] = set()
    for group in tied_groups(spec):
        if group.held(start, end):
            found |= {i for i, (s, e) in enumerate(ranges) if i != stage_index and group.held(s, e)}
    return tuple(sorted(found))


def tied_config(value: Any, field: str) -> bool:
    """A text model's `tie_word_embeddings` (default false): whether its LM head is its token embedding."""
    if not isinstance(value, bool):
        raise SpecError(field, f"must be true or false, got {value!r}")
    return value
