"""The agent's authenticated JSON calls to the control plane and their errors: torch-free, so the owner's commands
(`arceus-agent status`: its earnings) use them without loading what running an agent needs
(`nodeagent.control_plane.ControlPlaneClient` adds registration, heartbeats and the stages' files)."""

from __future__ import annotations

from typing import Any

import requests


class ControlPlaneError(RuntimeError):
    """The control plane could not be reached or answered something unusable; worth retrying."""


class Unauthorized(ControlPlaneError):
    """The control plane rejected the node token; retrying cannot help."""


class ControlPlaneSession:
    """Calls as this node (its token in `Authorization: Node ...`) to the control plane at `url`."""

    def __init__(self, url: str, token: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Node {token}"

    def earnings(self) -> dict[str, Any]:
        """What this node has earned (GET /api/agent/earnings): `credit_usd`, `withheld_usd`, `per_day`, ..."""
        return self._call("GET", "/api/agent/earnings")

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, json=payload)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """The JSON object the control plane answers `method path` with; ControlPlaneError (Unauthorized for a
        refused token) otherwise."""
        url = f"{self.url}{path}"
        try:
            response = self._session.request(method, url, timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            raise ControlPlaneError(f"{method} {url} failed: {exc}") from exc
        if response.status_code == 401:
            raise Unauthorized(
                f"the control plane at {self.url} rejected the node token (HTTP 401); "
                "check the token (ARCEUS_NODE_TOKEN or the token file): it is shown once when the node is created "
                "(POST /api/nodes)"
            )
        if response.status_code >= 300:
            raise ControlPlaneError(f"{method} {url} → HTTP {response.status_code}: {response.text[:500]}")
        try:
            body = response.json()
        except ValueError:
            raise ControlPlaneError(f"{method} {url} answered non-JSON: {response.text[:200]!r}") from None
        if not isinstance(body, dict):
            raise ControlPlaneError(f"{method} {url} answered {type(body).__name__}, expected a JSON object")
        return body
