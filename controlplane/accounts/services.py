"""Users and their API tokens (DRF authtoken: one token per user)."""

from __future__ import annotations

from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from rest_framework.authtoken.models import Token

from controlplane.common.errors import ApplicationError


def user_token_get_or_create(*, user: AbstractBaseUser) -> str:
    token, _ = Token.objects.get_or_create(user=user)
    return token.key


def user_token_obtain(*, username: str, password: str) -> str:
    """The API token of the user with these credentials; 400 if they do not match an active user."""
    user = authenticate(username=username, password=password)
    if user is None:
        raise ApplicationError(
            "unable to log in with the given username and password",
            errors={"password": ["Wrong username or password (or the account is disabled)."]},
        )
    return user_token_get_or_create(user=user)


@transaction.atomic
def user_ensure(*, username: str, password: str) -> AbstractBaseUser:
    """Create the user, or reset its password if it exists (idempotent; used by the demo)."""
    user, _ = get_user_model().objects.get_or_create(username=username)
    user.set_password(password)
    user.is_active = True
    user.save()
    return user
