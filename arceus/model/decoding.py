"""Decoding a sequence a few positions at a time, each layer keeping what it needs of the positions before
(an attention layer: their keys and values), so a new token costs one position's compute, not the window's.

A layer that decodes has `decode(x, position, cache)`: `x` holds positions [position, position + t), `cache`
is the layer's own KVCache. `decode` over a model's layers equals their plain forward on the whole prefix,
position by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class KVCache:
    """One attention layer's keys and values of the positions decoded so far, [batch, heads, positions,
    head_dim] (None before the first)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; all of them so far."""
        if self.keys is not None and self.values is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values


@dataclass
class DecodeState:
    """A sequence being decoded by a range of layers: how many positions they have seen, and each layer's
    cache."""

    position: int = 0
    caches: list[KVCache] = field(default_factory=list)


def decodes(layers: nn.Sequential) -> bool:
    """Whether every layer can decode position by position."""
    return all(callable(getattr(layer, "decode", None)) for layer in layers)


def decode(layers: nn.Sequential, x: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Run the next positions `x` ([batch, t, ...]) through `layers`, extending `state`."""
    if not state.caches:
        state.caches = [KVCache() for _ in layers]
    for layer, cache in zip(layers, state.caches, strict=True):
        x = layer.decode(x, state.position, cache)
    state.position += x.shape[1]
    return x


def causal_mask(new: int, position: int, device: torch.device) -> torch.Tensor:
    """[new, position + new] booleans: query i (at position + i) may attend to key j iff j <= position + i."""
    return torch.ones(new, position + new, dtype=torch.bool, device=device).tril(diagonal=position)
