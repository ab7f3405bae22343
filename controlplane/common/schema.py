"""The OpenAPI schema's error answers: every operation declares the 4xx it can give, derived from its view
(authentication, path parameters, request body, throttling), in the one shape the exception handler writes.
Views declare only what is theirs (a 409 for a resource in the wrong state, a 413, a 503) with
`extend_schema(responses=...)`."""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from rest_framework import serializers
from rest_framework.permissions import AllowAny


class ErrorOutput(serializers.Serializer):
    """What every 4xx carries (controlplane/common/exception_handler.py)."""

    detail = serializers.CharField(help_text="What is wrong and how to fix it.")
    errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text='Invalid input only: messages by dotted field path ("dataset_config.batch_size").',
    )


class ArceusAutoSchema(AutoSchema):
    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        # The hook after `extend_schema`'s responses are resolved (overriding get_response_serializers would be
        # undone by every view's `extend_schema`, which subclasses this schema).
        responses = super()._get_response_bodies(direction)
        for status in map(str, self._error_statuses()):
            if status not in responses:
                responses[status] = self._get_response_for_code(ErrorOutput, status, direction=direction)
        return responses

    def _error_statuses(self) -> list[int]:
        statuses = []
        writes = self.method in ("POST", "PUT", "PATCH")
        if writes:
            statuses.append(400)  # invalid input, or a service refusing it
            if self.get_request_serializer() is not None and self.view.parser_classes:
                statuses.append(415)  # a body in a media type the view does not parse
        if not all(isinstance(p, AllowAny) for p in self.view.get_permissions()):
            statuses += [401, 403]  # no or bad credentials; a session without its CSRF token
        if "{" in self.path:
            statuses.append(404)  # no such object, or not the caller's
        if self.view.get_throttles():
            statuses.append(429)
        return statuses
