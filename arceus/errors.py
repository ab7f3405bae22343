"""The one error type for invalid user configuration, shared by the library, agents and control plane."""

from __future__ import annotations


class SpecError(ValueError):
    """A configuration value is invalid.

    `field` is a dotted path into the user's config (e.g. "model_config.layer_sizes") so an API can
    attach the message to the right input; `message` says what is wrong and how to fix it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
