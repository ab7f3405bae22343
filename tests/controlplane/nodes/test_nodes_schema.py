"""The heartbeat body's one schema (controlplane/nodes/schema.py): what it takes, what it refuses and how it names
the field, which bodies are quiet, and that the API documents the same fields it parses."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
from rest_framework.test import APIClient

from arceus.contracts.observed import ObservedStage
from controlplane.nodes.schema import (
    KEYS,
    MAX_RELAYS_REPORTED,
    QUIET_FIELDS,
    Heartbeat,
    HeartbeatInvalid,
    heartbeat_parse,
)

LINK = {"address": "10.0.0.2:6001", "rtt_seconds": 0.01, "bandwidth_bytes_per_second": 1e6}


def test_a_full_heartbeat_parses_and_is_not_quiet() -> None:
    beat = heartbeat_parse({
        "observed": [{"stage_id": "j-stage-0", "generation": 3, "state": "failed", "message": " out of memory "}],
        "host_busy_fraction": 0.25, "link": {"rtt_seconds": 0.02, "bandwidth_bytes_per_second": 5e6},
        "neighbour_links": [LINK], "relay": {"attached": "relay.example:7000"}, "assignments_version": "abc",
    })
    assert beat.observed == [ObservedStage("j-stage-0", 3, "failed", " out of memory ")]
    assert (beat.host_busy_fraction, beat.assignments_version) == (0.25, "abc")
    assert beat.link == {"rtt_seconds": 0.02, "bandwidth_bytes_per_second": 5e6}
    assert beat.neighbour_links == [LINK]
    assert beat.relay == {"attached": "relay.example:7000", "failed": []}
    assert not beat.quiet


@pytest.mark.parametrize("body", [{}, {"observed": []}, {"observed": [], "assignments_version": "",
                                                          "relay": {"attached": None, "failed": ["h:1"]}},
                                  {"observed": [{"stage_id": "j-stage-0", "generation": 3, "state": "ready"}]}])
def test_a_heartbeat_the_quiet_path_can_judge_is_quiet(body: dict[str, Any]) -> None:
    assert heartbeat_parse(body).quiet  # stage reports too: it compares them with the recorded ones


def test_any_field_the_quiet_path_is_not_taught_makes_a_heartbeat_not_quiet() -> None:
    """A measured link, or a field added later (counters the ledger bills from, say): set, it is the API's to
    record, never answered and dropped before Django."""
    others = [item.name for item in fields(Heartbeat) if item.name not in QUIET_FIELDS]
    assert others == ["link", "neighbour_links"]
    for name in others:
        assert not replace(Heartbeat(), **{name: object()}).quiet
    assert Heartbeat().quiet


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        (["observed"], {"non_field_errors": ["Invalid data. Expected a dictionary, but got list."]}),
        ({"observed": [{"stage_id": "x", "generation": -1, "state": "exploded"}]},
         {"observed[0].generation": ["Ensure this value is greater than or equal to 0."],
          "observed[0].state": ['"exploded" is not a valid choice.']}),
        ({"host_busy_fraction": True}, {"host_busy_fraction": ["Must be a finite JSON number (e.g. 0.01), got True."]}),
        ({"host_busy_fraction": 1.5}, {"host_busy_fraction": ["Ensure this value is less than or equal to 1."]}),
        ({"assignments_version": "v" * 65},
         {"assignments_version": ["Ensure this field has no more than 64 characters."]}),
        ({"assignments_version": 7}, {"assignments_version": ["Not a valid string."]}),
        ({"relay": {"failed": ["h:1"] * (MAX_RELAYS_REPORTED + 1)}},
         {"relay.failed": [f"Ensure this field has no more than {MAX_RELAYS_REPORTED} elements."]}),
        ({"relay": {"failed": ["h:1", "0.0.0.0:1"]}}, {"relay.failed[1]": [
            "0.0.0.0 is a listen-everywhere address, not one other nodes can dial; advertise this machine's reachable "
            "address instead."]}),
        ({"neighbour_links": [LINK, LINK]}, {"neighbour_links": ["each neighbour address may appear once"]}),
        ({"neighbour_links": [{**LINK, "rtt_seconds": None}]},
         {"neighbour_links[0]": ["rtt_seconds and bandwidth_bytes_per_second are both set or both null"]}),
        ({"link": {"rtt_seconds": -1}}, {"link.rtt_seconds": ["Must be greater than 0, got -1."],
                                         "link.bandwidth_bytes_per_second": ["This field is required."]}),
        ({"unknown": 1}, {"unknown": [f"Unknown field; allowed fields: {', '.join(sorted(KEYS))}."]}),
    ],
)
def test_a_bad_body_is_refused_naming_each_field(body: Any, errors: dict[str, list[str]]) -> None:
    with pytest.raises(HeartbeatInvalid) as refused:
        heartbeat_parse(body)
    assert refused.value.errors == errors


@pytest.mark.django_db
def test_the_api_documents_the_fields_the_schema_parses() -> None:
    document = APIClient().get("/api/schema/", HTTP_ACCEPT="application/json").json()
    body = document["paths"]["/api/agent/heartbeat/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert tuple(body["properties"]) == KEYS
