"""The agent's Prometheus metrics, in their own registry, served on /metrics.

Base units, no per-step or per-micro-batch labels; the only labels are the step mode and, on the
stage info metric, the stages hosted here (a handful per agent).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from nodeagent.device import memory_used_bytes

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self.stage_assigned = Gauge("arceus_stage_assigned", "Number of stages this agent hosts.", registry=r)
        self.stage_info = Gauge(
            "arceus_stage_info", "1 for each stage this agent hosts.", ["job_id", "stage_index"], registry=r
        )
        self.heartbeat_age = Gauge(
            "arceus_heartbeat_age_seconds",
            "Seconds since the last successful heartbeat (NaN before the first, and in static mode).",
            registry=r,
        )
        self._last_heartbeat: float | None = None
        self.heartbeat_age.set_function(self._heartbeat_age)
        self._server: _MetricsServer | None = None

    def heartbeat_succeeded(self) -> None:
        self._last_heartbeat = time.monotonic()

    def _heartbeat_age(self) -> float:
        return math.nan if self._last_heartbeat is None else time.monotonic() - self._last_heartbeat

    def set_stages(self, stages: Iterable[tuple[str, int]]) -> None:
        """The (job_id, stage_index) pairs hosted now."""
        stages = list(stages)
        self.stage_info.clear()
        for job_id, stage_index in stages:
            self.stage_info.labels(job_id=job_id, stage_index=str(stage_index)).set(1)
        self.stage_assigned.set(len(stages))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server in a daemon thread; returns the port it listens on."""
        _MetricsServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = make_server(
            host.strip("[]"), port, make_wsgi_app(self.registry), _MetricsServer, handler_class=_QuietHandler
        )
        # A short poll interval makes shutdown quick (the default waits up to half a second).
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics", daemon=True
        ).start()
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is not news
