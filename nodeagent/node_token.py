"""Where the agent finds its node token: never on the command line, where every local user sees it in `ps`.

The environment variable ARCEUS_NODE_TOKEN first, else a file only its owner can read (mode 0600): the one
`arceus-agent init` writes from standard input, or one the owner names.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from arceus.contracts.credentials import NODE_TOKEN_ENV as TOKEN_ENV


class TokenError(ValueError):
    """No usable node token; the message says where it was looked for and how to fix it."""


def check_token(token: str, *, source: str) -> str:
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise TokenError(f"the node token from {source} is empty or has spaces in it; paste it as shown once at "
                         "node creation (POST /api/nodes)")
    return token


def read_token_file(path: Path) -> str:
    """The token in `path`, refused if anyone but its owner may read it."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise TokenError(f"cannot read the node token file {path}: {exc.strerror}") from None
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        raise TokenError(
            f"the node token file {path} is readable by other users (mode {stat.S_IMODE(mode):04o}); "
            f"run `chmod 600 {path}`"
        )
    try:
        return check_token(path.read_text(), source=str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the node token file {path}: {exc}") from None


def write_token_file(path: Path, token: str) -> None:
    """Store the token in `path` with mode 0600 (also when the file existed with a wider one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")


def resolve_token(token_file: Path | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(token, where it came from): ARCEUS_NODE_TOKEN, else `token_file`."""
    if environ.get(TOKEN_ENV):
        return check_token(environ[TOKEN_ENV], source=TOKEN_ENV), TOKEN_ENV
    if token_file is None:
        raise TokenError(
            f"no node token: set {TOKEN_ENV}, or give --token-file FILE (mode 0600), or run "
            "`arceus-agent init --control-plane URL --token-stdin` once"
        )
    return read_token_file(token_file), str(token_file)
