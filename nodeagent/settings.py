"""The agent's settings file: what `arceus-agent init` writes and `arceus-agent run` starts from.

A TOML file in the platform's user config directory (platformdirs: `~/.config/arceus-agent/agent.toml` on
Linux), which its owner may edit; it is checked whole on load, and a bad key is named with how to fix it.
The node token is never in it: only the path of the file that holds it (nodeagent.node_token).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import platformdirs
import tomli_w

DEVICE_TYPES = ("cuda", "mps", "cpu")  # what --device and `device` may name
# How long a stopping agent waits for its node to drain (nodeagent.leaving); service units give it more.
DEFAULT_LEAVE_TIMEOUT_SECONDS = 120.0

APP_NAME = "arceus-agent"
SETTINGS_FILE_NAME = "agent.toml"
TOKEN_FILE_NAME = "node-token"
STATUS_FILE_NAME = "status.json"


class SettingsError(ValueError):
    """The settings file is missing, unreadable or invalid; the message names the file and the key."""


@dataclass(frozen=True)
class AgentSettings:
    control_plane: str
    token_file: str
    device: str | None = None
    listen: str | None = None
    advertise: str | None = None
    exchange_port: int | None = None
    advertise_exchange: str | None = None
    metrics_listen: str | None = None
    threads: int | None = None
    declare_flops: float | None = None


def _url(value: Any) -> str | None:
    if isinstance(value, str) and value.startswith(("http://", "https://")) and len(value) > 8:
        return None
    return "must be the control plane's http:// or https:// URL"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "must be a non-empty string"


def _address(value: Any) -> str | None:
    if isinstance(value, str) and value.rpartition(":")[0] and value.rpartition(":")[2].isdigit():
        return None
    return "must be HOST:PORT, e.g. 0.0.0.0:50051"


def _port(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
    return None if ok else "must be a port in 1..65535 (leave it out for a free one)"


def _device(value: Any) -> str | None:
    return None if value in DEVICE_TYPES else f"must be one of {', '.join(DEVICE_TYPES)}"


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "must be a positive integer"


def _positive_number(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "must be a positive number, e.g. 5e10"


# Each key's check: None if the value is valid, else what it must be.
_CHECKS = {
    "control_plane": _url,
    "token_file": _text,
    "device": _device,
    "listen": _address,
    "advertise": _address,
    "exchange_port": _port,
    "advertise_exchange": _address,
    "metrics_listen": _address,
    "threads": _positive_int,
    "declare_flops": _positive_number,
}
_REQUIRED = ("control_plane", "token_file")


def default_settings_path() -> Path:
    return platformdirs.user_config_path(APP_NAME) / SETTINGS_FILE_NAME


def settings_from_mapping(data: dict[str, Any], *, source: str) -> AgentSettings:
    """Check every key of `data` (from `source`, named in errors) and build the settings."""
    for key, value in data.items():
        check = _CHECKS.get(key)
        if check is None:
            raise SettingsError(f"{source}: unknown setting {key!r}; the settings are {', '.join(_CHECKS)}")
        problem = check(value)
        if problem is not None:
            raise SettingsError(f"{source}: {key} {problem}, got {value!r}")
    for key in _REQUIRED:
        if key not in data:
            raise SettingsError(f"{source}: {key} is missing; run `arceus-agent init` to write the settings")
    return AgentSettings(**data)


def load_settings(path: Path) -> AgentSettings:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(
            f"no settings at {path}; run `arceus-agent init --control-plane URL --token-stdin` first"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read the settings {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path} is not valid TOML: {exc}") from None
    return settings_from_mapping(data, source=str(path))


def save_settings(path: Path, settings: AgentSettings) -> None:
    """Write the settings (only the keys that are set), readable by their owner alone."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = {key: value for key, value in asdict(settings).items() if value is not None}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        tomli_w.dump(data, file)
