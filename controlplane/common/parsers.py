"""The API's JSON parser: DRF's, bounded (arceus.json_input): a body nested too deep, holding a non-finite number
or a NUL character is a 400 naming where, never a server error; malformed JSON is DRF's ParseError as before."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO

from django.conf import settings
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import JSONParser

from arceus.errors import SpecError
from arceus.json_input import json_loads_bounded


class BoundedJSONParser(JSONParser):
    def parse(
        self, stream: BinaryIO, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return json_loads_bounded(stream.read().decode(encoding), where="")
        except SpecError as exc:
            raise ValidationError({exc.field or "body": [exc.message]}) from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
