"""Checks of a model config's fields that several architectures' specs make; each SpecError names
`model_config.<key>` and what to write instead."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from arceus.data.tokenizer import VOCABS
from arceus.errors import SpecError


def known_keys_check(config: dict[str, Any], keys: Collection[str], model: str) -> None:
    """Refuse the first key of `config` outside `keys`; `model` names the architecture ("a llama")."""
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise SpecError(
            f"model_config.{unknown[0]}", f"unknown key for {model}; allowed keys: {', '.join(sorted(keys))}"
        )


def positive_int(config: dict[str, Any], key: str, default: int | None, limit: int) -> int:
    """`config[key]` (else `default`): an integer from 1 to `limit`."""
    value = config.get(key, default)
    field = f"model_config.{key}"
    # bool is an int subclass; `true` in JSON is never a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be a positive integer, got {value!r}")
    if not 1 <= value <= limit:
        raise SpecError(field, f"must be between 1 and {limit:,}, got {value:,}")
    return value


def text_vocab(config: dict[str, Any]) -> str:
    """A text model's tokenizer kind (`vocab`, "char" by default), once `vocab_size` is there too."""
    vocab = config.get("vocab", "char")
    if vocab not in VOCABS:
        raise SpecError("model_config.vocab", f"must be one of {', '.join(VOCABS)}, got {vocab!r}")
    if "vocab_size" not in config:
        raise SpecError(
            "model_config.vocab_size",
            "is required; job submission fills it in (the text's distinct characters, or 1024 for bpe)",
        )
    return vocab
