"""Token login and the demo's bootstrap command."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


def test_obtain_token_with_username_and_password(user: User) -> None:
    response = APIClient().post("/api/auth/token", {"username": "alice", "password": "alice-password"}, format="json")
    assert response.status_code == 200
    assert response.json() == {"token": Token.objects.get(user=user).key}


def test_wrong_password_is_a_400_on_the_password_field(user: User) -> None:
    response = APIClient().post("/api/auth/token", {"username": "alice", "password": "nope"}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == {"password": ["Wrong username or password (or the account is disabled)."]}


def test_missing_credentials_are_named() -> None:
    response = APIClient().post("/api/auth/token/", {}, format="json")
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"username", "password"}


def test_bootstrap_demo_user_is_idempotent_and_prints_the_token_last() -> None:
    first, second = StringIO(), StringIO()
    call_command("bootstrap_demo_user", "--username", "demo", "--password", "pw-1", stdout=first)
    call_command("bootstrap_demo_user", "--username", "demo", "--password", "pw-2", stdout=second)
    token = Token.objects.get(user__username="demo").key
    assert first.getvalue().strip().splitlines()[-1] == second.getvalue().strip().splitlines()[-1] == token
    assert User.objects.filter(username="demo").count() == 1
    assert User.objects.get(username="demo").check_password("pw-2")
