"""The one error type services raise for anything the client can fix; the API maps it to 4xx JSON."""

from __future__ import annotations

import uuid
from http import HTTPStatus
from typing import TypeVar

from django.db.models import Model, QuerySet

M = TypeVar("M", bound=Model)


class ApplicationError(Exception):
    """`message` is a sentence for humans; `errors` maps input fields (dotted paths such as
    "dataset_config.batch_size") to messages that name the problem and how to fix it."""

    def __init__(
        self,
        message: str,
        *,
        status: int = HTTPStatus.BAD_REQUEST,
        errors: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.errors = errors or {}

    @classmethod
    def invalid(cls, field: str, message: str) -> ApplicationError:
        """A 400 about one input field."""
        return cls(f"{field}: {message}", errors={field: [message]})

    @classmethod
    def not_found(cls, what: str, key: object) -> ApplicationError:
        return cls(f"{what} {key} not found", status=HTTPStatus.NOT_FOUND)

    @classmethod
    def conflict(cls, message: str) -> ApplicationError:
        """The request is valid but the resource is in the wrong state for it (409)."""
        return cls(message, status=HTTPStatus.CONFLICT)

    @classmethod
    def forbidden(cls, message: str) -> ApplicationError:
        """The caller may see the resource but not change it (403)."""
        return cls(message, status=HTTPStatus.FORBIDDEN)


def one_by_id(queryset: QuerySet[M], what: str, key: object) -> M:
    """The object of `queryset` (a tenant's own) whose id is `key`; 404 for a malformed id and for an id outside
    the queryset alike, so that ids of others' objects cannot be probed."""
    try:
        pk = uuid.UUID(str(key))
    except ValueError:
        raise ApplicationError.not_found(what, key) from None
    found = queryset.filter(pk=pk).first()
    if found is None:
        raise ApplicationError.not_found(what, key)
    return found
