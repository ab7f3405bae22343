"""Users and their API tokens (DRF authtoken: one token per user): sign-up, login, password change, rotation."""

from __future__ import annotations

from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
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
def user_register(*, username: str, email: str, password: str) -> AbstractBaseUser:
    """A new active user (no staff rights). Usernames and emails are unique ignoring case, so no one signs up
    as a look-alike of another; the password must pass the settings' AUTH_PASSWORD_VALIDATORS."""
    users = get_user_model().objects
    if users.filter(username__iexact=username).exists():
        raise ApplicationError.invalid("username", "is taken; choose another")
    if users.filter(email__iexact=email).exists():
        raise ApplicationError.invalid("email", "already has an account; log in (POST /api/auth/token) instead")
    user = users.model(username=username, email=email)
    _check_password(password, user, field="password")
    user.set_password(password)
    try:
        with transaction.atomic():
            user.save()
    except IntegrityError:  # the same name signed up between the check and the insert
        raise ApplicationError.invalid("username", "is taken; choose another") from None
    return user


@transaction.atomic
def user_password_change(*, user: AbstractBaseUser, old_password: str, new_password: str) -> AbstractBaseUser:
    """Set a new password (checked by the password validators) for a user who knows the current one."""
    if not user.check_password(old_password):
        raise ApplicationError.invalid("old_password", "is not your current password")
    _check_password(new_password, user, field="new_password")
    user.set_password(new_password)
    user.save(update_fields=["password"])
    return user


@transaction.atomic
def user_token_rotate(*, user: AbstractBaseUser) -> str:
    """Replace the user's API token: the old one stops authenticating when this commits."""
    Token.objects.filter(user=user).delete()
    return Token.objects.create(user=user).key


@transaction.atomic
def user_ensure(*, username: str, password: str) -> AbstractBaseUser:
    """Create the user, or reset its password if it exists (idempotent; used by the demo)."""
    user, _ = get_user_model().objects.get_or_create(username=username)
    user.set_password(password)
    user.is_active = True
    user.save()
    return user


def _check_password(password: str, user: AbstractBaseUser, *, field: str) -> None:
    try:
        validate_password(password, user=user)
    except ValidationError as exc:
        raise ApplicationError(f"{field}: {' '.join(exc.messages)}", errors={field: list(exc.messages)}) from None
