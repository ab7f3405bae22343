"""arceus.json_input: JSON that others wrote is parsed only within its bounds, and each refusal names where."""

from __future__ import annotations

import json

import pytest

from arceus.errors import SpecError
from arceus.json_input import MAX_DEPTH, json_depth_check, json_loads_bounded


def test_a_document_within_the_bounds_parses_as_json_would() -> None:
    text = json.dumps({"a": [1, 2.5, {"b": '[not nesting]{\\"}'}], "c": None, "d": True})
    assert json_loads_bounded(text, where="") == json.loads(text)
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert json_loads_bounded(nested.encode(), where="x") == json.loads(nested)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 500_000])
def test_nesting_past_the_bound_is_refused_before_parsing(depth: int) -> None:
    with pytest.raises(SpecError) as refused:
        json_loads_bounded('{"model_config": ' + "[" * depth + "]" * depth + "}", where="body")
    assert refused.value.field == "body" and f"more than {MAX_DEPTH} deep" in refused.value.message


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = json.dumps({"text": "[" * 10_000, "escaped": '\\"[[[[' * 100})
    json_depth_check(text, where="")
    assert json_loads_bounded(text, where="")["text"] == "[" * 10_000


@pytest.mark.parametrize(("text", "field", "message"), [
    ('{"a": {"lr": NaN}}', "a.lr", "must be a finite number, got nan"),
    ('{"a": [1, Infinity]}', "a[1]", "must be a finite number, got inf"),
    ('{"a": [1, 2, -1e999]}', "a[2]", "must be a finite number, got -inf"),
    ('{"name": "x\\u0000y"}', "name", "contains a NUL character"),
    ('{"a": {"b\\u0000": 1}}', "a", "has a key with a NUL character"),
    ('"\\u0000"', "body", "contains a NUL character"),
])
def test_non_finite_numbers_and_nul_characters_are_refused_naming_where(text: str, field: str, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        json_loads_bounded(text, where="" if field != "body" else "body")
    assert (refused.value.field, message in refused.value.message) == (field, True)


def test_malformed_json_is_jsons_own_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        json_loads_bounded('{"a": ', where="")
