from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from controlplane.accounts.services import user_token_obtain


class TokenObtainInput(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=128, trim_whitespace=False, style={"input_type": "password"})


class TokenObtainApi(APIView):
    """Exchange a username and password for the user's API token (`Authorization: Token <token>`)."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "login"  # by client address: guessing passwords is slow

    @extend_schema(
        request=TokenObtainInput,
        responses=inline_serializer("TokenOutput", {"token": serializers.CharField()}),
    )
    def post(self, request: Request) -> Response:
        data = TokenObtainInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"token": user_token_obtain(**data.validated_data)})
