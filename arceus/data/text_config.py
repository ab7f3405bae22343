"""`dataset_config` of the `text` dataset: a UTF-8 text file, tokenized by `vocab` ("char" or "bpe" with
`vocab_size` tokens), cut into windows of `block_size` tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arceus.data.formats import check_dataset_id
from arceus.data.tokenizer import CharTokenizer, TextTokenizer, check_vocab, read_text, text_tokenizer
from arceus.errors import SpecError

TEXT_DATASET = "text"
# An uploaded text (arceus.data.formats) is named by `dataset_id`, its tokenizer optionally by `tokenizer_id` (an
# uploaded tokenizer.json); the control plane fills in the upload's facts (a tenant's values are replaced).
TEXT_FACTS = frozenset({"kind", "format", "column", "characters", "vocabulary", "tokenizer_vocab_size"})
TEXT_KEYS = frozenset(
    {"name", "batch_size", "val_batch_size", "source", "block_size", "vocab", "vocab_size"}
    | {"dataset_id", "tokenizer_id"}
) | TEXT_FACTS
# Genesis to Deuteronomy, King James Version: public domain, see texts/README.md for its source.
BUNDLED_TEXT = Path(__file__).parent / "texts" / "kjv-pentateuch.txt"
MAX_BLOCK_SIZE = 65536


def validate_text_config(cfg: dict[str, Any], batch_size: int, val_batch_size: int) -> dict[str, Any]:
    """The normalised config; `source` absent means the bundled text. `block_size`, `vocab` and
    `vocab_size` may be left out at submission (the job takes the model's); loading needs block_size."""
    unknown = sorted(set(cfg) - TEXT_KEYS)
    if unknown:
        raise SpecError(f"dataset_config.{unknown[0]}", f"does not apply to the {TEXT_DATASET} dataset")
    out: dict[str, Any] = {"name": TEXT_DATASET, "batch_size": batch_size, "val_batch_size": val_batch_size}
    if "source" in cfg:
        source = cfg["source"]
        if not isinstance(source, str) or not source:
            raise SpecError("dataset_config.source", f"must be a non-empty path to a text file, got {source!r}")
        if not Path(source).expanduser().is_file():
            raise SpecError(
                "dataset_config.source",
                f"no text file at {Path(source).expanduser().resolve()}; leave it out for the bundled text",
            )
        out["source"] = source
    if "dataset_id" in cfg:
        if "source" in cfg:
            raise SpecError(
                "dataset_config.source", "names a server file; an uploaded text is named by dataset_id only"
            )
        out["dataset_id"] = check_dataset_id(cfg)
        if cfg.get("kind", "text") != "text":
            raise SpecError("dataset_config.dataset_id", f"names a {cfg['kind']} dataset, not a text")
        out |= {key: cfg[key] for key in TEXT_FACTS if key in cfg}
    if "tokenizer_id" in cfg:
        if "dataset_id" not in cfg:
            raise SpecError("dataset_config.tokenizer_id", "applies to an uploaded text (dataset_id) only")
        out["tokenizer_id"] = check_dataset_id(cfg, "tokenizer_id")
    if "block_size" in cfg:
        block = cfg["block_size"]
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK_SIZE:
            raise SpecError(
                "dataset_config.block_size", f"must be an integer between 1 and {MAX_BLOCK_SIZE}, got {block!r}"
            )
        out["block_size"] = block
    vocab = cfg.get("vocab", "char")
    if vocab == "char" and "vocab_size" in cfg:
        raise SpecError(
            "dataset_config.vocab_size", "a char vocabulary is the text's distinct characters; leave it out"
        )
    check_vocab(vocab, cfg.get("vocab_size"), prefix="dataset_config")
    if vocab != "char":  # absent means char, so configs stored before BPE existed read the same
        out["vocab"], out["vocab_size"] = vocab, cfg["vocab_size"]
    return out


def text_path(cfg: dict[str, Any]) -> Path:
    return Path(cfg["source"]).expanduser() if cfg.get("source") else BUNDLED_TEXT


def dataset_tokenizer(cfg: dict[str, Any]) -> TextTokenizer:
    """The tokenizer of a validated `text` dataset config (of an upload: its characters only; its BPE trains on
    the file, which the driver alone reads: arceus.data.streaming)."""
    if "dataset_id" in cfg:
        if cfg.get("vocab", "char") != "char":
            raise SpecError(
                "dataset_config.vocab",
                f"the {cfg['vocab']} tokenizer of an uploaded text is rebuilt by its driver only",
            )
        return CharTokenizer(text_vocabulary(cfg))
    return text_tokenizer(text_path(cfg), cfg.get("vocab", "char"), cfg.get("vocab_size"))


def text_vocabulary(cfg: dict[str, Any]) -> str:
    """The character vocabulary of the text a validated `text` dataset config names (an upload's: its facts)."""
    if "dataset_id" in cfg:
        if not cfg.get("vocabulary"):
            raise SpecError(
                "dataset_config.dataset_id",
                f"dataset {cfg['dataset_id']} has too many distinct characters for a char vocabulary; use vocab bpe",
            )
        return cfg["vocabulary"]
    return "".join(sorted(set(read_text(text_path(cfg)))))
