"""`arceus-agent [run]` (or `python -m nodeagent`): run a node agent against a control plane, or from a static
assignment file.

`arceus-agent init` writes the settings it runs from by default, `arceus-agent status` shows what it is
doing (nodeagent.owner_commands). The node token comes from ARCEUS_NODE_TOKEN or a file only its owner
can read (nodeagent.node_token), never from the command line.

Once it serves, it prints exactly one stdout line, `AGENT READY grpc=HOST:PORT metrics=HOST:PORT` (the
advertised gRPC address and the metrics address); everything else goes to stderr.
SIGTERM or SIGINT against a control plane drain it first: it says it is leaving, so its stage moves without
losing work, and exits 0 once nothing is assigned to it (or after --leave-timeout); a second signal, or one
with no control plane, stops it at once (exit code 0).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
from pathlib import Path

import torch

from arceus.contracts.credentials import token_digest
from arceus.contracts.observed import ObservedState
from arceus.discovery import DiscoveryError, discover_control_plane
from arceus.errors import SpecError
from arceus.wire.tls import load_identity
from nodeagent.agent import Agent, split_host_port
from nodeagent.control_plane import (
    ControlPlaneClient,
    HeartbeatLoop,
    HeartbeatReply,
    Unauthorized,
    measure_link,
    register_until_accepted,
)
from nodeagent.device import DEVICE_TYPES, DeviceError, capabilities, check_device_computes, select_device
from nodeagent.heap import retain_freed_blocks
from nodeagent.lan import lan_address
from nodeagent.leaving import DEFAULT_LEAVE_TIMEOUT_SECONDS, Leaving
from nodeagent.local_status import write_status
from nodeagent.neighbour_links import DEFAULT_INTERVAL_SECONDS
from nodeagent.node_token import TokenError, resolve_token
from nodeagent.openmp import describe_openmp_spin
from nodeagent.owner_commands import OWNER_COMMANDS, run_owner_command
from nodeagent.settings import STATUS_FILE_NAME, SettingsError, default_settings_path, load_settings
from nodeagent.static import load_local_checkpoint, load_static_assignments

log = logging.getLogger("nodeagent")
STOP_GRACE_SECONDS = 5.0


def _address(value: str) -> str:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


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
    args = parser.parse_args(argv)
    status_path: Path | None = None  # where a settings-mode agent reports for `arceus-agent status`
    discover = False  # no URL and no settings: the control plane advertised on the local network (mDNS)
    if args.static_assignment is not None:
        if args.control_plane or args.token_file or args.config:
            parser.error("--static-assignment runs without a control plane; drop --control-plane/--token-file/--config")
    elif args.metrics_token_file is not None:
        parser.error("--metrics-token-file is for --static-assignment: the control plane sets the scrape token")
    elif args.control_plane is None and args.config is None and not default_settings_path().exists():
        discover = True  # once the token is known to be there: browsing takes seconds
    elif args.control_plane is None:
        settings_path = args.config or default_settings_path()
        try:
            settings = load_settings(settings_path)
        except SettingsError as exc:
            parser.error(f"{exc} (or give --static-assignment FILE, or --control-plane URL)")
        # The settings are the defaults; a flag given as well wins.
        parser.set_defaults(**{k: v for k, v in vars(settings).items() if v is not None and k != "token_file"})
        parser.set_defaults(token_file=Path(settings.token_file))
        args = parser.parse_args(argv)
        status_path = settings_path.with_name(STATUS_FILE_NAME)
    token = None
    if args.static_assignment is None:
        try:
            token = resolve_token(args.token_file)[0]
        except TokenError as exc:
            parser.error(str(exc))
    if discover:
        try:
            found = discover_control_plane()
        except DiscoveryError as exc:
            parser.error(f"{exc} with --control-plane URL (or run `arceus-agent init`, or give --static-assignment)")
        print(f"nodeagent: found the control plane {found.url} on the local network ({found.service})",
              file=sys.stderr)
        args.control_plane = found.url
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = args.threads or torch.get_num_threads()
    if args.solo_threads is not None and args.solo_threads < threads:
        parser.error(f"--solo-threads {args.solo_threads} is below the {threads} threads the agent runs with")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = select_device(args.device)
        check_device_computes(device)
    except DeviceError as exc:
        parser.error(str(exc))
    identity = None
    if (args.tls_key_file is None) != (args.tls_cert_file is None):
        parser.error("--tls-key-file and --tls-cert-file go together")
    if args.tls_key_file is not None:
        try:
            identity = load_identity(args.tls_key_file.read_bytes(), args.tls_cert_file.read_bytes())
        except (OSError, ValueError) as exc:
            parser.error(f"--tls-key-file/--tls-cert-file: {exc}")
    scrape_digest = None
    if args.metrics_token_file is not None:
        try:
            scrape_token = args.metrics_token_file.read_text().strip()
        except OSError as exc:
            parser.error(f"--metrics-token-file: {exc}")
        if not scrape_token:
            parser.error(f"--metrics-token-file: {args.metrics_token_file} is empty")
        scrape_digest = token_digest(scrape_token)
    assignments = None
    if args.static_assignment is not None:
        try:
            assignments = load_static_assignments(args.static_assignment)
        except SpecError as exc:
            print(f"nodeagent: invalid static assignment: {exc}", file=sys.stderr)
            return 2
    # Process-wide and for good: only once the agent will run.
    heap_kept = retain_freed_blocks()
    log.info(
        "computing on %s with %d torch threads (%s), OpenMP spin count %s, freed blocks %s",
        device, threads,
        f"{args.solo_threads} in solo actions" if args.solo_threads else "none borrowed",
        describe_openmp_spin(),
        "kept in the heap" if heap_kept else "returned as the allocator decides",
    )

    stop = threading.Event()
    fatal: list[str] = []
    leaving = Leaving(stop, args.leave_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leaving.on_signal)

    client = None if token is None else ControlPlaneClient(args.control_plane, token)
    agent = Agent(
        device=device,
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        advertise=args.advertise,
        load_checkpoint=load_local_checkpoint if client is None else client.fetch_checkpoint,
        load_program=None if client is None else client.fetch_program,
        load_initial_weights=None if client is None else client.fetch_initial_weights,
        upload_state=None if client is None else client.upload_state,
        link_probe_interval=None if client is None else args.link_probe_interval,
        solo_threads=args.solo_threads,
        identity=identity,
    )
    agent.metrics.accept_scrapes(scrape_digest)  # with a control plane: each heartbeat answer says
    try:
        agent.start()
    except OSError as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 1
    heartbeats: HeartbeatLoop | None = None
    try:
        if client is None:
            agent.apply_assignments(assignments or [])
            failed = [o for o in agent.observed() if o["state"] == ObservedState.FAILED]
            if failed:
                for o in failed:
                    print(f"nodeagent: stage {o['stage_id']} failed: {o['message']}", file=sys.stderr)
                return 1
        else:
            measured = capabilities(device, declared_flops=args.declare_flops)
            agent.registry.runtime_bytes = measured.runtime_bytes
            caps = measured.to_json()
            caps["link"] = measure_link(client)
            log.info("registering with %s as %s: %s", args.control_plane, agent.advertise_address, caps)
            registration = register_until_accepted(
                client, agent.advertise_address, caps, agent.signer.public_key_hex, agent.identity.certificate,
                stop=stop, metrics_port=agent.metrics_port,
                lan_address=lan_address(args.control_plane, agent.grpc_address.rpartition(":")[0], agent.grpc_port),
            )
            if registration is None:
                return 0  # stopped before the control plane answered
            log.info("registered as node %s", registration.node_id)

            def on_fatal(message: str) -> None:
                fatal.append(message)
                stop.set()

            def on_reply(reply: HeartbeatReply) -> None:
                leaving.on_reply(reply)
                if status_path is None:
                    return
                controls = {"max_threads": reply.max_threads, "max_memory_bytes": reply.max_memory_bytes}
                try:
                    write_status(status_path, {
                        "control_plane": args.control_plane, "node_id": reply.node_id, "device": str(device),
                        "grpc_address": agent.advertise_address, "stages": agent.observed(), "controls": controls,
                    })
                except OSError as exc:
                    log.warning("cannot write %s for `arceus-agent status`: %s", status_path, exc)

            heartbeats = HeartbeatLoop(
                client, agent, interval=registration.heartbeat_interval_seconds, on_fatal=on_fatal,
                on_reply=on_reply,
            )
            heartbeats.start()
            leaving.arm()
        print(f"AGENT READY grpc={agent.advertise_address} metrics={agent.metrics_address}", flush=True)
        while not stop.wait(0.2):  # short: a signal only sets the flag, the wait must notice
            if leaving.requested.is_set() and client is not None:
                leaving.drain(client)
    except Unauthorized as exc:
        fatal.append(str(exc))
    finally:
        if heartbeats is not None:
            heartbeats.stop()
        agent.stop(STOP_GRACE_SECONDS)
    if fatal:
        print(f"nodeagent: {fatal[0]}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
