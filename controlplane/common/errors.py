"""The one error type services raise for anything the client can fix; the API maps it to 4xx JSON."""

from __future__ import annotations

from http import HTTPStatus


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
