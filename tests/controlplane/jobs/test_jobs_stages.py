"""What agents report about their stages (controlplane/jobs/stages.py): the one rule both heartbeat paths judge a
report by. The quiet path records the changes `observed_changes` finds (`stages_record_changes`) and hands the rest
to the API; these check that it records exactly what the API's `stages_record_observed` would, so no change is
answered and dropped, or recorded differently."""

from __future__ import annotations

import uuid
from typing import NamedTuple

from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arceus.contracts.observed import ObservedStage
from arceus.contracts.stage_key import stage_key
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Stage
from controlplane.jobs.stages import (
    MAX_MESSAGE_CHARS,
    StageRowKey,
    observed_changes,
    observed_update,
    stage_row_key,
    stages_record_changes,
    stages_record_observed,
)


class Row(NamedTuple):  # an `ObservedRow` as the quiet path reads one
    generation: int
    observed_generation: int | None
    observed_state: str
    observed_message: str


JOB = uuid.UUID(int=7)
GENERATIONS = st.integers(min_value=0, max_value=3)
STATES = st.sampled_from(["ready", "failed"])
MESSAGES = st.sampled_from(["", "out of memory", "x" * (MAX_MESSAGE_CHARS + 1)])  # the last one stored cut
KEYS = st.tuples(st.integers(min_value=0, max_value=2), st.integers(min_value=0, max_value=1))  # (index, replica)
ROWS = st.builds(Row, GENERATIONS, st.none() | GENERATIONS, st.sampled_from(["pending", "ready", "failed"]), MESSAGES)


def report_strategy(keys: st.SearchStrategy[tuple[int, int]]) -> st.SearchStrategy[ObservedStage]:
    def report(key: tuple[int, int], generation: int, state: str, message: str) -> ObservedStage:
        return ObservedStage(stage_key(JOB, key[0], replica=key[1] or None), generation, state, message)

    return st.builds(report, keys, GENERATIONS, STATES, MESSAGES)


def row_key(index: int, replica: int) -> StageRowKey:
    return (JOB, index, 0, replica)


@given(hosted=st.dictionaries(KEYS, ROWS, max_size=4), reports=st.lists(report_strategy(KEYS), max_size=4))
def test_the_changes_are_the_reports_updates_unless_one_names_a_stage_not_hosted(hosted, reports) -> None:
    rows = {row_key(*key): row for key, row in hosted.items()}
    outside = [report for report in reports if stage_row_key(report.stage_id) not in rows]
    updates = [(stage_row_key(report.stage_id), report.generation, observed_update(report, rows[key]))
               for report in reports if (key := stage_row_key(report.stage_id)) in rows]
    expected = None if outside else [update for update in updates if update[2] is not None]
    assert observed_changes(reports, rows) == expected


@given(row=ROWS, report=report_strategy(st.just((0, 0))))
def test_a_report_changes_a_stage_only_at_its_generation_and_once(row: Row, report: ObservedStage) -> None:
    change = observed_update(report, row)
    if report.generation != row.generation:
        assert change is None  # a late report about an older placement, or one ahead of it
        return
    recorded = (report.generation, report.state, report.message[:MAX_MESSAGE_CHARS])
    assert change == (None if (row.observed_generation, row.observed_state, row.observed_message) == recorded
                      else recorded)
    stored = Row(row.generation, *recorded)  # what the API records: the same report again changes nothing
    assert observed_update(report, stored) is None
    assert observed_changes([report], {row_key(0, 0): stored}) == []


def test_a_report_naming_no_stage_changes_nothing_and_one_naming_another_stage_is_the_apis() -> None:
    ready = Row(1, 1, "ready", "")
    assert observed_changes([ObservedStage("garbage", 1, "ready")], {}) == []  # the API ignores it too
    other = ObservedStage(stage_key(JOB, 5), 1, "ready")  # not in the node's assignments: maybe an active row
    assert observed_changes([other], {row_key(0, 0): ready}) is None
    assert observed_changes([ObservedStage(stage_key(JOB, 0), 1, "ready")], {row_key(0, 0): ready}) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recorded=ROWS, reports=st.lists(report_strategy(st.just((0, 0))), min_size=1, max_size=2))
def test_the_quiet_path_records_what_the_api_records(ready_node, queued_job, recorded, reports) -> None:
    """On a real stage row, whatever was recorded before: the quiet path's changes, recorded, leave the row as the
    API's recording of the reports does, and both say alike whether anything changed."""
    if not Stage.objects.exists():
        nodes = [ready_node(f"n{i}") for i in range(3)]
        queued_job()
        reconcile_once()
        assert Stage.objects.filter(node__in=nodes).count() == 3
    stage = Stage.objects.select_related("job", "node").order_by("index").first()
    assert stage is not None
    Stage.objects.filter(pk=stage.pk).update(
        generation=recorded.generation, observed_generation=recorded.observed_generation,
        observed_state=recorded.observed_state, observed_message=recorded.observed_message)
    stage.refresh_from_db()
    reports = [ObservedStage(stage.stage_id, r.generation, r.state, r.message) for r in reports]
    quiet = observed_changes(reports, {stage_row_key(stage.stage_id): stage})
    assert quiet is not None  # the node's own stage
    changes = [change for report in reports if (change := observed_update(report, recorded)) is not None]

    def observed() -> tuple[int | None, str, str]:
        after = Stage.objects.get(pk=stage.pk)
        return after.observed_generation, after.observed_state, after.observed_message

    point = transaction.savepoint()
    assert stages_record_observed(node=stage.node, reports=reports) == bool(changes)
    by_api = observed()
    transaction.savepoint_rollback(point)
    assert bool(stages_record_changes([(stage.node_id, *change) for change in quiet])) == bool(changes)
    assert observed() == by_api == (changes[-1] if changes else recorded[1:])
