"""The commands a node's owner types besides `run`: `init` (write the settings and store the token),
`status` (what the agent is doing, from its settings and its last heartbeat answer: nodeagent.local_status)
and `service install` (a systemd user unit: nodeagent.service_unit).

None starts an agent or calls the control plane.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from nodeagent.control_plane_http import ControlPlaneError, ControlPlaneSession
from nodeagent.local_status import format_status, read_status
from nodeagent.node_token import TOKEN_ENV, TokenError, check_token, read_token_file, write_token_file
from nodeagent.service_unit import service_command
from nodeagent.settings import (
    DEVICE_TYPES,
    STATUS_FILE_NAME,
    TOKEN_FILE_NAME,
    AgentSettings,
    SettingsError,
    default_settings_path,
    load_settings,
    save_settings,
    settings_from_mapping,
)

OWNER_COMMANDS = ("init", "status", "service")


def _init_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arceus-agent init",
        description="Write the settings `arceus-agent run` starts from, and store the node token in a file only "
        "you can read. The token comes from standard input (--token-stdin), a file of yours (--token-file), or "
        f"{TOKEN_ENV}; never from the command line.",
    )
    parser.add_argument("--control-plane", required=True, metavar="URL", help="e.g. https://arceus.example.org")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--token-stdin", action="store_true", help="read the node token from standard input")
    source.add_argument(
        "--token-file", type=Path, metavar="FILE", help="use the token in FILE (it must be mode 0600) where it is"
    )
    parser.add_argument("--device", choices=DEVICE_TYPES, help="compute device (default: cuda, else mps, else cpu)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="gRPC listen address (default: 127.0.0.1:0)")
    parser.add_argument("--advertise", metavar="HOST:PORT", help="gRPC address others dial (default: --listen)")
    parser.add_argument("--exchange-port", type=int, metavar="PORT",
                        help="the replicas' exchange listener's port (default: a free one at every start)")
    parser.add_argument("--advertise-exchange", metavar="HOST:PORT",
                        help="address others dial for the replicas' exchange (default: --advertise's host at the "
                        "exchange port)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch compute threads (default: all cores)")
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help=f"settings file (default: {default_settings_path()})"
    )
    return parser


def _init(argv: list[str]) -> int:
    parser = _init_parser()
    args = parser.parse_args(argv)
    path: Path = args.config or default_settings_path()
    try:
        if args.token_file is not None:
            token_file = args.token_file.resolve()
            read_token_file(token_file)  # refused now rather than at the first start
            token = None
        else:
            token_file = path.with_name(TOKEN_FILE_NAME)
            if args.token_stdin:
                token = check_token(sys.stdin.read(), source="standard input")
            elif os.environ.get(TOKEN_ENV):
                token = check_token(os.environ[TOKEN_ENV], source=TOKEN_ENV)
            else:
                parser.error(f"give the node token by --token-stdin (e.g. `arceus-agent init ... --token-stdin < "
                             f"token.txt`), --token-file FILE (chmod 600) or {TOKEN_ENV}")
        keys = ("device", "listen", "advertise", "exchange_port", "advertise_exchange", "threads")
        given = {key: getattr(args, key) for key in keys}
        settings = settings_from_mapping(
            {"control_plane": args.control_plane, "token_file": str(token_file),
             **{key: value for key, value in given.items() if value is not None}},
            source="arceus-agent init",
        )
    except (TokenError, SettingsError) as exc:
        print(f"arceus-agent init: {exc}", file=sys.stderr)
        return 2
    if token is not None:
        write_token_file(token_file, token)
    save_settings(path, settings)
    print(f"settings written to {path}")
    print(f"node token in {token_file} (mode 0600)")
    print("start the agent with `arceus-agent run`; `arceus-agent status` shows what it is doing")
    return 0


def _status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="arceus-agent status",
        description="Show the agent's settings, registration, device, stages and the controls in force.",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help=f"settings file (default: {default_settings_path()})"
    )
    args = parser.parse_args(argv)
    path: Path = args.config or default_settings_path()
    try:
        settings: AgentSettings = load_settings(path)
    except SettingsError as exc:
        print(f"arceus-agent status: {exc}", file=sys.stderr)
        return 2
    secret: str | None = os.environ.get(TOKEN_ENV) or None
    if secret:
        token = f"from {TOKEN_ENV}"
    else:
        try:
            secret = read_token_file(Path(settings.token_file))
            token = f"in {settings.token_file} (mode 0600)"
        except TokenError as exc:
            token = f"unusable: {exc}"
    print(f"settings:      {path}")
    print(f"control plane: {settings.control_plane}")
    print(f"node token:    {token}")
    for line in format_status(read_status(path.with_name(STATUS_FILE_NAME)), time.time()):
        print(line)
    print(f"earnings:      {_earnings(settings.control_plane, secret)}")
    return 0


def _earnings(control_plane: str, token: str | None) -> str:
    """Today's (UTC) and all-time credit, as the control plane has it; why not, where it cannot say."""
    if token is None:
        return "unknown (no usable node token)"
    try:
        earned = ControlPlaneSession(control_plane, token, timeout=5.0).earnings()
    except ControlPlaneError as exc:
        return f"unknown ({exc})"
    today = datetime.now(UTC).date().isoformat()
    today_usd = next((day["credit_usd"] for day in earned.get("per_day", []) if day.get("day") == today), "0")
    withheld = f", ${earned['withheld_usd']} withheld" if str(earned.get("withheld_usd", "0")).strip("0.") else ""
    return f"${today_usd} today (UTC), ${earned.get('credit_usd')} in all{withheld}"


def run_owner_command(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    return {"init": _init, "status": _status, "service": service_command}[command](rest)
