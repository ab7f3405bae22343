"""A replica's holdings: consistent records only, a strict JSON form for the wire, absent means nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.errors import SpecError
from arceus.swarm.holdings import NOTHING, Holding, StepHoldings


@st.composite
def holdings(draw: st.DrawFn) -> Holding:
    """A record consistent with some run: each step needs the one before."""
    depth = draw(st.integers(0, 5))
    sent = st.none() | st.integers(0, 9)
    return Holding(
        input_received=depth >= 1,
        forwarded=depth >= 2,
        output_sent_to=draw(sent) if depth >= 2 else None,
        gradient_received=depth >= 3 and draw(st.booleans()),
        backwarded=depth >= 4,
        input_gradient_sent_to=draw(sent) if depth >= 4 else None,
    )


keys = st.tuples(st.integers(0, 7), st.integers(0, 20), st.integers(0, 63))


@given(st.dictionaries(keys, holdings(), max_size=20))
def test_json_round_trips(entries: dict) -> None:
    step = StepHoldings(entries)
    assert StepHoldings.from_json(step.to_json()) == step
    assert list(step) == sorted(entries)


def test_an_absent_micro_batch_is_nothing_held() -> None:
    step = StepHoldings({(1, 2, 3): Holding(True, True, 4)})
    assert step.of(1, 2, 3) == Holding(True, True, 4)
    assert step.of(1, 2, 4) is NOTHING and Holding() == NOTHING
    assert step.to_json() == [
        {
            "stage": 1, "replica": 2, "micro_batch": 3, "input_received": True, "forwarded": True,
            "output_sent_to": 4, "gradient_received": False, "backwarded": False, "input_gradient_sent_to": None,
        }
    ]


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        ({"forwarded": True}, "forwarded without its input received"),
        ({"input_received": True, "output_sent_to": 1}, "an output sent without a forward"),
        ({"input_received": True, "backwarded": True}, "backwarded without a forward"),
        ({"input_received": True, "forwarded": True, "input_gradient_sent_to": 0}, "input gradient sent without"),
    ],
)
def test_inconsistent_records_are_refused(record: dict, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        Holding(**record)


def entry(**changes: object) -> dict:
    return StepHoldings({(0, 1, 2): Holding()}).to_json()[0] | changes


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({}, "holdings", "must be an array"),
        ([entry(), entry()], "holdings[1]", "stage 0 replica 1 micro-batch 2 is recorded twice"),
        ([entry(stage=-1)], "holdings[0].stage", "at least 0"),
        ([entry(forwarded=1)], "holdings[0].forwarded", "must be true or false"),
        ([entry(output_sent_to="a")], "holdings[0].output_sent_to", "must be an integer"),
        ([entry(extra=1)], "holdings[0]", "unknown keys ['extra']"),
        ([entry(forwarded=True)], "holdings[0]", "forwarded without its input received"),
    ],
)
def test_json_is_strict(data: object, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as caught:
        StepHoldings.from_json(data)
    assert caught.value.field == field
    assert fragment in caught.value.message


def test_keys_are_checked() -> None:
    with pytest.raises(ValueError, match="key is \\(stage, replica, micro_batch\\)"):
        StepHoldings({(0, 1): Holding()})
