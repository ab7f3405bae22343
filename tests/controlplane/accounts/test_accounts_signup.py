"""Sign-up (REST and the page), password change, and API token rotation."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

pytestmark = pytest.mark.django_db

NEWCOMER = {"username": "carol", "email": "carol@example.org", "password": "violet-harbour-lantern"}


def register(body: dict[str, str]) -> object:
    return APIClient().post("/api/auth/register", body, format="json")


def with_token(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_register_creates_an_ordinary_account_whose_token_works() -> None:
    response = register(NEWCOMER)
    assert response.status_code == 201, response.content
    body = response.json()
    user = User.objects.get(username="carol")
    assert body == {"id": user.pk, "username": "carol", "token": body["token"]}
    assert user.email == "carol@example.org" and user.check_password(NEWCOMER["password"])
    assert user.is_active and not user.is_staff and not user.is_superuser
    assert with_token(body["token"]).get("/api/jobs").status_code == 200
    login = APIClient().post("/api/auth/token", {"username": "carol", "password": NEWCOMER["password"]}, format="json")
    assert login.json() == {"token": body["token"]}


@pytest.mark.parametrize(
    ("password", "message"),
    [
        ("short", "This password is too short. It must contain at least 12 characters."),
        ("123456789012345", "This password is entirely numeric."),
        ("password1234", "This password is too common."),
        ("carol@example.org", "The password is too similar to the email address."),
    ],
)
def test_the_password_validators_answer_400_on_the_password_field(password: str, message: str) -> None:
    response = register({**NEWCOMER, "password": password})
    assert response.status_code == 400
    assert message in response.json()["errors"]["password"]
    assert not User.objects.filter(username="carol").exists()


def test_taken_usernames_and_emails_are_refused_ignoring_case(user: User) -> None:
    User.objects.filter(pk=user.pk).update(email="alice@example.org")
    taken = register({**NEWCOMER, "username": "ALICE"})
    assert taken.status_code == 400 and taken.json()["errors"] == {"username": ["is taken; choose another"]}
    same_email = register({**NEWCOMER, "email": "Alice@Example.org"})
    assert same_email.status_code == 400 and set(same_email.json()["errors"]) == {"email"}
    bad = register({"username": "no spaces please", "email": "not-an-email", "password": NEWCOMER["password"]})
    assert bad.status_code == 400 and set(bad.json()["errors"]) == {"username", "email"}


def test_sign_ups_are_limited_per_client_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"register": "2/hour"})
    assert register(NEWCOMER).status_code == 201
    assert register({**NEWCOMER, "username": "dave", "email": "dave@example.org"}).status_code == 201
    refused = register({**NEWCOMER, "username": "erin", "email": "erin@example.org"})
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    page = Client().post("/signup", {**NEWCOMER, "username": "erin", "email": "erin@example.org"})
    assert page.status_code == 429 and b"Too many sign-ups" in page.content  # the page shares the API's limit
    assert not User.objects.filter(username="erin").exists()


def test_the_signup_page_is_a_csrf_protected_form_that_creates_the_account() -> None:
    browser = Client(enforce_csrf_checks=True)
    form = browser.get("/signup")
    assert form.status_code == 200 and b'name="csrfmiddlewaretoken"' in form.content
    assert browser.post("/signup", NEWCOMER).status_code == 403  # no CSRF token: refused
    csrf = form.cookies["csrftoken"].value
    weak = browser.post("/signup", {**NEWCOMER, "password": "short", "csrfmiddlewaretoken": csrf})
    assert weak.status_code == 400 and b"too short" in weak.content
    created = browser.post("/signup", {**NEWCOMER, "csrfmiddlewaretoken": csrf})
    assert created.status_code == 201
    token = created.content.decode().split('<pre id="token">')[1].split("</pre>")[0]
    assert with_token(token).get("/api/nodes").status_code == 200


def test_password_change_needs_the_current_password(api: APIClient, user: User) -> None:
    wrong = api.post("/api/auth/password", {"old_password": "nope", "new_password": "a-new-long-phrase"}, format="json")
    assert wrong.status_code == 400 and set(wrong.json()["errors"]) == {"old_password"}
    weak = api.post("/api/auth/password", {"old_password": "alice-password", "new_password": "short"}, format="json")
    assert weak.status_code == 400 and set(weak.json()["errors"]) == {"new_password"}
    done = api.post("/api/auth/password", {"old_password": "alice-password", "new_password": "a-new-long-phrase"},
                    format="json")
    assert done.status_code == 204
    user.refresh_from_db()
    assert user.check_password("a-new-long-phrase") and not user.check_password("alice-password")
    assert api.get("/api/jobs").status_code == 200  # the token is not rotated by a password change


def test_token_rotation_retires_the_old_token_at_once(api: APIClient) -> None:
    rotated = api.post("/api/auth/token/rotate")
    assert rotated.status_code == 200
    refused = api.get("/api/jobs")  # still sending the old token
    assert refused.status_code == 401
    assert with_token(rotated.json()["token"]).get("/api/jobs").status_code == 200
