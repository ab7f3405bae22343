"""The heartbeat body's one schema, Django-free: the quiet path (controlplane/agents/heartbeat.py) parses with it on the
event loop and the API (`AgentHeartbeatApi`) with it in Django, so both take exactly the same bodies; the API answers
a refused body's `errors` ({dotted field: [message]}).

    {"observed": [{"stage_id", "generation", "state": "ready"|"failed", "message"?}], "host_busy_fraction"?,
     "link"?: {"rtt_seconds", "bandwidth_bytes_per_second"}, "neighbour_links"?: [{"address", "rtt_seconds",
     "bandwidth_bytes_per_second"}], "relay"?: {"attached"?, "failed"?: [address]}, "assignments_version"?}
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from arceus.contracts.observed import ObservedStage, ObservedState
from controlplane.nodes.addresses import grpc_address_problem

MAX_NEIGHBOUR_LINKS = 64  # an agent has two neighbours per hosted stage
MAX_RELAYS_REPORTED = 16
MAX_VERSION_CHARS = 64
MAX_ADDRESS_CHARS = 255
MAX_STAGE_ID_CHARS = 200
MAX_RTT_SECONDS = 600
KEYS = ("observed", "host_busy_fraction", "link", "neighbour_links", "relay", "assignments_version")
_OBSERVED_KEYS = ("stage_id", "generation", "state", "message")
_LINK_KEYS = ("rtt_seconds", "bandwidth_bytes_per_second")
_NEIGHBOUR_KEYS = ("address", *_LINK_KEYS)
_RELAY_KEYS = ("attached", "failed")
_STATES = (ObservedState.READY.value, ObservedState.FAILED.value)
# What the quiet path (controlplane/agents/heartbeat.py) answers itself: the lease's host load, the relay its answer
# names, the version held, and stage reports it compares with the recorded ones (changed: the API records them).
QUIET_FIELDS = frozenset({"observed", "host_busy_fraction", "relay", "assignments_version"})
REQUIRED = "This field is required."
NOT_NULL = "This field may not be null."


class HeartbeatInvalid(ValueError):
    """The body breaks the schema: `errors` maps each dotted field ("observed[0].generation") to what is wrong."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class Heartbeat:
    observed: list[ObservedStage] = field(default_factory=list)
    host_busy_fraction: float | None = None
    link: dict[str, float] | None = None
    neighbour_links: list[dict[str, Any]] = field(default_factory=list)
    relay: dict[str, Any] | None = None  # {"attached": address | None, "failed": [address]}
    assignments_version: str | None = None  # None or "": the agent holds none

    @property
    def quiet(self) -> bool:
        """Whether the quiet path may answer it: every field but QUIET_FIELDS at its default, so a measured link,
        or any field added later (counters the ledger bills from, say), is recorded by the API unless the quiet
        path is taught it."""
        return all(getattr(self, f.name) == _default(f) for f in fields(self) if f.name not in QUIET_FIELDS)


def _default(item: Field[Any]) -> Any:
    return item.default_factory() if item.default is MISSING else item.default


def heartbeat_parse(body: Any) -> Heartbeat:
    """The heartbeat in `body` (parsed JSON); HeartbeatInvalid naming every field that is wrong."""
    errors: dict[str, list[str]] = {}
    if not isinstance(body, dict):
        raise HeartbeatInvalid({"non_field_errors": [_not_object(body)]})
    _unknown(body, KEYS, "", errors)
    observed = _list(body, "observed", "", errors, _observed, maximum=None, default=[])
    fraction = _number(body, "host_busy_fraction", "", errors, minimum=0, maximum=1, nullable=True)
    link = _object(body, "link", "", errors, _link)
    links = _list(body, "neighbour_links", "", errors, _neighbour_link, maximum=MAX_NEIGHBOUR_LINKS, default=[])
    addresses = [link["address"] for link in links or () if link is not None]
    if len(set(addresses)) != len(addresses):
        errors.setdefault("neighbour_links", []).append("each neighbour address may appear once")
    relay = _object(body, "relay", "", errors, _relay)
    version = _string(body, "assignments_version", "", errors, MAX_VERSION_CHARS, blank=True, required=False)
    if errors:
        raise HeartbeatInvalid(errors)
    return Heartbeat(observed=observed or [], host_busy_fraction=fraction, link=link, neighbour_links=links or [],
                     relay=relay, assignments_version=version)


