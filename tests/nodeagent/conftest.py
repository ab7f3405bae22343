"""A stand-in for the control plane's agent API (the Django app is another package), speaking the
HTTP/JSON contract of docs/architecture.md so the agent's client can be tested against real HTTP; an agent in
this process; the one-stage assignment the agent tests host."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from arceus.contracts.possession import possession_check
from devtools.pipeline import pipeline_assignments

# One stage of a two-layer MLP, as the control plane would assign it.
ASSIGNMENT = pipeline_assignments(
    job_id="job",
    model_config={"layer_sizes": [8, 4]},
    boundaries=[0, 1],
    addresses=["127.0.0.1:1"],
    optimizer={"name": "sgd", "lr": 0.1},
    seed=0,
    micro_batches=2,
    max_micro_batch_size=4,
)[0]


@dataclass
class FakeControlPlane:
    url: str = ""
    token: str = "good-token"
    interval: float = 0.5
    assignments: list[Any] = field(default_factory=list)
    max_threads: int | None = None  # the owner's cap, sent in every heartbeat reply
    scrape_digest: str | None = None  # what the agent's /metrics must be shown the preimage of, in every reply
    step_grants: dict[str, int] = field(default_factory=dict)  # job id → its last train step, in every reply
    # (status, raw body) to answer heartbeats with instead of the normal reply, while set
    heartbeat_override: tuple[int, bytes] | None = None
    requests: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    uploads: dict[str, bytes] = field(default_factory=dict)  # path -> body of each PUT
    failed_uploads: int = 0  # the next this many PUTs are read whole, then answered 500 (and not kept)
    # Set: the checkpoint storage is an S3 bucket, parts of this many bytes go to presigned URLs /bucket/<n>
    # (here: PUTs without the node token), which fail the next `failed_parts` times.
    part_bytes: int | None = None
    failed_parts: int = 0
    earnings: dict[str, Any] = field(default_factory=dict)  # what GET /api/agent/earnings answers
    downloads: dict[str, bytes] = field(default_factory=dict)  # path with its query -> what a GET of it answers
    challenges: list[str] = field(default_factory=list)  # issued to registering agents, newest last
    probe_seconds: float = 0.0  # how long it takes to answer a link probe (a busy web server's handling)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def heartbeats(self) -> list[Any]:
        with self.lock:
            return [body for path, _, body in self.requests if path == "/api/agent/heartbeat"]

    def handle(self, path: str, headers: dict[str, str], body: Any) -> tuple[int, bytes]:
        with self.lock:
            self.requests.append((path, headers, body))
            if headers.get("Authorization") != f"Node {self.token}":
                return 401, b'{"detail": "Invalid node token."}'
            if path == "/api/agent/challenge":
                self.challenges.append(secrets.token_urlsafe(16))
                reply = {"challenge": self.challenges[-1], "expires_in_seconds": 300}
            elif path == "/api/agent/register":
                try:  # as the control plane checks it
                    possession_check(body["tls_certificate"], self.challenges[-1], body["tls_proof"])
                except (ValueError, KeyError, IndexError) as exc:
                    return 400, json.dumps({"detail": f"tls_proof: {exc}"}).encode()
                reply = {"node_id": "node-1", "heartbeat_interval_seconds": self.interval}
            elif path == "/api/agent/heartbeat":
                if self.heartbeat_override is not None:
                    return self.heartbeat_override
                # As the control plane does: the assignments only when their version is not the one sent.
                version = hashlib.sha256(json.dumps(self.assignments).encode()).hexdigest()[:32]
                reply = {
                    "node_id": "node-1",
                    "assignments_version": version,
                    "heartbeat_interval_seconds": self.interval,
                    "controls": {"max_threads": self.max_threads},
                    "step_grants": self.step_grants,
                    "metrics_token_sha256": self.scrape_digest,
                }
                if not isinstance(body, dict) or body.get("assignments_version") != version:
                    reply["assignments"] = self.assignments
            elif path == "/api/agent/probe":
                reply = {"bytes": len(body)}
            elif path == "/api/agent/leave":  # the stages move once a test empties `assignments`
                reply = {"node_id": "node-1", "stages": len(self.assignments)}
            elif path.endswith("/parts") and self.part_bytes is None:  # no S3 bucket: the file is PUT to the upload
                reply = {"multipart_id": None}
            elif path.endswith("/parts"):
                parts = -(-body["size_bytes"] // self.part_bytes)
                urls = [f"{self.url}/bucket/{n}" for n in range(1, parts + 1)]
                reply = {"multipart_id": "m-1", "part_bytes": self.part_bytes, "part_urls": urls}
            elif path.endswith("/parts/complete"):
                reply = {"sha256": body["sha256"], "size_bytes": body["size_bytes"]}
            else:
                return 404, b"{}"
        return 200, json.dumps(reply).encode()


@pytest.fixture
def control_plane() -> Iterator[FakeControlPlane]:
    fake = FakeControlPlane()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            probe = self.path == "/api/agent/probe"  # filler bytes, not JSON
            if probe:
                time.sleep(fake.probe_seconds)
            status, body = fake.handle(self.path, dict(self.headers), raw if probe else json.loads(raw or b"null"))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            with fake.lock:
                fake.requests.append((self.path, dict(self.headers), None))
                authorized = self.headers.get("Authorization") == f"Node {fake.token}"
                download = fake.downloads.get(self.path)
                found = self.path == "/api/agent/earnings" or download is not None
                answer = download if download is not None else json.dumps(fake.earnings).encode()
                body = answer if authorized and found else b"{}"
            self.send_response(404 if not found else 200 if authorized else 401)
            self.send_header("Content-Type", "application/json" if download is None else "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))  # uploads always carry a length
            with fake.lock:
                fake.requests.append((self.path, dict(self.headers), None))
                authorized = self.headers.get("Authorization") == f"Node {fake.token}"
                if self.path.startswith("/bucket/"):  # a presigned URL: the signature is its authority
                    authorized = "Authorization" not in self.headers
                    failing = fake.failed_parts > 0
                    fake.failed_parts -= failing
                else:
                    failing = authorized and fake.failed_uploads > 0
                    fake.failed_uploads -= failing
                if authorized and not failing:
                    fake.uploads[self.path] = body
            self.send_response(500 if failing else 201 if authorized else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_DELETE(self) -> None:  # noqa: N802 - http.server's naming
            with fake.lock:
                fake.requests.append((self.path, dict(self.headers), None))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
