"""Running a node agent with its checked options (nodeagent.run_options): against a control plane (register,
heartbeat, report for `arceus-agent status`) or from static assignments, until a signal stops it.

Once it serves, it prints exactly one stdout line, `AGENT READY grpc=HOST:PORT metrics=HOST:PORT exchange=HOST:PORT`
(the advertised gRPC address, the metrics address and its replicas' exchange listener); everything else goes to
stderr.
SIGTERM or SIGINT against a control plane drain it first: it says it is leaving, so its stage moves without
losing work, and exits 0 once nothing is assigned to it (or after --leave-timeout); a second signal, or one
with no control plane, stops it at once (exit code 0).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from arceus.contracts.assignment import Assignment
from arceus.contracts.observed import ObservedState
from nodeagent import faults
from nodeagent.agent import Agent
from nodeagent.control_plane import (
    ControlPlaneClient,
    HeartbeatLoop,
    HeartbeatReply,
    Registration,
    measure_link,
    register_until_accepted,
)
from nodeagent.control_plane_http import Unauthorized
from nodeagent.device import capabilities
from nodeagent.heap import retain_freed_blocks
from nodeagent.lan import lan_address
from nodeagent.leaving import Leaving
from nodeagent.local_status import write_status
from nodeagent.openmp import describe_openmp_spin
from nodeagent.run_options import RunOptions
from nodeagent.static import load_local_checkpoint
from nodeagent.warm_up import warm_up_training

log = logging.getLogger("nodeagent")
STOP_GRACE_SECONDS = 5.0
# How often the main thread looks at the stop flag: a signal handler only sets it, the wait must notice.
POLL_SECONDS = 0.2


def run_agent(options: RunOptions) -> int:
    """Run the agent until it is stopped; the process's exit code."""
    _take_process_settings(options)
    try:
        faults.arm(os.environ)  # a test hook (devtools only): read once, here
    except faults.FaultSpecError as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    leaving = Leaving(stop, options.leave_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leaving.on_signal)
    login = options.control_plane
    client = None if login is None else ControlPlaneClient(login.url, login.token)
    agent = _new_agent(options, client)
    try:
        agent.start()
    except OSError as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 1
    if login is None:
        return _serve_static(agent, options.static_assignments, stop)
    return _serve_control_plane(agent, client, login.url, options, stop, leaving)


