"""The one error shape: {"detail": str, "errors"?: {dotted.field: [messages]}}."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.common.conditions import Condition, get_condition, has_condition, set_conditions
from controlplane.common.exception_handler import flatten_errors

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def test_nested_serializer_errors_become_dotted_paths() -> None:
    detail = {
        "epochs": ["Too big."],
        "capabilities": {"memory_bytes": ["Too small."], "non_field_errors": ["Bad object."]},
        "observed": {0: {"state": ["Bad choice."]}},
        "items": [{}, {"x": ["Wrong."]}],
        "non_field_errors": ["Whole body."],
    }
    assert flatten_errors(detail) == {
        "epochs": ["Too big."],
        "capabilities.memory_bytes": ["Too small."],
        "capabilities": ["Bad object."],
        "observed[0].state": ["Bad choice."],
        "items[1].x": ["Wrong."],
        "non_field_errors": ["Whole body."],
    }


def test_conditions_keep_their_transition_time_while_the_status_holds() -> None:
    waiting = Condition("Placed", "False", "WaitingForNodes", "needs 3 Ready nodes, 1 available")
    first = set_conditions([], waiting, now=T0)
    assert first == [{**waiting.__dict__, "last_transition_time": T0.isoformat()}]
    later = T0 + timedelta(seconds=5)
    fewer = Condition("Placed", "False", "WaitingForNodes", "needs 3 Ready nodes, 0 available")
    second = set_conditions(first, fewer, now=later)
    assert get_condition(second, "Placed")["last_transition_time"] == T0.isoformat()
    assert has_condition(second, fewer) and not has_condition(second, waiting)
    placed = set_conditions(second, Condition("Placed", "True", "Placed", "ok"), now=later)
    assert get_condition(placed, "Placed")["last_transition_time"] == later.isoformat()
    assert first[0]["message"] == waiting.message  # inputs are not modified
