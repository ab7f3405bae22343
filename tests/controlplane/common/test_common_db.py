"""consistent_snapshot: one read-only snapshot for every query of a response; rows_update: many rows' fields in few
statements."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.common.db import consistent_snapshot, rows_update


@pytest.mark.django_db(transaction=True)
def test_a_snapshot_does_not_see_commits_made_after_it_began() -> None:
    with consistent_snapshot():
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            assert cursor.fetchone() == ("repeatable read",)
        before = User.objects.count()

        def commit_elsewhere() -> None:  # another connection, as another request would
            User.objects.create_user("late")
            connection.close()

        writer = threading.Thread(target=commit_elsewhere)
        writer.start()
        writer.join()
        assert User.objects.count() == before  # still the snapshot's view
    assert User.objects.count() == before + 1


@pytest.mark.django_db
def test_rows_update_writes_each_rows_own_values_and_only_the_fields_named() -> None:
    users = [User.objects.create_user(f"u{i}", first_name="kept") for i in range(5)]
    when = datetime(2026, 1, 2, tzinfo=UTC)
    for i, user in enumerate(users):
        user.last_name, user.is_active, user.last_login, user.first_name = f"n{i}", i % 2 == 0, when, "not written"
    users[3].last_login = None
    with CaptureQueriesContext(connection) as queries:
        rows_update(User, users, ["last_name", "is_active", "last_login"], batch=2)
    assert len(queries) == 3  # 2 + 2 + 1 rows
    written = User.objects.order_by("username").values_list("last_name", "is_active", "last_login", "first_name")
    assert list(written) == [
        ("n0", True, when, "kept"),
        ("n1", False, when, "kept"),
        ("n2", True, when, "kept"),
        ("n3", False, None, "kept"),
        ("n4", True, when, "kept"),
    ]
