"""The one DRF exception handler: every 4xx leaves the API as {"detail": str, "errors"?: {field: [str]}}.

`errors` appears only for invalid input; its keys are dotted paths ("dataset_config.batch_size",
"model_config.layer_sizes[1]"), the same for DRF's serializer errors and the services' errors.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.common.errors import ApplicationError

NON_FIELD = "non_field_errors"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ApplicationError):
        body: dict[str, Any] = {"detail": exc.message}
        if exc.errors:
            body["errors"] = exc.errors
        return Response(body, status=exc.status)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a bug: let Django answer 500 and log it
    if isinstance(exc, exceptions.ValidationError):
        errors = flatten_errors(exc.detail)
        response.data = {"detail": summarize(errors), "errors": errors}
    else:
        response.data = {"detail": str(exc.detail)}
    return response


def flatten_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested error structure → {"a.b[0].c": ["message", ...]}."""
    out: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            if isinstance(key, int):  # DRF keys a list field's item errors by index
                name = f"{prefix}[{key}]"
            elif key == NON_FIELD and prefix:
                name = prefix
            else:
                name = _join(prefix, str(key))
            for field, messages in flatten_errors(value, name).items():
                out.setdefault(field, []).extend(messages)
    elif isinstance(detail, list) and any(isinstance(item, dict | list) for item in detail):
        for index, value in enumerate(detail):
            if value:  # DRF puts {} for the valid items of a list
                out.update(flatten_errors(value, f"{prefix}[{index}]"))
    else:
        items = detail if isinstance(detail, list) else [detail]
        out[prefix or NON_FIELD] = [str(item) for item in items]
    return out


def summarize(errors: dict[str, list[str]]) -> str:
    return "; ".join(f"{field}: {' '.join(messages)}" for field, messages in errors.items()) or "Invalid input."


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 404 for a path no route takes (`handler404`): under /api/ the API's own body, so a client that
    mistyped a path reads JSON as for any other 404; elsewhere Django's page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"no API route is {request.path}; see /api/docs/"}, status=404)
    return defaults.page_not_found(request, exception)
