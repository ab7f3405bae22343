"""Account routes under /api/ (with or without a trailing slash)."""

from django.urls import re_path

from controlplane.accounts.api import PasswordChangeApi, RegisterApi, TokenObtainApi, TokenRotateApi

urlpatterns = [
    re_path(r"^auth/token/?$", TokenObtainApi.as_view(), name="token-obtain"),
    re_path(r"^auth/token/rotate/?$", TokenRotateApi.as_view(), name="token-rotate"),
    re_path(r"^auth/register/?$", RegisterApi.as_view(), name="register"),
    re_path(r"^auth/password/?$", PasswordChangeApi.as_view(), name="password-change"),
]
