"""Sampling text from a model that writes text, a token at a time, over a per-layer key/value cache: the
loop (`generate`) takes any `Decoder`, so the pipeline's agents (`arceus.training.sampling`) and one
process (`sample_text`) sample the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from arceus.data.tokenizer import TextTokenizer
from arceus.model.build import build_full_model
from arceus.model.decoding import DecodeState, decode
from arceus.model.registry import architecture_of, model_spec_from_config, text_writers
from arceus.model.spec import TextModelSpec

# (token ids [1, t] at positions [start, start + t), start) -> the next token's logits [1, vocab]. A start of
# 0 begins a new sequence; otherwise it continues the one decoded so far, which ends at `start`.
Decoder = Callable[[torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def generate(
    decoder: Decoder,
    block_size: int,
    ids: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend `ids` [1, t] by `new_tokens`, each sampled from the model's next-token distribution over the
    last `block_size` tokens (temperature 0: the most likely token). While the sequence fits the window
    only the new token is decoded; past it the window slides and is decoded afresh (positions shift)."""
    decoded = 0  # positions the decoder holds of `ids`
    for _ in range(new_tokens):
        fits = ids.shape[1] <= block_size
        logits = decoder(ids[:, decoded:], decoded) if fits else decoder(ids[:, -block_size:], 0)
        decoded = min(ids.shape[1], block_size)
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
    return ids


def text_spec(model_config: dict[str, Any], tokenizer: TextTokenizer) -> TextModelSpec:
    """The spec of a model that writes text with this tokenizer; ValueError if it does not."""
    spec = model_spec_from_config(model_config)
    if not architecture_of(spec).writes_text:
        raise ValueError(f"only a {' or '.join(text_writers())} model generates text")
    spec = cast(TextModelSpec, spec)
    if spec.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"the model has {spec.vocab_size} tokens but the tokenizer {tokenizer.vocab_size}")
    return spec


def prompt_ids(tokenizer: TextTokenizer, prompt: str) -> torch.Tensor:
    """The prompt's token ids [1, t]; ValueError if it holds none."""
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.int64)
    if ids.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token")
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
    """`prompt` followed by `length` tokens sampled in this process from the whole model's `weights` (as the
    pipeline names them: "layers.<i>...."): the reference the pipeline's sampling matches. ValueError if the
    model is no text model of this tokenizer's size, or the prompt cannot be encoded."""
    spec = text_spec(model_config, tokenizer)
    model = build_full_model(spec, seed=0)
    state = {name.removeprefix("layers."): tensor for name, tensor in weights.items()}
    model.load_state_dict(state)  # strict: every parameter must be there
    model.eval()
    sequence = DecodeState()

    def decoder(ids: torch.Tensor, start: int) -> torch.Tensor:
        nonlocal sequence
        if start == 0:
            sequence = DecodeState()
        return decode(model, ids, sequence)[:, -1, :]

    out = generate(
        decoder, spec.block_size, prompt_ids(tokenizer, prompt), length, temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )
    return tokenizer.decode(out[0].tolist())
