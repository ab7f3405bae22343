"""A text model that learned a repeating token sequence (what the sampling and serving tests continue)."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import torch.nn.functional as F

from arceus.model.build import build_full_model, named_global_parameters
from arceus.model.registry import model_spec_from_config


def trained_on(config: dict[str, Any], pattern: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Weights of the model `config` after learning the token sequence `pattern` repeated: trained once per model and
    pattern in a session (60 Adam steps cost seconds, and most tests train the same one), copied for each."""
    return {name: t.clone() for name, t in _trained_on(json.dumps(config, sort_keys=True), pattern).items()}


@functools.cache
def _trained_on(config_json: str, pattern: tuple[int, ...]) -> dict[str, torch.Tensor]:
    config = json.loads(config_json)
    model = build_full_model(model_spec_from_config(config), seed=0)
    block = model_spec_from_config(config).block_size
    ids = torch.tensor([pattern[i % len(pattern)] for i in range((block + 1) * 32)]).view(32, block + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in named_global_parameters(model)}
