"""The nodes admin: pages are read-only; pause, resume and clearing a flag (with a recorded reason) run the nodes
services and say what each did."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from controlplane.nodes.models import Node
from controlplane.nodes.services import node_flag

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/nodes/node/"


def act(client: Client, action: str, *nodes: Node, **fields: str) -> list[str]:
    response = client.post(
        CHANGELIST, {"action": action, "_selected_action": [n.pk for n in nodes], **fields}, follow=True
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_an_operator_pauses_and_resumes_someone_elses_node(operator: Client, ready_node) -> None:  # noqa: ANN001
    node = ready_node("laptop")  # alice's
    assert act(operator, "pause", node) == [f"{node}: paused (draining)"]
    paused = Node.objects.get(pk=node.pk)
    assert paused.paused and paused.paused_at is not None
    assert act(operator, "pause", node) == [f"{node}: already paused"]
    assert act(operator, "resume", node) == [f"{node}: resumed"]
    assert not Node.objects.get(pk=node.pk).paused


def test_clearing_a_flag_asks_why_and_records_it(operator: Client, ready_node) -> None:  # noqa: ANN001
    flagged, clean = ready_node("caught", port=50051), ready_node("clean", port=50052)
    node_flag(node=flagged, reason="spot check failed at step 7", now=timezone.now())

    form = operator.post(CHANGELIST, {"action": "clear_flag", "_selected_action": [flagged.pk, clean.pk]})
    assert form.status_code == 200 and b'name="reason"' in form.content
    assert b"spot check failed at step 7" in form.content
    assert Node.objects.get(pk=flagged.pk).flagged_at is not None  # nothing cleared before the reason is given

    no_reason = operator.post(CHANGELIST, {"action": "clear_flag", "_selected_action": [flagged.pk], "apply": "1",
                                           "reason": " "})
    assert no_reason.status_code == 200 and b"This field is required" in no_reason.content
    assert Node.objects.get(pk=flagged.pk).flagged_at is not None

    messages = act(operator, "clear_flag", flagged, clean, apply="1", reason="owner replaced the GPU")
    assert messages == [
        f"{flagged}: flag cleared (spot check failed at step 7): owner replaced the GPU",
        f"{clean}: was not flagged; nothing to clear",
    ]
    cleared = Node.objects.get(pk=flagged.pk)
    assert cleared.flagged_at is None and cleared.flag_cleared_at is not None
    assert cleared.flag_clear_reason == "spot check failed at step 7 -- cleared: owner replaced the GPU"
    assert cleared.flag_cleared_by == User.objects.get(username="operator")
    assert "owner replaced the GPU" in LogEntry.objects.get(object_id=str(flagged.pk)).get_change_message()


def test_the_change_form_is_read_only(operator: Client, ready_node) -> None:  # noqa: ANN001
    node = ready_node("laptop")
    page = operator.get(f"{CHANGELIST}{node.pk}/change/")
    assert page.status_code == 200 and b'name="paused"' not in page.content
    posted = operator.post(f"{CHANGELIST}{node.pk}/change/", {"paused": "on", "flag_reason": "", "name": "renamed"})
    assert posted.status_code == 403
    node.refresh_from_db()
    assert (node.paused, node.name) == (False, "laptop")
    assert operator.get(f"{CHANGELIST}add/").status_code == 403


def test_the_list_shows_what_an_operator_looks_for(operator: Client, ready_node) -> None:  # noqa: ANN001
    node = ready_node("laptop")
    page = operator.get(CHANGELIST, {"q": "lapt"})
    assert list(page.context["cl"].result_list) == [node]
    assert b"ago" in page.content  # the last heartbeat's age
    assert b"light-small" in page.content  # its device class (1 GFLOP/s, 1 GiB)
    assert operator.get(CHANGELIST, {"flagged_at__isnull": "True"}).context["cl"].result_count == 1