def _observed(item: dict[str, Any], at: str, errors: dict[str, list[str]]) -> ObservedStage | None:
    stage_id = _string(item, "stage_id", at, errors, MAX_STAGE_ID_CHARS)
    generation = _integer(item, "generation", at, errors, minimum=0)
    state = item.get("state")
    if "state" not in item:
        _error(errors, at, "state", REQUIRED)
    elif state not in _STATES:
        _error(errors, at, "state", f'"{state}" is not a valid choice.')
    message = _string(item, "message", at, errors, None, blank=True, required=False, trim=False)
    if stage_id is None or generation is None or state not in _STATES:
        return None
    return ObservedStage(stage_id=stage_id, generation=generation, state=state, message=message or "")


def _link(item: dict[str, Any], at: str, errors: dict[str, list[str]]) -> dict[str, float] | None:
    rtt = _number(item, "rtt_seconds", at, errors, greater_than=0, maximum=MAX_RTT_SECONDS)
    bandwidth = _number(item, "bandwidth_bytes_per_second", at, errors, greater_than=0)
    return None if rtt is None or bandwidth is None else {"rtt_seconds": rtt, "bandwidth_bytes_per_second": bandwidth}


def _neighbour_link(item: dict[str, Any], at: str, errors: dict[str, list[str]]) -> dict[str, Any] | None:
    if _unknown(item, _NEIGHBOUR_KEYS, at, errors):
        return None
    address = _address(item, "address", at, errors)
    rtt = _number(item, "rtt_seconds", at, errors, greater_than=0, maximum=MAX_RTT_SECONDS, nullable=True,
                  required=True)
    bandwidth = _number(item, "bandwidth_bytes_per_second", at, errors, greater_than=0, nullable=True, required=True)
    if _has_errors(errors, at):
        return None
    if (rtt is None) != (bandwidth is None):
        errors.setdefault(at, []).append("rtt_seconds and bandwidth_bytes_per_second are both set or both null")
        return None
    return {"address": address, "rtt_seconds": rtt, "bandwidth_bytes_per_second": bandwidth}


def _relay(item: dict[str, Any], at: str, errors: dict[str, list[str]]) -> dict[str, Any] | None:
    if _unknown(item, _RELAY_KEYS, at, errors):
        return None
    attached = _address(item, "attached", at, errors, nullable=True, required=False)
    failed = _list(item, "failed", at, errors, None, maximum=MAX_RELAYS_REPORTED, default=[])
    for index, address in enumerate(failed or ()):
        _address({"failed": address}, "failed", at, errors, path=f"{_join(at, 'failed')}[{index}]")
    return None if _has_errors(errors, at) else {"attached": attached, "failed": list(failed or [])}


def _address(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]], *, nullable: bool = False,
             required: bool = True, path: str | None = None) -> str | None:
    value = _string(data, key, at, errors, MAX_ADDRESS_CHARS, nullable=nullable, required=required, path=path)
    if value is not None and (problem := grpc_address_problem(value)):
        errors.setdefault(path or _join(at, key), []).append(problem)
        return None
    return value


def _string(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]], max_chars: int | None, *,
            blank: bool = False, required: bool = True, nullable: bool = False, trim: bool = True,
            path: str | None = None) -> str | None:
    where = path or _join(at, key)
    value = _given(data, key, where, errors, required=required, nullable=nullable)
    if value is None:
        return None
    if not isinstance(value, str):
        errors.setdefault(where, []).append("Not a valid string.")
        return None
    if trim and value != value.strip():
        errors.setdefault(where, []).append("Must not begin or end with whitespace.")
        return None
    if not value and not blank:
        errors.setdefault(where, []).append("This field may not be blank.")
        return None
    if max_chars is not None and len(value) > max_chars:
        errors.setdefault(where, []).append(f"Ensure this field has no more than {max_chars} characters.")
        return None
    return value


def _given(data: dict[str, Any], key: str, where: str, errors: dict[str, list[str]], *, required: bool,
           nullable: bool) -> Any:
    """`data[key]`, or None: absent (an error where `required`) or null (an error unless `nullable`)."""
    if key not in data:
        if required:
            errors.setdefault(where, []).append(REQUIRED)
        return None
    value = data[key]
    if value is None and not nullable:
        errors.setdefault(where, []).append(NOT_NULL)
    return value


def _integer(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]], *, minimum: int) -> int | None:
    where = _join(at, key)
    if key not in data:
        errors.setdefault(where, []).append(REQUIRED)
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        errors.setdefault(where, []).append(f"Must be a JSON integer (e.g. 5), got {value!r}.")
        return None
    if value < minimum:
        errors.setdefault(where, []).append(f"Ensure this value is greater than or equal to {minimum}.")
        return None
    return value


