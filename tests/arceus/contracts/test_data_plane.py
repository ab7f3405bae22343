"""arceus.contracts.data_plane: a link takes a neighbour stream only where both its agents declared it, by one
symmetric rule; declared features and an assignment's `data_plane` are parsed strictly, errors naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.contracts.data_plane import MAX_FEATURES, NEIGHBOUR_STREAM, DataPlane, features_check, link_streamed
from arceus.errors import SpecError

# This version's feature, and names a later version might declare (kept, never acted on).
FEATURES = st.frozensets(st.sampled_from([NEIGHBOUR_STREAM, "kernel_tls", "rdma"]))


@given(FEATURES, FEATURES)
def test_a_link_is_streamed_only_where_both_ends_declared_it_whichever_end_decides(
    lower: frozenset[str], upper: frozenset[str],
) -> None:
    assert link_streamed(lower, upper) == link_streamed(upper, lower)
    assert link_streamed(lower, upper) == (NEIGHBOUR_STREAM in lower and NEIGHBOUR_STREAM in upper)
    assert not link_streamed((), upper)  # an agent that declared nothing: PushStream


@given(FEATURES, FEATURES, FEATURES)
def test_an_assignments_data_plane_round_trips_sorted(own: frozenset[str], prev: frozenset[str],
                                                      next_: frozenset[str]) -> None:
    plane = DataPlane(tuple(sorted(own)), tuple(sorted(prev)), tuple(sorted(next_)))
    assert DataPlane.from_json(plane.to_json()) == plane
    assert DataPlane.from_json(None) == DataPlane()


@pytest.mark.parametrize(("value", "says"), [
    ("neighbour_stream", "must be a list"),
    ([f"f{i}" for i in range(MAX_FEATURES + 1)], f"at most {MAX_FEATURES}"),
    (["Neighbour-Stream"], "lowercase name"),
    ([7], "lowercase name"),
    ([NEIGHBOUR_STREAM, NEIGHBOUR_STREAM], "once"),
])
def test_declared_features_are_refused_naming_the_field_and_what_is_wrong(value: object, says: str) -> None:
    with pytest.raises(SpecError) as refused:
        features_check(value, "data_plane")
    assert refused.value.field == "data_plane" and says in refused.value.message
    assert features_check(["rdma", NEIGHBOUR_STREAM], "data_plane") == (NEIGHBOUR_STREAM, "rdma")


@pytest.mark.parametrize(("value", "field"), [
    ({"own": [NEIGHBOUR_STREAM], "prev": []}, "assignment.data_plane"),
    ({"own": [], "prev": [], "next": [], "other": []}, "assignment.data_plane"),
    ({"own": [], "prev": ["x y"], "next": []}, "assignment.data_plane.prev"),
    ([NEIGHBOUR_STREAM], "assignment.data_plane"),
])
def test_an_assignments_data_plane_is_refused_naming_its_field(value: object, field: str) -> None:
    with pytest.raises(SpecError) as refused:
        DataPlane.from_json(value)
    assert refused.value.field == field