def _take_process_settings(options: RunOptions) -> None:
    """Logging, torch's threads and the heap: process-wide and for good, so only once the agent will run."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = options.threads or torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    heap_kept = retain_freed_blocks()
    log.info(
        "computing on %s with %d torch threads (%s), OpenMP spin count %s, freed blocks %s",
        options.device, threads,
        f"{options.solo_threads} in solo actions" if options.solo_threads else "none borrowed",
        describe_openmp_spin(),
        "kept in the heap" if heap_kept else "returned as the allocator decides",
    )


def _new_agent(options: RunOptions, client: ControlPlaneClient | None) -> Agent:
    """The agent, loading what its stages need from the control plane (or, static, checkpoints from files)."""
    agent = Agent(
        device=options.device,
        listen=options.listen,
        metrics_listen=options.metrics_listen,
        advertise=options.advertise,
        exchange_port=options.exchange_port,
        advertise_exchange=options.advertise_exchange,
        load_checkpoint=load_local_checkpoint if client is None else client.fetch_checkpoint,
        load_program=None if client is None else client.fetch_program,
        load_initial_weights=None if client is None else client.fetch_initial_weights,
        upload_state=None if client is None else client.upload_state,
        read_dataset=None if client is None else client.read_dataset_ranges,
        link_probe_interval=None if client is None else options.link_probe_interval,
        solo_threads=options.solo_threads,
        identity=options.identity,
    )
    agent.metrics.accept_scrapes(options.scrape_digest)  # with a control plane: each heartbeat answer says
    return agent


def _serve_static(agent: Agent, assignments: list[Assignment], stop: threading.Event) -> int:
    """Host `assignments` until a signal; exit 1 at once if one cannot be built."""
    try:
        agent.apply_assignments(assignments)
        failed = [o for o in agent.observed() if o["state"] == ObservedState.FAILED]
        for o in failed:
            print(f"nodeagent: stage {o['stage_id']} failed: {o['message']}", file=sys.stderr)
        if failed:
            return 1
        _say_ready(agent)
        while not stop.wait(POLL_SECONDS):
            pass
    finally:
        agent.stop(STOP_GRACE_SECONDS)
    log.info("stopped")
    return 0


def _serve_control_plane(
    agent: Agent, client: ControlPlaneClient, url: str, options: RunOptions, stop: threading.Event,
    leaving: Leaving,
) -> int:
    """Register, heartbeat, and serve what the control plane assigns until stopped (a first signal drains the
    node); exit 1 if the control plane refuses the node token."""
    fatal: list[str] = []
    heartbeats: HeartbeatLoop | None = None

    def on_fatal(message: str) -> None:
        fatal.append(message)
        stop.set()

    try:
        registration = _register(agent, client, url, options, stop)
        if registration is None:
            return 0  # stopped before the control plane answered
        heartbeats = HeartbeatLoop(
            client, agent, interval=registration.heartbeat_interval_seconds, on_fatal=on_fatal,
            on_reply=_on_reply(leaving, url, options.status_path, agent),
        )
        heartbeats.start()
        leaving.arm()
        _say_ready(agent)
        while not stop.wait(POLL_SECONDS):
            if leaving.requested.is_set():
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


def _register(
    agent: Agent, client: ControlPlaneClient, url: str, options: RunOptions, stop: threading.Event
) -> Registration | None:
    """Measure the device and the link to the control plane at `url`, and register (retrying while it cannot be
    reached); None if stopped first. Raises Unauthorized. What it holds is measured after it loaded what training
    any stage loads (`warm_up_training`)."""
    warm_up_training(agent.device)
    measured = capabilities(agent.device, declared_flops=options.declare_flops)
    agent.registry.runtime_bytes = measured.runtime_bytes
    caps = measured.to_json()
    caps["link"] = measure_link(client)
    log.info("registering with %s as %s: %s", url, agent.advertise_address, caps)
    registration = register_until_accepted(
        client, agent.advertise_address, caps, agent.signer.public_key_hex, agent.identity,
        stop=stop, metrics_port=agent.metrics_port,
        lan_address=lan_address(url, agent.grpc_address.rpartition(":")[0], agent.grpc_port),
        exchange_port=agent.exchange_streams.port, exchange_address=options.advertise_exchange,
    )
    if registration is not None:
        log.info("registered as node %s", registration.node_id)
    return registration


def _on_reply(
    leaving: Leaving, url: str, status_path: Path | None, agent: Agent
) -> Callable[[HeartbeatReply], None]:
    """What each heartbeat answer is told to: the leave in progress, and the status file of an agent run from
    its settings (`status_path`)."""

    def on_reply(reply: HeartbeatReply) -> None:
        leaving.on_reply(reply)
        if status_path is not None:
            _write_status(status_path, url, agent, reply)

    return on_reply


def _write_status(path: Path, url: str, agent: Agent, reply: HeartbeatReply) -> None:
    controls = {"max_threads": reply.max_threads, "max_memory_bytes": reply.max_memory_bytes}
    try:
        write_status(path, {
            "control_plane": url, "node_id": reply.node_id, "device": str(agent.device),
            "grpc_address": agent.advertise_address, "stages": agent.observed(), "controls": controls,
        })
    except OSError as exc:
        log.warning("cannot write %s for `arceus-agent status`: %s", path, exc)


def _say_ready(agent: Agent) -> None:
    print(f"AGENT READY grpc={agent.advertise_address} metrics={agent.metrics_address} "
          f"exchange={agent.exchange_address}", flush=True)
