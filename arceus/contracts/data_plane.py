"""What an agent's data plane speaks beyond PushStream, and which transport a link between two agents takes.

An agent declares its features when it registers (`data_plane`, the list `SPOKEN` of its version); the control plane
stores them on its node and puts in each assignment the features of this agent and of each one-agent neighbour
(`DataPlane`). Both ends of a link decide its transport from their assignments alone, with the one symmetric rule
`link_streamed`, so they always agree; an agent that declared nothing (a version older than the features) gets no
`data_plane` in its assignment and its links take PushStream, as every link of such a version does. A node declares
only its own features, at its own authenticated registration: it can move to PushStream only the links it is an end
of (docs/security.md)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from arceus.errors import SpecError

NEIGHBOUR_STREAM = "neighbour_stream"  # activations and gradients on one peer stream per pair (nodeagent)
SPOKEN: tuple[str, ...] = (NEIGHBOUR_STREAM,)  # what this version's agents speak, declared at registration
MAX_FEATURES = 16
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_ENDS = ("own", "prev", "next")


def features_check(value: Any, field: str) -> tuple[str, ...]:
    """A declared list of features, sorted: distinct lowercase names (a newer version's included: kept, never
    acted on here), at most MAX_FEATURES; SpecError naming `field` otherwise."""
    if not isinstance(value, list) or len(value) > MAX_FEATURES:
        raise SpecError(field, f"must be a list of at most {MAX_FEATURES} feature names, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not _NAME.fullmatch(item):
            raise SpecError(field, f"a feature is a lowercase name of letters, digits and _ (like "
                                   f"{NEIGHBOUR_STREAM!r}), got {item!r}")
    if len(set(value)) != len(value):
        raise SpecError(field, f"names each feature once, got {value!r}")
    return tuple(sorted(value))


def link_streamed(lower: Iterable[str], upper: Iterable[str]) -> bool:
    """Whether the link between two adjacent one-agent stages takes a neighbour stream rather than PushStream: only
    where both ends declared it. Symmetric, so each end reaches the same answer from its own assignment."""
    return NEIGHBOUR_STREAM in set(lower) & set(upper)


@dataclass(frozen=True)
class DataPlane:
    """An assignment's `data_plane`: the features this agent declared and those its previous and next stage's
    agents declared (empty: none, no such stage, or one of several agents: a tensor-parallel or replicated one).
    An assignment of an agent that declared none has no `data_plane` (an older agent refuses a field it does not
    know)."""

    own: tuple[str, ...] = ()
    prev: tuple[str, ...] = ()
    next: tuple[str, ...] = ()

    def to_json(self) -> dict[str, list[str]]:
        return {end: list(getattr(self, end)) for end in _ENDS}

    @classmethod
    def from_json(cls, value: Any, field: str = "assignment.data_plane") -> DataPlane:
        if value is None:
            return cls()
        if not isinstance(value, Mapping) or set(value) != set(_ENDS):
            raise SpecError(field, f"must be an object of exactly {', '.join(_ENDS)}: feature lists, got {value!r}")
        return cls(**{end: features_check(value[end], f"{field}.{end}") for end in _ENDS})
