"""Strict readers for the swarm's JSON documents (routes, holdings, repair instructions): each names the field
that is wrong, so a bad document from the wire or a static file is refused with a clear SpecError."""

from __future__ import annotations

from typing import Any

from arceus.errors import SpecError


def exact_object(value: Any, field: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """`value` as an object with exactly `keys` (a missing or an unknown key is an error)."""
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object with keys {', '.join(keys)}, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    unknown = sorted(str(k) for k in value if k not in keys)
    if missing or unknown:
        raise SpecError(field, f"missing keys {missing}, unknown keys {unknown}; expected exactly {list(keys)}")
    return value


def integer(value: Any, field: str, *, minimum: int = 0) -> int:
    """An int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(field, f"must be at least {minimum}, got {value}")
    return value


def optional_integer(value: Any, field: str) -> int | None:
    """A non-negative int, or null."""
    return None if value is None else integer(value, field)


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, f"must be true or false, got {value!r}")
    return value


def array(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise SpecError(field, f"must be an array, got {type(value).__name__}")
    return value


def integers(value: Any, field: str) -> tuple[int, ...]:
    """An array of non-negative ints."""
    return tuple(integer(v, f"{field}[{j}]") for j, v in enumerate(array(value, field)))


def pairs(value: Any, field: str) -> tuple[tuple[int, int], ...]:
    """An array of [micro_batch, replica] pairs of non-negative ints."""
    out = []
    for j, pair in enumerate(array(value, field)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise SpecError(f"{field}[{j}]", f"must be a [micro_batch, replica] pair, got {pair!r}")
        out.append((integer(pair[0], f"{field}[{j}][0]"), integer(pair[1], f"{field}[{j}][1]")))
    return tuple(out)
