"""What agents report about their stages (controlplane/jobs/stages.py): the one rule both heartbeat paths judge a
report by. The quiet path answers without Django only when `observed_unchanged` holds; these check that it holds
exactly when the API's `stages_record_observed` would record nothing, so no change is answered and dropped."""

from __future__ import annotations

import uuid
from typing import NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arceus.contracts.observed import ObservedStage
from arceus.contracts.stage_key import stage_key
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Stage
from controlplane.jobs.stages import (
    MAX_MESSAGE_CHARS,
    StageRowKey,
    observed_unchanged,
    observed_update,
    stage_row_key,
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
def test_unchanged_exactly_when_every_report_names_a_hosted_stage_and_changes_nothing(hosted, reports) -> None:
    rows = {row_key(*key): row for key, row in hosted.items()}
    changes = [observed_update(report, rows.get(stage_row_key(report.stage_id))) for report in reports]
    outside = [report for report in reports if stage_row_key(report.stage_id) not in rows]
    assert observed_unchanged(reports, rows) == (not outside and all(change is None for change in changes))


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
    assert observed_unchanged([report], {row_key(0, 0): stored})


def test_a_report_naming_no_stage_changes_nothing_and_one_naming_another_stage_is_the_apis() -> None:
    ready = Row(1, 1, "ready", "")
    assert observed_unchanged([ObservedStage("garbage", 1, "ready")], {})  # the API ignores it too
    other = ObservedStage(stage_key(JOB, 5), 1, "ready")  # not in the node's assignments: maybe an active row
    assert not observed_unchanged([other], {row_key(0, 0): ready})
    assert observed_unchanged([ObservedStage(stage_key(JOB, 0), 1, "ready")], {row_key(0, 0): ready})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recorded=ROWS, reports=st.lists(report_strategy(st.just((0, 0))), min_size=1, max_size=2))
def test_the_quiet_paths_rule_agrees_with_what_the_api_records(ready_node, queued_job, recorded, reports) -> None:
    """On a real stage row, whatever was recorded before: where `observed_unchanged` holds (the quiet path answers)
    the API records nothing; where it does not, the API records what the reports change."""
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
    unchanged = observed_unchanged(reports, {stage_row_key(stage.stage_id): stage})
    changes = [change for report in reports if (change := observed_update(report, recorded)) is not None]
    assert stages_record_observed(node=stage.node, reports=reports) == (not unchanged) == bool(changes)
    after = Stage.objects.get(pk=stage.pk)
    assert (after.observed_generation, after.observed_state, after.observed_message) == (
        changes[-1] if changes else recorded[1:])
