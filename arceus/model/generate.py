"""Sample text from a trained text model (single process): the model, its weights as the pipeline names them
("layers.<i>...."), and the tokenizer of the text it trained on."""

from __future__ import annotations

from typing import Any, cast

import torch

from arceus.data.tokenizer import TextTokenizer
from arceus.model.build import build_full_model
from arceus.model.registry import architecture_of, model_spec_from_config, text_writers
from arceus.model.spec import TextModelSpec


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    block_size: int,
    ids: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend `ids` [1, t] by `new_tokens`, each sampled from the model's next-token distribution over
    the last `block_size` tokens (temperature 0: the most likely token)."""
    for _ in range(new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :]
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
    return ids


def sample_text(
    model_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    tokenizer: TextTokenizer,
    *,
    prompt: str = "\n",
    length: int = 200,
    temperature: float = 1.0,
    seed: int = 0,
) -> str:
    """`prompt` followed by `length` sampled tokens; ValueError if the model is no text model of this
    tokenizer's size, or the prompt cannot be encoded."""
    spec = model_spec_from_config(model_config)
    if not architecture_of(spec).writes_text:
        raise ValueError(f"only a {' or '.join(text_writers())} model generates text")
    spec = cast(TextModelSpec, spec)
    if spec.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"the model has {spec.vocab_size} tokens but the tokenizer {tokenizer.vocab_size}")
    model = build_full_model(spec, seed=0)
    state = {name.removeprefix("layers."): tensor for name, tensor in weights.items()}
    model.load_state_dict(state)  # strict: every parameter must be there
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.int64)
    if ids.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token")
    out = generate(
        model, spec.block_size, ids, length, temperature=temperature, generator=torch.Generator().manual_seed(seed)
    )
    return tokenizer.decode(out[0].tolist())
