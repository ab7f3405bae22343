"""The `arceus-agent` command line (also `python -m nodeagent`): `arceus-agent [run]` runs a node agent against a
control plane, or from a static assignment file; `init`, `status` and `service` are the owner's other commands
(nodeagent.owner_commands).

What `run` runs with is checked whole first (nodeagent.run_options); nodeagent.runner then runs it. The node token
comes from ARCEUS_NODE_TOKEN or a file only its owner can read (nodeagent.node_token), never from the command line.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from arceus.errors import SpecError
from nodeagent.agent import split_host_port
from nodeagent.neighbour_links import DEFAULT_INTERVAL_SECONDS
from nodeagent.owner_commands import OWNER_COMMANDS, run_owner_command
from nodeagent.run_options import UsageError, run_options
from nodeagent.runner import run_agent
from nodeagent.settings import DEFAULT_LEAVE_TIMEOUT_SECONDS, DEVICE_TYPES, default_settings_path


def _address(value: str) -> str:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: a free one), got {value!r}")
    return int(value)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number (e.g. 5e10)") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arceus-agent",
        description="Run a node agent (`arceus-agent run`, the default): from the settings `arceus-agent init` "
        "wrote, or against --control-plane URL with the token in ARCEUS_NODE_TOKEN or --token-file, or from "
        "--static-assignment FILE.",
        epilog="other commands: `arceus-agent init --control-plane URL --token-stdin` writes the settings; "
        "`arceus-agent status` shows registration, device, stages and controls; `arceus-agent service install` "
        "writes a systemd user unit (each has --help)",
    )
    parser.add_argument(
        "--control-plane", metavar="URL",
        help="control plane base URL, e.g. http://127.0.0.1:8000 (default: the settings file's; with no settings "
        "file, the one advertised on the local network by mDNS)",
    )
    parser.add_argument(
        "--token-file", type=Path, metavar="FILE",
        help="file holding this node's token, readable by its owner only (chmod 600); ARCEUS_NODE_TOKEN wins",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help=f"settings file to run from when --control-plane is not given (default: {default_settings_path()})",
    )
    parser.add_argument(
        "--static-assignment",
        metavar="FILE",
        type=Path,
        help="run the stages in this JSON list of assignments; no control plane",
    )
    parser.add_argument(
        "--device", choices=DEVICE_TYPES, help="compute device (default: cuda, else mps, else cpu)"
    )
    parser.add_argument(
        "--listen",
        type=_address,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="gRPC listen address; port 0 picks a free port (default: %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        type=_address,
        metavar="HOST:PORT",
        help="gRPC address others should dial (default: the listen address)",
    )
    parser.add_argument(
        "--exchange-port",
        type=_port,
        default=0,
        metavar="PORT",
        help="port of the replicas' exchange listener, on the --listen host: the second port a router forwards "
        "to this agent (default: a free one at every start)",
    )
    parser.add_argument(
        "--advertise-exchange",
        type=_address,
        metavar="HOST:PORT",
        help="address other agents dial for the replicas' exchange: the router's port forwarded to --exchange-port "
        "(default: the --advertise host at the exchange listener's port)",
    )
    parser.add_argument(
        "--metrics-listen",
        type=_address,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="/metrics listen address (default: %(default)s)",
    )
    parser.add_argument("--threads", type=_positive_int, metavar="N", help="torch intra-op threads")
    parser.add_argument(
        "--solo-threads",
        type=_positive_int,
        metavar="N",
        help="torch intra-op threads while every other stage of the pipeline waits for this one (its "
        "fill and drain): for agents that share one machine, which lend each other their idle cores "
        "(default: --threads)",
    )
    parser.add_argument(
        "--declare-flops",
        type=_positive_float,
        metavar="FLOPS",
        help="report this fp32 FLOP/s instead of measuring it, e.g. 5e10 to offer only part of a shared "
        "machine (placement gives faster nodes more layers)",
    )
    parser.add_argument(
        "--tls-key-file",
        type=Path,
        metavar="FILE",
        help="PEM private key the gRPC port serves TLS with, beside --tls-cert-file (default: a new key and "
        "self-signed certificate at every start; the control plane registers it and callers pin it)",
    )
    parser.add_argument("--tls-cert-file", type=Path, metavar="FILE", help="PEM certificate of --tls-key-file")
    parser.add_argument(
        "--metrics-token-file",
        type=Path,
        metavar="FILE",
        help="with --static-assignment: the token a scrape of /metrics must present (without it /metrics answers "
        "nobody; with a control plane, the control plane sets it)",
    )
    parser.add_argument(
        "--link-probe-interval",
        type=_positive_float,
        default=DEFAULT_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="re-measure the links to the pipeline neighbours this often, and after the stages change "
        "(default: %(default)s; not with --static-assignment, which reports to no one)",
    )
    parser.add_argument(
        "--leave-timeout",
        type=_positive_float,
        default=DEFAULT_LEAVE_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, wait at most this long for the control plane to move this node's stages "
        "before exiting anyway (default: %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWNER_COMMANDS:
        return run_owner_command(argv)
    if argv and argv[0] == "run":
        argv = argv[1:]
    parser = build_parser()
    if any(arg == "--token" or arg.startswith("--token=") for arg in argv):
        parser.error("--token is gone: a token on the command line is visible to every local user (ps); set "
                     "ARCEUS_NODE_TOKEN, give --token-file FILE (chmod 600), or run `arceus-agent init --token-stdin`")
    try:
        options = run_options(parser, argv)
    except UsageError as exc:
        parser.error(str(exc))
    except SpecError as exc:
        print(f"nodeagent: invalid static assignment: {exc}", file=sys.stderr)
        return 2
    return run_agent(options)
