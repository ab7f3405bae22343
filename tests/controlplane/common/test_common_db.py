"""consistent_snapshot: one read-only snapshot for every query of a response."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import User
from django.db import connection

from controlplane.common.db import consistent_snapshot


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
