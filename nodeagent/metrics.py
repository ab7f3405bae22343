"""The agent's Prometheus metrics, in their own registry, served on /metrics to the holder of its scrape token.

Base units, no per-step or per-micro-batch labels; the only labels are the step mode, the stage and replica id of
each replica of a replicated stage hosted here, and, on the stage info metric, the stages hosted here (a handful
per agent). Those name jobs, so a scrape must present the
token whose SHA-256 the control plane sent (`accept_scrapes`; arceus/contracts/scrape.py), as a bearer token or
as the `token` URL parameter (what Prometheus's service discovery can give each target): 401
without it or with another, 403 while the agent has none. The server reads a request for at most
`REQUEST_SECONDS` and serves `MAX_SCRAPES` at once (a connection beyond is closed unread).
"""

from __future__ import annotations

import hmac
import json
import math
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from arceus.contracts.credentials import token_digest
from arceus.contracts.scrape import SCRAPE_TOKEN_PARAMETER
from nodeagent.device import device_memory_peak_bytes, memory_used_bytes

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_SECONDS = 10.0
MAX_SCRAPES = 64
_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_TOKEN_CHARS = 256
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class AgentMetrics:
    def __init__(self, device: torch.device) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "arceus_stage_step_seconds",
            "Wall time of one RunStep on a stage.",
            ["mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.samples = Counter(
            "arceus_samples_processed_total", "Samples run forward (training and evaluation).", registry=r
        )
        self.micro_batches = Counter(
            "arceus_micro_batches_processed_total", "Micro-batches run forward.", registry=r
        )
        self.compute_seconds = Counter(
            "arceus_compute_seconds_total",
            "Seconds spent in forward, backward and optimizer compute.",
            registry=r,
        )
        self.wait_seconds = Counter(
            "arceus_stage_wait_seconds_total",
            "Seconds steps spent waiting for inputs (activations, labels, gradients) and for sends to be delivered: "
            "beside arceus_compute_seconds_total, the pipeline bubble.",
            registry=r,
        )
        self.step_wait_seconds = Histogram(
            "arceus_stage_step_wait_seconds",
            "Seconds one RunStep on a stage waited for inputs and sends.",
            ["mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.bytes_sent = Counter(
            "arceus_tensor_bytes_sent_total", "Tensor payload bytes pushed to other stages.", registry=r
        )
        self.bytes_received = Counter(
            "arceus_tensor_bytes_received_total",
            "Tensor payload bytes accepted from other stages and drivers.",
            registry=r,
        )
        self.state_bytes_uploaded = Counter(
            "arceus_state_bytes_uploaded_total",
            "Bytes of stage state (checkpoints) this agent uploaded to the control plane itself.",
            registry=r,
        )
        self.state_save_seconds = Histogram(
            "arceus_state_save_seconds",
            "Wall time of one SaveState: a stage's state written and uploaded to the control plane.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.stage_build_seconds = Histogram(
            "arceus_stage_build_seconds",
            "Wall time to build a stage: from its seeded initial weights, or from a checkpoint (downloaded and "
            "loaded).",
            ["source"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.device_memory = Gauge(
            "arceus_device_memory_used_bytes",
            "CUDA tensor memory allocated, or the process's resident set on CPU.",
            registry=r,
        )
        self.device_memory.set_function(lambda: memory_used_bytes(device))
        self.device_memory_peak = Gauge(
            "arceus_device_memory_peak_bytes",
            "The most CUDA tensor memory allocated since the agent started, or the process's peak resident set "
            "(VmHWM) on CPU.",
            registry=r,
        )
        self.device_memory_peak.set_function(lambda: device_memory_peak_bytes(device))
        self.stage_assigned = Gauge("arceus_stage_assigned", "Number of stages this agent hosts.", registry=r)
        self.stage_info = Gauge(
            "arceus_stage_info",
            "1 for each stage this agent hosts (replica: its replica id in a replicated stage, else empty).",
            ["job_id", "stage_index", "replica"],
            registry=r,
        )
        # A replicated stage's replica hosted here, by its stage index and replica id (arceus/swarm): the part of each
        # step's micro-batches the driver routed to it, and how fast it ran them.
        self.replica_micro_batches = Counter(
            "arceus_replica_micro_batches_total",
            "Micro-batches run forward by a replica of a replicated stage hosted here (its share of each step's).",
            ["stage", "replica"],
            registry=r,
        )
        self.replica_samples = Counter(
            "arceus_replica_samples_total",
            "Samples run forward by a replica of a replicated stage hosted here.",
            ["stage", "replica"],
            registry=r,
        )
        self.replica_compute_seconds = Counter(
            "arceus_replica_compute_seconds_total",
            "Seconds a replica of a replicated stage hosted here spent in forward, backward and optimizer compute "
            "(its samples over these: its speed).",
            ["stage", "replica"],
            registry=r,
        )
        self._replicas: set[tuple[str, str]] = set()
        self._replicas_lock = threading.Lock()
        self.heartbeat_age = Gauge(
            "arceus_heartbeat_age_seconds",
            "Seconds since the last successful heartbeat (NaN before the first, and in static mode).",
            registry=r,
        )
        self._last_heartbeat: float | None = None
        self.heartbeat_age.set_function(self._heartbeat_age)
        self._server: _MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._scrape_digest: str | None = None

    def accept_scrapes(self, digest: str | None) -> None:
        """Serve /metrics to the bearer of the token whose SHA-256 (hex) is `digest` (None: to nobody)."""
        if digest is not None and not _DIGEST.fullmatch(digest):
            raise ValueError(f"a scrape token digest is 64 lowercase hex digits, got {digest!r}")
        self._scrape_digest = digest

    def heartbeat_succeeded(self) -> None:
        self._last_heartbeat = time.monotonic()

    def _heartbeat_age(self) -> float:
        return math.nan if self._last_heartbeat is None else time.monotonic() - self._last_heartbeat

    def set_stages(self, stages: Iterable[tuple[str, int, int | None]]) -> None:
        """The (job_id, stage_index, replica id or None) of the stages hosted now; the series of replicas no longer
        hosted go (a replica id is never reused within a job, so an agent's replicas would otherwise pile up)."""
        stages = list(stages)
        self.stage_info.clear()
        for job_id, stage_index, replica in stages:
            self.stage_info.labels(job_id=job_id, stage_index=str(stage_index),
                                   replica="" if replica is None else str(replica)).set(1)
        self.stage_assigned.set(len(stages))
        hosted = {(str(index), str(replica)) for _, index, replica in stages if replica is not None}
        with self._replicas_lock:
            for labels in self._replicas - hosted:
                for counter in self._replica_counters():
                    counter.remove(*labels)
            for labels in hosted - self._replicas:  # exported from 0 at once, before the replica's first step
                for counter in self._replica_counters():
                    counter.labels(*labels)
            self._replicas = hosted

    def _replica_counters(self) -> tuple[Counter, ...]:
        return self.replica_micro_batches, self.replica_samples, self.replica_compute_seconds

    def replica_step(self, stage_index: int, replica: int, *, samples: int, micro_batches: int,
                     compute_seconds: float) -> None:
        """Count one step's work of the replica `replica` of stage `stage_index` (hosted here)."""
        labels = (str(stage_index), str(replica))
        with self._replicas_lock:
            if labels not in self._replicas:  # dropped while its step ran: its series went with it
                return
            self.replica_micro_batches.labels(*labels).inc(micro_batches)
            self.replica_samples.labels(*labels).inc(samples)
            self.replica_compute_seconds.labels(*labels).inc(compute_seconds)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server in a daemon thread; returns the port it listens on."""
        _MetricsServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = make_server(
            host.strip("[]"), port, self._guarded(make_wsgi_app(self.registry)), _MetricsServer,
            handler_class=_QuietHandler,
        )
        self._thread = threading.Thread(target=self._server.serve_until_stopped, name="metrics", daemon=True)
        self._thread.start()
        return int(self._server.server_port)

    def _guarded(self, app: WsgiApp) -> WsgiApp:
        """`app`, for a request presenting the scrape token only."""

        def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            expected = self._scrape_digest
            if expected is None:
                return _refusal(start_response, "403 Forbidden", "metrics are off: this agent has no scrape token "
                                "yet (its control plane sends one with each heartbeat answer)")
            if not any(hmac.compare_digest(token_digest(t), expected) for t in _presented_tokens(environ)):
                return _refusal(start_response, "401 Unauthorized", "send this agent's scrape token (GET "
                                "/metrics/agents on the control plane lists it): Authorization: Bearer <token>")
            return app(environ, start_response)

        return guarded

    def stop(self) -> None:
        """Stop serving scrapes; a second call (an agent stopped twice) does nothing."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None and thread is not None:
            server.stop()
            thread.join()
            server.server_close()


def _presented_tokens(environ: dict[str, Any]) -> list[str]:
    """The tokens a request presents: its bearer token and its `token` URL parameter."""
    scheme, _, bearer = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    query = parse_qs(environ.get("QUERY_STRING", ""), max_num_fields=8)
    tokens = [bearer if scheme.lower() == "bearer" else "", *query.get(SCRAPE_TOKEN_PARAMETER, ())[:1]]
    return [t.strip() for t in tokens if 0 < len(t.strip()) <= _MAX_TOKEN_CHARS]


def _refusal(start_response: Callable[..., Any], status: str, detail: str) -> list[bytes]:
    headers = [("Content-Type", "application/json")]
    if status.startswith("401"):
        headers.append(("WWW-Authenticate", 'Bearer realm="arceus-agent-metrics"'))
    start_response(status, headers)
    return [json.dumps({"detail": detail}).encode()]


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_SCRAPES at once: a connection beyond them is closed unread."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self._stopping = False
        self._wake_reader, self._wake_writer = socket.socketpair()

    def serve_until_stopped(self) -> None:
        """Accept scrapes until `stop`. The thread sleeps until a connection or `stop` arrives: serve_forever's
        poll (every 0.05 s, for a quick shutdown) woke every agent 20 times a second, most of an idle agent's CPU."""
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while not self._stopping:
                if any(key.fileobj is self for key, _ in selector.select()) and not self._stopping:
                    self._handle_request_noblock()

    def stop(self) -> None:
        """End `serve_until_stopped` now (its thread returns after the scrape it is accepting, if any)."""
        self._stopping = True
        self._wake_writer.send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        self._wake_reader.close()
        self._wake_writer.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that stalled or left is not news; a bug is
            super().handle_error(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS  # a connection that sends no request in time is closed

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is not news
