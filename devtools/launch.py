"""Start `python -m nodeagent` processes and wait for their READY line (tests and benchmarks)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.pipeline import identity_for
from nodeagent.faults import ENABLE_ENV, FAULT_ENV

READY_PREFIX = "AGENT READY"


class AgentStartError(RuntimeError):
    pass


@dataclass
class AgentProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_address: str
    metrics_address: str
    certificate: str = ""  # its TLS certificate, where the starter gave it its identity
    metrics_token: str = ""  # what its /metrics wants, where the starter gave it one (a static agent)
    exchange_address: str = ""  # its replicas' exchange listener (READY's exchange=)
    terminated: bool = False

    def terminate(self) -> None:
        """SIGTERM, once: a second one could land while the interpreter is finalizing, when Python has put back
        the default handler, and kill a cleanly stopping agent (exit code -15)."""
        if self.process.poll() is None and not self.terminated:
            self.terminated = True
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 10.0) -> int:
        """Wait for the exit after `terminate` (SIGKILL after `timeout`); returns the exit code."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return self.process.wait()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); returns the exit code."""
        self.terminate()
        return self.wait_stopped(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open together while choosing)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def spawn_agent(
    args: Sequence[str], *, log_path: Path, ready_timeout: float = 60.0, env: dict[str, str] | None = None
) -> AgentProcess:
    """Run `python -m nodeagent ARGS` with stdout and stderr in `log_path`; return once it is READY."""
    process_env = dict(os.environ if env is None else env)
    process_env.setdefault("OMP_NUM_THREADS", "1")
    process_env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=process_env,
        )
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    fields = dict(part.split("=", 1) for part in line.split()[2:])
                    return AgentProcess(process, log_path, fields["grpc"], fields["metrics"],
                                        exchange_address=fields["exchange"])
            if process.poll() is not None:
                raise AgentStartError(
                    f"agent exited with code {process.returncode} before READY:\n"
                    f"{log_path.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AgentStartError(
                    f"agent printed no READY line within {ready_timeout:.0f}s; see {log_path}"
                )
            time.sleep(0.05)
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise


def spawn_static_agents(
    assignments_per_agent: Sequence[Sequence[dict]],
    addresses: Sequence[str],
    workdir: Path,
    *,
    threads: int = 1,
    solo_threads: int | None = None,
    device: str | None = None,
    ready_timeout: float = 60.0,
    faults: Mapping[int, str] | None = None,
    extra_args: Sequence[Sequence[str]] = (),
) -> list[AgentProcess]:
    """Start one static-assignment agent per address (in parallel, they are slow to import torch), agent i
    hosting `assignments_per_agent[i]` and listening on `addresses[i]` with the TLS identity
    `devtools.pipeline.identity_for(addresses[i])` and a scrape token of its own (`metrics_token`), with `threads`
    torch threads (`solo_threads` while its stage computes alone: see --solo-threads), computing on `device` (None: the
    agent's choice, a GPU where there is one), agent i's fault hook armed with `faults[i]` where it names one
    (nodeagent.faults, a test hook), and agent i's `extra_args[i]` where given (e.g. where its peer-stream listener is
    advertised). All or none: on failure, the ones already started are killed."""
    workdir.mkdir(parents=True, exist_ok=True)

    def start(i: int) -> AgentProcess:
        path = workdir / f"agent-{i}.json"
        path.write_text(json.dumps(list(assignments_per_agent[i]), indent=1))
        identity = identity_for(addresses[i])
        key, certificate = workdir / f"agent-{i}.key.pem", workdir / f"agent-{i}.cert.pem"
        key.touch(mode=0o600)
        key.write_bytes(identity.key_pem)
        certificate.write_bytes(identity.certificate_pem)
        metrics_token = workdir / f"agent-{i}.metrics-token"
        metrics_token.touch(mode=0o600)
        metrics_token.write_text(secrets.token_hex(32))
        args = ["--static-assignment", str(path), "--listen", addresses[i], "--threads", str(threads),
                "--tls-key-file", str(key), "--tls-cert-file", str(certificate),
                "--metrics-token-file", str(metrics_token)]
        if solo_threads is not None:
            args += ["--solo-threads", str(solo_threads)]
        if device is not None:
            args += ["--device", device]
        if extra_args:
            args += list(extra_args[i])
        armed = {FAULT_ENV: faults[i], ENABLE_ENV: "1"} if faults and i in faults else {}
        started = spawn_agent(args, log_path=workdir / f"agent-{i}.log", ready_timeout=ready_timeout,
                              env={**os.environ, **armed} if armed else None)
        started.certificate = identity.certificate
        started.metrics_token = metrics_token.read_text()
        return started

    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        futures = [pool.submit(start, i) for i in range(len(addresses))]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for agent in started:
            agent.kill()
        raise errors[0]
    return started


def spawn_static_agents_on_free_ports(
    count: int,
    assignments_for: Callable[[list[str]], Sequence[Sequence[dict]]],
    workdir: Path,
    *,
    attempts: int = 3,
    **options: Any,
) -> tuple[list[AgentProcess], list[str]]:
    """`spawn_static_agents` on `count` loopback ports free a moment ago, agent i hosting
    `assignments_for(addresses)[i]`; returns the agents and their addresses. A port taken between choosing and
    binding (any outgoing connection may take it as its source port) costs a retry on new ports."""
    attempt = 1
    while True:
        addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
        try:
            return spawn_static_agents(assignments_for(addresses), addresses, workdir / f"attempt-{attempt}",
                                       **options), addresses
        except AgentStartError as exc:
            if "Failed to bind" not in str(exc) or attempt == attempts:
                raise
            attempt += 1


def stop_agents(agents: Sequence[AgentProcess], timeout: float = 10.0) -> list[int]:
    """SIGTERM every agent at once, then wait for each; returns their exit codes."""
    for agent in agents:
        agent.terminate()
    return [agent.wait_stopped(timeout) for agent in agents]
