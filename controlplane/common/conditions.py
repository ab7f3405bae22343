"""Kubernetes-style status conditions kept as a JSON list on a row: {type, status, reason, message,
last_transition_time}. Pure helpers; the time is passed in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # TRUE, FALSE or UNKNOWN
    reason: str  # CamelCase, machine-readable
    message: str = ""  # for humans


def get_condition(conditions: Sequence[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def has_condition(conditions: Sequence[dict[str, Any]], condition: Condition) -> bool:
    """Whether `condition` is already recorded exactly (so setting it again would write nothing)."""
    current = get_condition(conditions, condition.type)
    return current is not None and (current["status"], current["reason"], current["message"]) == (
        condition.status,
        condition.reason,
        condition.message,
    )


def set_conditions(conditions: Sequence[dict[str, Any]], *updates: Condition, now: datetime) -> list[dict[str, Any]]:
    """A copy of `conditions` with `updates` applied; last_transition_time moves only when the status
    changes, as in Kubernetes, so it answers "since when has this been true"."""
    out = [dict(c) for c in conditions]
    for update in updates:
        current = get_condition(out, update.type)
        entry = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message,
            "last_transition_time": now.isoformat(),
        }
        if current is None:
            out.append(entry)
            continue
        if current["status"] == update.status:
            entry["last_transition_time"] = current["last_transition_time"]
        current.update(entry)
    return out
