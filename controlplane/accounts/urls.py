"""Account routes under /api/ (with or without a trailing slash)."""

from django.urls import re_path

from controlplane.accounts.api import TokenObtainApi

urlpatterns = [
    re_path(r"^auth/token/?$", TokenObtainApi.as_view(), name="token-obtain"),
]
