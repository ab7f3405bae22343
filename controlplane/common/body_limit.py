"""Bounded request bodies: a body declared larger than its view allows is answered 413 before anything reads it.

DRF's parsers read the request stream themselves, so Django's DATA_UPLOAD_MAX_MEMORY_SIZE (which guards only
`request.body` and form parsing) does not bound the JSON API; this middleware does, from Content-Length (a
WSGI body without one reads as empty). Every view takes ARCEUS_MAX_REQUEST_BYTES unless it names its own
bound as `max_request_bytes` (a callable, read per request): the agents' checkpoint uploads stream
gigabytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.request import Request


class RequestBodyLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(
        self, request: HttpRequest, view: Callable[..., Any], args: Any, kwargs: Any
    ) -> HttpResponse | None:
        length = declared_length(request) or 0
        bound = getattr(getattr(view, "cls", view), "max_request_bytes", None)
        limit = bound() if bound is not None else settings.ARCEUS_MAX_REQUEST_BYTES
        if length <= limit:
            return None
        return JsonResponse(
            {"detail": f"the request body is {length:,} bytes; this endpoint takes at most {limit:,}"},
            status=413,
        )


def declared_length(request: HttpRequest | Request) -> int | None:
    """The body's length as its Content-Length declares it; None when there is none or it is no decimal number
    (str.isdigit alone takes "²", which int() refuses)."""
    declared = request.META.get("CONTENT_LENGTH") or ""
    return int(declared) if declared.isascii() and declared.isdigit() else None
