"""How a `text` dataset becomes tokens: characters (the default) or byte-level BPE.

- "char": every distinct character of the whole text, sorted; token i is the i-th character. A prompt
  may use only those characters.
- "bpe": a byte-level BPE tokenizer (Hugging Face `tokenizers`) trained on the training part of the
  text (the validation part never informs it) up to `vocab_size` tokens. Any UTF-8 string encodes.
  Training is deterministic, so the driver, a resumed run and the sampling API all rebuild the same
  tokenizer from the same file; each process trains it once per file version and size.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from arceus.errors import SpecError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

VOCABS = ("char", "bpe")  # how a text becomes tokens: its characters, or byte-level BPE
TRAIN_FRACTION = 0.9
BPE_MIN_VOCAB = 257  # the 256 byte tokens and at least one merge
BPE_MAX_VOCAB = 65536
BPE_DEFAULT_VOCAB = 1024


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def unknown(self, text: str) -> str:
        """The characters of `text` this tokenizer cannot encode, sorted and distinct ("" if none)."""
        ...


class CharTokenizer:
    def __init__(self, vocabulary: str) -> None:
        self.vocabulary = vocabulary
        self._index = {c: i for i, c in enumerate(vocabulary)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocabulary[i] for i in ids)

    def unknown(self, text: str) -> str:
        return "".join(sorted(set(text) - set(self._index)))


class BPETokenizer:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        # The model's embedding size, not the trained count: a short text may stop merging early,
        # and every id stays below it either way.
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def unknown(self, text: str) -> str:
        return ""  # byte-level: every string is bytes

    def to_json(self) -> str:
        return self._tokenizer.to_str()


def train_bpe(text: str, vocab_size: int) -> BPETokenizer:
    return train_bpe_from([text], vocab_size)


def train_bpe_from(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A BPE trained on `texts` as they come (an uploaded text streams in pieces, never whole)."""
    # Imported here: every control-plane process imports this module (job specs name a vocabulary) and few train.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tokenizer, vocab_size)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("dataset_config.source", f"cannot read {path} as UTF-8 text: {exc}") from exc


def split_text(text: str) -> tuple[str, str]:
    """(training part, validation part): the first 90% of the characters, then the rest."""
    cut = int(len(text) * TRAIN_FRACTION)
    return text[:cut], text[cut:]


def check_vocab(vocab: Any, vocab_size: Any, *, prefix: str) -> None:
    """Validate a (vocab, vocab_size) pair of `prefix` ("model_config" or "dataset_config")."""
    if vocab not in VOCABS:
        raise SpecError(f"{prefix}.vocab", f"must be one of {', '.join(VOCABS)}, got {vocab!r}")
    if vocab == "bpe" and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
        or not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB
    ):
        raise SpecError(
            f"{prefix}.vocab_size",
            f"a bpe vocabulary needs an integer size between {BPE_MIN_VOCAB} and {BPE_MAX_VOCAB:,} "
            f"(256 byte tokens plus merges), got {vocab_size!r}",
        )


def text_tokenizer(path: Path, vocab: str, vocab_size: int | None) -> TextTokenizer:
    """The tokenizer of the text at `path`; built once per process per file version."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise SpecError("dataset_config.source", f"cannot read {path}: {exc}") from exc
    return _cached_tokenizer(path.resolve(), stat.st_mtime_ns, stat.st_size, vocab, vocab_size)


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(path: Path, mtime_ns: int, size: int, vocab: str, vocab_size: int | None) -> TextTokenizer:
    text = read_text(path)
    if vocab == "char":
        return CharTokenizer("".join(sorted(set(text))))
    assert vocab_size is not None, "check_vocab validates a bpe size first"
    return train_bpe(split_text(text)[0], vocab_size)