def _number(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]], *, minimum: float | None = None,
            maximum: float | None = None, greater_than: float | None = None, nullable: bool = False,
            required: bool | None = None) -> float | None:
    where = _join(at, key)
    value = _given(data, key, where, errors, required=required if required is not None else not nullable,
                   nullable=nullable)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        errors.setdefault(where, []).append(f"Must be a finite JSON number (e.g. 0.01), got {value!r}.")
        return None
    problem = (
        f"Must be greater than {greater_than}, got {value}." if greater_than is not None and value <= greater_than
        else f"Ensure this value is greater than or equal to {minimum}." if minimum is not None and value < minimum
        else f"Ensure this value is less than or equal to {maximum}." if maximum is not None and value > maximum
        else None
    )
    if problem:
        errors.setdefault(where, []).append(problem)
        return None
    return float(value)


def _object(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]],
            parse: Callable[[dict[str, Any], str, dict[str, list[str]]], Any]) -> Any:
    """A nullable, optional object field parsed by `parse`."""
    value = data.get(key)
    if value is None:
        return None
    where = _join(at, key)
    if not isinstance(value, dict):
        errors.setdefault(where, []).append(_not_object(value))
        return None
    return parse(value, where, errors)


def _list(data: dict[str, Any], key: str, at: str, errors: dict[str, list[str]],
          parse: Callable[[dict[str, Any], str, dict[str, list[str]]], Any] | None, *, maximum: int | None,
          default: list[Any]) -> list[Any] | None:
    """An optional list field; each item an object parsed by `parse` (None: kept as it is, checked by the caller)."""
    where = _join(at, key)
    value = data.get(key, default)
    if value is None:
        errors.setdefault(where, []).append(NOT_NULL)
        return None
    if not isinstance(value, list):
        errors.setdefault(where, []).append(f'Expected a list of items but got type "{type(value).__name__}".')
        return None
    if maximum is not None and len(value) > maximum:
        errors.setdefault(where, []).append(f"Ensure this field has no more than {maximum} elements.")
        return None
    if parse is None:
        return value
    items = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            errors.setdefault(f"{where}[{index}]", []).append(_not_object(item))
        else:
            items.append(parse(item, f"{where}[{index}]", errors))
    return items


def _unknown(data: dict[str, Any], known: tuple[str, ...], at: str, errors: dict[str, list[str]]) -> bool:
    unknown = sorted(set(data) - set(known))
    for key in unknown:
        errors.setdefault(_join(at, key), []).append(f"Unknown field; allowed fields: {', '.join(sorted(known))}.")
    return bool(unknown)


def _not_object(value: Any) -> str:
    return f"Invalid data. Expected a dictionary, but got {type(value).__name__}."


def _has_errors(errors: dict[str, list[str]], at: str) -> bool:
    return any(key == at or key.startswith((f"{at}.", f"{at}[")) for key in errors)


def _error(errors: dict[str, list[str]], at: str, key: str, message: str) -> None:
    errors.setdefault(_join(at, key), []).append(message)


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def _address_schema(nullable: bool = False) -> dict[str, Any]:
    return {"type": "string", "maxLength": MAX_ADDRESS_CHARS, "description": "host:port", "nullable": nullable}


def _link_schema(nullable: bool) -> dict[str, Any]:
    number = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": nullable}  # OpenAPI 3.0
    return {"rtt_seconds": {**number, "maximum": MAX_RTT_SECONDS}, "bandwidth_bytes_per_second": number}


# The same schema for the API's documentation (drf-spectacular takes it as the request body's JSON schema).
OPENAPI: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "observed": {"type": "array", "items": {
            "type": "object", "required": ["stage_id", "generation", "state"],
            "properties": {"stage_id": {"type": "string", "maxLength": MAX_STAGE_ID_CHARS},
                           "generation": {"type": "integer", "minimum": 0},
                           "state": {"type": "string", "enum": list(_STATES)}, "message": {"type": "string"}}}},
        "host_busy_fraction": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True,
                               "description": "CPU share used by the machine's other processes since the last "
                               "heartbeat"},
        "link": {"type": "object", "nullable": True, "required": list(_LINK_KEYS), "properties": _link_schema(False)},
        "neighbour_links": {"type": "array", "maxItems": MAX_NEIGHBOUR_LINKS,
                            "description": "Links to pipeline neighbours measured since the last heartbeat",
                            "items": {"type": "object", "additionalProperties": False,
                                      "required": list(_NEIGHBOUR_KEYS),
                                      "properties": {"address": _address_schema(), **_link_schema(True)}}},
        "relay": {"type": "object", "nullable": True, "additionalProperties": False,
                  "properties": {"attached": _address_schema(nullable=True),
                                 "failed": {"type": "array", "maxItems": MAX_RELAYS_REPORTED,
                                            "items": _address_schema()}}},
        "assignments_version": {"type": "string", "maxLength": MAX_VERSION_CHARS,
                                "description": "The assignments_version of the assignments the agent holds: if "
                                "still current, the answer leaves out `assignments`"},
    },
}
