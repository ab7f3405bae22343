"""JSON that others wrote (request bodies, uploaded programs, file headers), parsed only within bounds.

Python's parser recurses once per level of nesting, so a body of 100 kB of `[` exhausts the stack
(RecursionError) before any check could run: the depth is measured first, without parsing. Once parsed, every
number must be finite (NaN, Infinity and literals beyond a float's range, such as 1e999, parse as non-finite
floats) and no key or string may hold a NUL character (PostgreSQL cannot store one, and no path holds one).
Each refusal is a SpecError naming where it is, as a dotted path under `where` ("model_config.layer_sizes[1]").
Malformed JSON is json's own JSONDecodeError (a ValueError), as with `json.loads`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from arceus.errors import SpecError

MAX_DEPTH = 32  # nested objects and arrays; our documents nest a few levels
# A JSON string (escapes included), so that brackets inside strings are not counted as nesting.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_loads_bounded(data: str | bytes, *, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """`data` parsed, once it nests at most `max_depth` deep and holds only finite numbers and NUL-free text."""
    text = data.decode() if isinstance(data, bytes) else data
    json_depth_check(text, where=where, max_depth=max_depth)
    value = json.loads(text)
    _check(value, where)
    return value


def json_depth_check(text: str, *, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse `text` when its objects and arrays nest more than `max_depth` deep (malformed text is left to the
    parser); for documents whose strings may hold anything (a dataset's records)."""
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > max_depth:
            raise SpecError(
                where, f"nests objects and arrays more than {max_depth} deep; at most {max_depth} levels are read"
            )


def _check(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(where, f"must be a finite number, got {value}: NaN, Infinity and numbers beyond ±1.8e308 "
                        "are not JSON numbers")
    if isinstance(value, str) and "\x00" in value:
        raise SpecError(where, "contains a NUL character (\\u0000); remove it")
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if "\x00" in key:
                raise SpecError(where, "has a key with a NUL character (\\u0000); remove it")
            _check(item, f"{where}.{key}" if where else key)
