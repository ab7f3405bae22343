from __future__ import annotations

from django.contrib.auth.validators import UnicodeUsernameValidator
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from controlplane.accounts.services import (
    user_password_change,
    user_register,
    user_token_get_or_create,
    user_token_obtain,
    user_token_rotate,
)

TokenOutput = inline_serializer("TokenOutput", {"token": serializers.CharField()})


def _password_field() -> serializers.CharField:
    return serializers.CharField(max_length=128, trim_whitespace=False, style={"input_type": "password"})


class TokenObtainInput(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = _password_field()


class RegisterInput(serializers.Serializer):
    username = serializers.CharField(
        max_length=150,
        validators=[UnicodeUsernameValidator()],
        help_text="Letters, digits and @/./+/-/_ only; unique ignoring case.",
    )
    email = serializers.EmailField(max_length=254)
    password = _password_field()


class PasswordChangeInput(serializers.Serializer):
    old_password = _password_field()
    new_password = _password_field()


class TokenObtainApi(APIView):
    """Exchange a username and password for the user's API token (`Authorization: Token <token>`)."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "login"  # by client address: guessing passwords is slow

    @extend_schema(request=TokenObtainInput, responses=TokenOutput)
    def post(self, request: Request) -> Response:
        data = TokenObtainInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"token": user_token_obtain(**data.validated_data)})


class RegisterApi(APIView):
    """Sign up: a new account and its API token. The password must pass the server's password rules; the 400
    names the field and the rule it broke."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "register"  # by client address: accounts are not free to mint in bulk

    @extend_schema(
        request=RegisterInput,
        responses={
            201: inline_serializer(
                "RegisteredOutput",
                {
                    "id": serializers.IntegerField(),
                    "username": serializers.CharField(),
                    "token": serializers.CharField(),
                },
            )
        },
    )
    def post(self, request: Request) -> Response:
        data = RegisterInput(data=request.data)
        data.is_valid(raise_exception=True)
        user = user_register(**data.validated_data)
        return Response(
            {"id": user.pk, "username": user.username, "token": user_token_get_or_create(user=user)},
            status=status.HTTP_201_CREATED,
        )


class PasswordChangeApi(APIView):
    """Change the caller's password (the current one is needed). The API token stays as it is; rotate it too
    (POST /api/auth/token/rotate) if it may have leaked."""

    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "login"  # a stolen token must not become a way to guess the password

    @extend_schema(request=PasswordChangeInput, responses={204: None})
    def post(self, request: Request) -> Response:
        data = PasswordChangeInput(data=request.data)
        data.is_valid(raise_exception=True)
        user_password_change(user=request.user, **data.validated_data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TokenRotateApi(APIView):
    """A new API token for the caller; the one this request was made with stops working at once."""

    @extend_schema(request=None, responses=TokenOutput)
    def post(self, request: Request) -> Response:
        return Response({"token": user_token_rotate(user=request.user)})
