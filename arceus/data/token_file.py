"""An uploaded text tokenized once, by the control plane, into a token file of a fixed layout that stages read by
byte range (arceus.data.upload_rows.token_layout) exactly as they read an uploaded tensor file's rows.

The layout, all little-endian:

    bytes 0..8     magic b"ARCTOK01"
    bytes 8..16    u64 training tokens T
    bytes 16..24   u64 validation tokens V
    bytes 24..28   u32 bytes per token: 2 (uint16, a vocabulary of at most 65,536 ids) or 4 (int32)
    bytes 28..32   u32 the vocabulary size every id is below
    bytes 32..     T + V token ids: the training part's (the text's first 90% of characters), then the validation
                   part's

A token file is fixed by its text and its tokenizer alone (never by a job's block_size: windows are views of it),
so the control plane keeps one per upload and `token_file_key`, and every job naming that pair reads the same file.
The text is read a piece at a time (`text_pieces`) and the ids written as they come: memory stays a piece's, however
large the upload. A BPE is trained on the training part streamed the same way (the validation part never informs it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from arceus.data.formats import DatasetFormatError, text_chunks
from arceus.data.tokenizer import TRAIN_FRACTION, BPETokenizer, CharTokenizer, TextTokenizer, train_bpe_from

MAGIC = b"ARCTOK01"
_HEADER = struct.Struct("<8sQQII")
HEADER_BYTES = _HEADER.size
TOKEN_DTYPES = {2: "uint16", 4: "int32"}  # bytes per token -> numpy's name
_MAX_VOCAB = {2: 1 << 16, 4: 1 << 31}  # bytes per token -> the ids it holds
_PIECE_CHARS = 1 << 20


class TokenFileError(DatasetFormatError):
    """A token file that is not what this module writes; the message says what is wrong."""


@dataclass(frozen=True)
class TokenCounts:
    """What a token file's header says: each part's tokens, their dtype and the vocabulary size ids are below."""

    train: int
    validation: int
    itemsize: int
    vocab_size: int

    @property
    def dtype(self) -> str:
        return TOKEN_DTYPES[self.itemsize]

    @property
    def size(self) -> int:
        """The whole file's bytes."""
        return HEADER_BYTES + (self.train + self.validation) * self.itemsize


def token_file_key(cfg: dict[str, Any]) -> str:
    """What a validated uploaded-text config's tokens depend on besides the text: its characters ("char"), a BPE of
    `vocab_size` trained on it ("bpe-<vocab_size>") or an uploaded tokenizer.json ("tokenizer-<its dataset id>")."""
    if cfg.get("tokenizer_id"):
        return f"tokenizer-{cfg['tokenizer_id']}"
    if cfg.get("vocab", "char") == "char":
        return "char"
    return f"bpe-{cfg['vocab_size']}"


def token_counts(handle: BinaryIO, size: int) -> TokenCounts:
    """A token file's header, checked against the file's `size`; TokenFileError naming what is wrong."""
    handle.seek(0)
    header = handle.read(HEADER_BYTES)
    if len(header) != HEADER_BYTES:
        raise TokenFileError(f"a token file of {size} bytes has no {HEADER_BYTES}-byte header")
    magic, train, validation, itemsize, vocab_size = _HEADER.unpack(header)
    if magic != MAGIC:
        raise TokenFileError(f"starts with {magic!r}, not a token file's {MAGIC!r}")
    if itemsize not in TOKEN_DTYPES or not 0 < vocab_size <= _MAX_VOCAB[itemsize]:
        raise TokenFileError(f"{itemsize} bytes a token for a vocabulary of {vocab_size} is not a layout")
    counts = TokenCounts(train, validation, itemsize, vocab_size)
    if counts.size != size:
        raise TokenFileError(f"the header says {counts.size} bytes, the file has {size}")
    return counts


def tokens_write(
    cfg: dict[str, Any], text: BinaryIO, out: BinaryIO, *, open_tokenizer: Callable[[], BinaryIO] | None = None
) -> TokenCounts:
    """Tokenize the uploaded text `text` of validated config `cfg` (its facts filled in) into `out` (seekable, at
    its start): the header, then the ids a piece at a time. `open_tokenizer()` opens the uploaded tokenizer.json
    where `cfg` names one (`tokenizer_id`). ValueError for a character outside a char vocabulary."""
    import numpy as np

    tokenizer, vocab_size = _tokenizer(cfg, text, open_tokenizer)
    itemsize = 2 if vocab_size <= _MAX_VOCAB[2] else 4
    dtype = np.dtype(TOKEN_DTYPES[itemsize]).newbyteorder("<")
    out.write(bytes(HEADER_BYTES))
    counts = {"training": 0, "validation": 0}
    for part, piece in text_pieces(cfg, text, train_only=False):
        ids = tokenizer.encode(piece)
        out.write(np.asarray(ids, dtype=dtype).tobytes())
        counts[part] += len(ids)
    out.seek(0)
    out.write(_HEADER.pack(MAGIC, counts["training"], counts["validation"], itemsize, vocab_size))
    return TokenCounts(counts["training"], counts["validation"], itemsize, vocab_size)


def _tokenizer(
    cfg: dict[str, Any], text: BinaryIO, open_tokenizer: Callable[[], BinaryIO] | None
) -> tuple[TextTokenizer, int]:
    """The config's tokenizer and the size of the vocabulary its ids are below (the tokenizer's own, not the
    model's, which may be larger: the file does not depend on it)."""
    if cfg.get("tokenizer_id"):
        from tokenizers import Tokenizer

        if open_tokenizer is None:
            raise ValueError(f"the config names tokenizer {cfg['tokenizer_id']} but nothing opens it")
        with open_tokenizer() as handle:
            tokenizer = Tokenizer.from_str(handle.read().decode("utf-8"))
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        return BPETokenizer(tokenizer, size), size
    if cfg.get("vocab", "char") == "char":
        char = CharTokenizer(cfg["vocabulary"])
        return char, char.vocab_size
    bpe = train_bpe_from((piece for _, piece in text_pieces(cfg, text, train_only=True)), cfg["vocab_size"])
    return bpe, bpe.vocab_size


def text_pieces(cfg: dict[str, Any], handle: BinaryIO, *, train_only: bool) -> Iterator[tuple[str, str]]:
    """("training" | "validation", text) pieces in order, cut at the 90% character mark as the bundled text is,
    and otherwise at line ends (a BPE word is never cut) or every `_PIECE_CHARS` characters in a line-less text."""
    cut = int(cfg["characters"] * TRAIN_FRACTION)
    part, seen, pending = "training", 0, ""
    for chunk in text_chunks(handle, cfg["format"], cfg.get("column", "text")):
        if part == "training" and seen + len(chunk) >= cut:
            yield part, pending + chunk[: cut - seen]
            if train_only:
                return
            part, pending, chunk = "validation", "", chunk[cut - seen :]
        seen += len(chunk)
        pending += chunk
        end = pending.rfind("\n") + 1 or (len(pending) if len(pending) >= _PIECE_CHARS else 0)
        if end:
            yield part, pending[:end]
            pending = pending[end:]
    if pending:
        yield part, pending
