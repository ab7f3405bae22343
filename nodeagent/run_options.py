"""What `arceus-agent run` runs with, checked whole before the agent starts (nodeagent.runner runs it).

Its flags over the settings file `arceus-agent init` wrote (a flag given wins), the node token (never from
the command line: nodeagent.node_token), the control plane (given, from the settings, or found on the local
network by mDNS), the compute device, the TLS identity and, without a control plane, the static assignments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.credentials import token_digest
from arceus.discovery import DiscoveryError, discover_control_plane
from arceus.wire.tls import TlsIdentity, load_identity
from nodeagent.device import DeviceError, check_device_computes, select_device
from nodeagent.node_token import TokenError, resolve_token
from nodeagent.settings import STATUS_FILE_NAME, SettingsError, default_settings_path, load_settings
from nodeagent.static import load_static_assignments


class UsageError(ValueError):
    """What the command line asks for cannot run; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class ControlPlaneLogin:
    url: str
    token: str = field(repr=False)  # the node token


@dataclass(frozen=True)
class RunOptions:
    control_plane: ControlPlaneLogin | None  # None: no control plane, the static assignments
    static_assignments: list[Assignment]  # what to host without a control plane
    status_path: Path | None  # where an agent run from its settings reports for `arceus-agent status`
    device: torch.device
    threads: int | None  # torch intra-op threads (None: torch's default)
    solo_threads: int | None
    declare_flops: float | None
    listen: str
    advertise: str | None
    exchange_port: int  # 0: a free one
    advertise_exchange: str | None
    metrics_listen: str
    identity: TlsIdentity | None  # None: a new key and self-signed certificate
    # With static assignments, the digest of the token a scrape of /metrics must present (None: /metrics answers
    # nobody); against a control plane, each heartbeat answer says.
    scrape_digest: str | None
    link_probe_interval: float
    leave_timeout: float


def run_options(parser: argparse.ArgumentParser, argv: list[str]) -> RunOptions:
    """The options of `arceus-agent run ARGV` (`parser`: nodeagent.cli's). Raises UsageError, or SpecError for
    a static assignment file that is not a list of valid assignments."""
    args, status_path, discover = _arguments(parser, argv)
    token = None if args.static_assignment is not None else _token(args.token_file)
    if discover:  # once the token is known to be there: browsing takes seconds
        args.control_plane = _control_plane_on_the_network()
    if args.advertise_exchange is not None and args.exchange_port == 0:
        raise UsageError(
            f"--advertise-exchange {args.advertise_exchange} needs --exchange-port PORT: a router forwards to a fixed "
            "port, and without one the exchange listener takes a free port at every start"
        )
    threads = args.threads or torch.get_num_threads()
    if args.solo_threads is not None and args.solo_threads < threads:
        raise UsageError(f"--solo-threads {args.solo_threads} is below the {threads} threads the agent runs with")
    device = _device(args.device)
    identity = _identity(args.tls_key_file, args.tls_cert_file)
    scrape_digest = None if args.metrics_token_file is None else _scrape_digest(args.metrics_token_file)
    static = [] if args.static_assignment is None else load_static_assignments(args.static_assignment)
    return RunOptions(
        control_plane=None if token is None else ControlPlaneLogin(args.control_plane, token),
        static_assignments=static,
        status_path=status_path,
        device=device,
        threads=args.threads,
        solo_threads=args.solo_threads,
        declare_flops=args.declare_flops,
        listen=args.listen,
        advertise=args.advertise,
        exchange_port=args.exchange_port,
        advertise_exchange=args.advertise_exchange,
        metrics_listen=args.metrics_listen,
        identity=identity,
        scrape_digest=scrape_digest,
        link_probe_interval=args.link_probe_interval,
        leave_timeout=args.leave_timeout,
    )


def _arguments(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, Path | None, bool]:
    """The parsed flags, over the settings file's values when there is no --control-plane; where such an agent
    reports its status; whether to look for the control plane on the local network (no URL, no settings)."""
    args = parser.parse_args(argv)
    if args.static_assignment is not None:
        if args.control_plane or args.token_file or args.config:
            raise UsageError(
                "--static-assignment runs without a control plane; drop --control-plane/--token-file/--config"
            )
        return args, None, False
    if args.metrics_token_file is not None:
        raise UsageError("--metrics-token-file is for --static-assignment: the control plane sets the scrape token")
    if args.control_plane is not None:
        return args, None, False
    if args.config is None and not default_settings_path().exists():
        return args, None, True
    settings_path = args.config or default_settings_path()
    try:
        settings = load_settings(settings_path)
    except SettingsError as exc:
        raise UsageError(f"{exc} (or give --static-assignment FILE, or --control-plane URL)") from None
    # The settings are the defaults; a flag given as well wins.
    parser.set_defaults(**{k: v for k, v in vars(settings).items() if v is not None and k != "token_file"})
    parser.set_defaults(token_file=Path(settings.token_file))
    return parser.parse_args(argv), settings_path.with_name(STATUS_FILE_NAME), False


def _token(token_file: Path | None) -> str:
    try:
        return resolve_token(token_file)[0]
    except TokenError as exc:
        raise UsageError(str(exc)) from None


def _control_plane_on_the_network() -> str:
    try:
        found = discover_control_plane()
    except DiscoveryError as exc:
        raise UsageError(
            f"{exc} with --control-plane URL (or run `arceus-agent init`, or give --static-assignment)"
        ) from None
    print(f"nodeagent: found the control plane {found.url} on the local network ({found.service})", file=sys.stderr)
    return found.url


def _device(requested: str | None) -> torch.device:
    try:
        device = select_device(requested)
        check_device_computes(device)
    except DeviceError as exc:
        raise UsageError(str(exc)) from None
    return device


def _identity(key_file: Path | None, cert_file: Path | None) -> TlsIdentity | None:
    if (key_file is None) != (cert_file is None):
        raise UsageError("--tls-key-file and --tls-cert-file go together")
    if key_file is None or cert_file is None:
        return None
    try:
        return load_identity(key_file.read_bytes(), cert_file.read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tls-key-file/--tls-cert-file: {exc}") from None


def _scrape_digest(token_file: Path) -> str:
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise UsageError(f"--metrics-token-file: {exc}") from None
    if not token:
        raise UsageError(f"--metrics-token-file: {token_file} is empty")
    return token_digest(token)
