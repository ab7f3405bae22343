"""The agent's side of the control-plane contract (docs/architecture.md): register, then heartbeat.

Each heartbeat reports the stages' observed states and receives the whole desired state back, which a
thread of its own applies (building a large stage must not stop the heartbeats that keep the node's
lease); after a change the agent heartbeats again at once so the control plane learns about readiness
quickly. Errors back off; only a rejected token (401) is fatal.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

import requests

from arceus.checkpoint import StateFile
from arceus.contracts.assignment import Assignment, CheckpointRef, InitialWeightsRef
from arceus.contracts.data_plane import SPOKEN
from arceus.contracts.observed import ObservedStage
from arceus.contracts.possession import possession_sign
from arceus.data.upload_rows import MAX_READ_BYTES
from arceus.errors import SpecError
from arceus.model.exported.program import MAX_PROGRAM_BYTES
from arceus.model.hugging_face import initial_weights_slice_check
from arceus.safetensors_file import CHUNK_BYTES
from arceus.wire.tls import TlsIdentity
from nodeagent.control_plane_http import ControlPlaneError, ControlPlaneSession, Unauthorized
from nodeagent.host_load import HostLoad
from nodeagent.link_probe import DELAY_BUDGET_SECONDS, least_delay
from nodeagent.stage import DatasetReadError, StateUploadError

log = logging.getLogger(__name__)
# A state upload the server failed is sent again after 1, 2, 4 s (its deadline permitting); a direct upload whose
# part failed every attempt is resumed up to this many times (its deadline permitting), sending only what the storage
# lacks.
UPLOAD_ATTEMPTS = 4
UPLOAD_RETRY_SECONDS = 1.0
UPLOAD_RESUMES = 3


@dataclass(frozen=True)
class Registration:
    node_id: str
    heartbeat_interval_seconds: float


@dataclass(frozen=True)
class HeartbeatReply:
    node_id: str
    heartbeat_interval_seconds: float
    assignments: list[Assignment]
    rejected: list[ObservedStage] = field(default_factory=list)  # listed but unparseable
    max_threads: int | None = None  # the owner's cap on compute threads (None: no cap)
    max_memory_bytes: int | None = None  # the owner's memory budget for this node's stages (None: no cap)
    relay: dict[str, str] | None = None  # {"address", "ticket"}: the relay to attach to (None: dialled directly)
    relays: tuple[str, ...] = ()  # every relay, for calls to relayed neighbours
    relay_certificate: str = ""  # the relays' certificate (PEM), pinned by the attachment and those calls
    metrics_token_sha256: str | None = None  # what a scrape of /metrics must present the preimage of (None: none)
    step_grants: dict[str, int] = field(default_factory=dict)  # job id → the last train step it may run


class ControlPlaneClient(ControlPlaneSession):
    def __init__(self, url: str, token: str, *, timeout: float = 10.0) -> None:
        super().__init__(url, token, timeout=timeout)
        # The assignments of the last heartbeat answer and their version: sent back, so an unchanged desired
        # state is answered without its assignments (the control plane need not build them).
        self._held: tuple[str, list[Assignment], list[ObservedStage]] | None = None

    def register(
        self,
        grpc_address: str,
        capabilities: dict[str, Any],
        public_key: str,
        identity: TlsIdentity,
        metrics_port: int | None = None,
        lan_address: str | None = None,
        exchange_port: int | None = None,
        exchange_address: str | None = None,
    ) -> Registration:
        """`public_key`: what its receipts verify against; `identity`: the TLS key and the certificate its callers
        pin, which it proves it holds by signing the control plane's challenge; `metrics_port`: where Prometheus
        scrapes this agent, on the host of `grpc_address`; `lan_address`: where agents on its LAN dial it
        (nodeagent/lan.py); `exchange_port`: its replicas' exchange listener's, on the host of `grpc_address` unless
        `exchange_address` (advertised: a router's port forward to that listener) says where siblings dial it."""
        self._held = None  # a registration starts afresh: the next heartbeat asks for the whole desired state
        challenge = self._post("/api/agent/challenge", {}).get("challenge")
        if not isinstance(challenge, str) or not challenge:
            raise ControlPlaneError(f"the control plane answered no challenge to sign: {challenge!r}")
        payload: dict[str, Any] = {
            "grpc_address": grpc_address,
            "capabilities": capabilities,
            "public_key": public_key,
            "tls_certificate": identity.certificate,
            "challenge": challenge,
            "tls_proof": possession_sign(identity.key_pem, challenge, identity.certificate),
            "data_plane": list(SPOKEN),  # which links may take a neighbour stream (arceus.contracts.data_plane)
        }
        if metrics_port is not None:
            payload["metrics_port"] = metrics_port
        if lan_address is not None:
            payload["lan_address"] = lan_address
        if exchange_port is not None:
            payload["exchange_port"] = exchange_port
        if exchange_address is not None:
            payload["exchange_address"] = exchange_address
        body = self._post("/api/agent/register", payload)
        return Registration(node_id=_node_id(body), heartbeat_interval_seconds=_interval(body))

    def heartbeat(
        self,
        observed: list[dict[str, Any]],
        host_busy_fraction: float | None = None,
        link: dict[str, float] | None = None,
        neighbour_links: list[dict[str, Any]] | None = None,
        relay: dict[str, Any] | None = None,
    ) -> HeartbeatReply:
        payload: dict[str, Any] = {"observed": observed, "host_busy_fraction": host_busy_fraction, "relay": relay}
        if link is not None:
            payload["link"] = link
        if neighbour_links:
            payload["neighbour_links"] = neighbour_links
        if self._held is not None:
            payload["assignments_version"] = self._held[0]
        body = self._post("/api/agent/heartbeat", payload)
        version = body.get("assignments_version")
        if "assignments" not in body and self._held is not None and version == self._held[0]:
            _, assignments, rejected = self._held  # unchanged since the last answer
        else:
            assignments, rejected = _parse_assignments(body)
            self._held = (version, assignments, rejected) if isinstance(version, str) and version else None
        return HeartbeatReply(
            node_id=_node_id(body),
            heartbeat_interval_seconds=_interval(body),
            assignments=assignments,
            rejected=rejected,
            max_threads=_control(body, "max_threads"),
            max_memory_bytes=_control(body, "max_memory_bytes"),
            relay=_relay(body),
            relays=tuple(r for r in body.get("relays") or () if isinstance(r, str)),
            relay_certificate=_relay_certificate(body),
            metrics_token_sha256=_metrics_token_sha256(body),
            step_grants=_step_grants(body),
        )

    def leave(self) -> int:
        """Say this agent is shutting down (its node drains); returns how many stages it still hosts."""
        stages = self._post("/api/agent/leave", {}).get("stages")
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 0:
            raise ControlPlaneError(f"leave response has no 'stages' count: {stages!r}")
        return stages

    def probe(self, payload: bytes) -> float:
        """Seconds for the control plane to receive `payload` and answer (POST /api/agent/probe)."""
        url = f"{self.url}/api/agent/probe"
        started = time.perf_counter()
        try:
            response = self._session.post(
                url, data=payload, headers={"Content-Type": "application/octet-stream"}, timeout=self.timeout
            )
        except requests.RequestException as exc:
            raise ControlPlaneError(f"POST {url} failed: {exc}") from exc
        elapsed = time.perf_counter() - started
        if response.status_code >= 300:
            raise ControlPlaneError(f"POST {url} → HTTP {response.status_code}: {response.text[:200]}")
        return elapsed

    def handshake(self) -> float:
        """Seconds for a TCP handshake with the control plane's host (its name resolved first, untimed): the
        network's round trip alone, which the hosts' kernels answer without the web server taking a request."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ControlPlaneError(f"could not resolve {parts.hostname}: {exc}") from exc
        failure: OSError | None = None
        for family, kind, proto, _, address in addresses:  # as a connection tries them: the first that answers
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(self.timeout)
                started = time.perf_counter()
                try:
                    sock.connect(address)
                except OSError as exc:
                    failure = exc
                    continue
                return time.perf_counter() - started
        raise ControlPlaneError(f"TCP handshake with {parts.hostname}:{port} failed: {failure}")

    def fetch_checkpoint(self, ref: CheckpointRef) -> StateFile:
        """Download a stage checkpoint named by an assignment into a temporary file, a chunk at a time, and
        check it against its hash; its tensors then load one at a time."""
        with tempfile.NamedTemporaryFile(prefix="arceus-checkpoint-", suffix=".safetensors") as file:
            self._download(ref.url, file)
            # Open (and map) it before the file goes: its tensors stay readable until the state is dropped.
            return StateFile(Path(file.name), sha256=ref.sha256)

    def fetch_initial_weights(self, ref: InitialWeightsRef, start: int, end: int, max_bytes: int) -> StateFile:
        """Layers [start, end) of a job's uploaded weights (only those: the control plane cuts them from the
        upload) into a temporary file of at most `max_bytes`, a chunk at a time; each layer is checked against
        its digest in `ref` before a tensor of it loads. CheckpointError for a slice that is not those layers."""
        with tempfile.NamedTemporaryFile(prefix="arceus-initial-weights-", suffix=".safetensors") as file:
            size = self._download(ref.url, file, params={"start": start, "end": end}, max_bytes=max_bytes)
            initial_weights_slice_check(file, size, start, ref.layer_sha256)
            log.info("fetched layers [%d, %d) of the initial weights: %d bytes, each layer checked", start, end, size)
            return StateFile(Path(file.name))

    def _download(
        self, path: str, file: BinaryIO, *, params: dict[str, Any] | None = None, max_bytes: int | None = None
    ) -> int:
        """GET `path` on this control plane (the node token never goes to another host) into `file`, a chunk at a
        time, refusing more than `max_bytes`; the bytes written. A file the control plane answers from an S3 bucket
        (a 307 to a presigned URL) is fetched from there, resumed where a transfer broke off (`_download_ranged`)."""
        if not path.startswith("/"):
            raise ControlPlaneError(f"download path {path!r} is not a path on the control plane")
        url = f"{self.url}{path}"
        try:
            response = self._session.get(url, params=params, timeout=self.timeout, stream=True, allow_redirects=False)
            if response.is_redirect:
                # Stored in an S3 bucket: the control plane answers a presigned URL, fetched without the node token.
                response.close()
                written = _download_ranged(response.headers["Location"], file, max_bytes, self.timeout)
            else:
                with response:
                    written = _write_body(url, response, file, 0, max_bytes)
        except requests.RequestException as exc:
            raise ControlPlaneError(f"GET {url} failed: {exc}") from exc
        file.flush()
        return written

    def fetch_program(self, path: str, start: int, end: int) -> list[str]:
        """Layers [start, end)'s documents of an exported model's program at `path` on this control plane (the
        node token never goes to another host), read up to the largest program there may be."""
        if not path.startswith("/"):
            raise ControlPlaneError(f"program path {path!r} is not a path on the control plane")
        url = f"{self.url}{path}"
        try:
            with self._session.get(
                url, params={"start": start, "end": end}, timeout=self.timeout, stream=True
            ) as response:
                if response.status_code >= 300:
                    raise ControlPlaneError(f"GET {url} → HTTP {response.status_code}: {response.text[:500]}")
                body = response.raw.read(MAX_PROGRAM_BYTES + 1, decode_content=True)
        except requests.RequestException as exc:
            raise ControlPlaneError(f"GET {url} failed: {exc}") from exc
        if len(body) > MAX_PROGRAM_BYTES:
            raise ControlPlaneError(f"GET {url} answered more than the {MAX_PROGRAM_BYTES} bytes a program may hold")
        layers = json.loads(body).get("layers")
        if not isinstance(layers, list) or len(layers) != end - start or not all(isinstance(x, str) for x in layers):
            raise ControlPlaneError(f"GET {url} did not answer the {end - start} layers [{start}, {end})")
        return layers

    def read_dataset_ranges(self, job_id: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges of job `job_id`'s uploaded dataset (a stage's rows: nodeagent/step_samples.py), each range's
        bytes: answered by the control plane, or fetched from the S3 bucket by the presigned ranged GETs it answers
        (without the node token). At most MAX_READ_BYTES in all; DatasetReadError for anything else."""
        total = sum(stop - start for start, stop in ranges)
        if total > MAX_READ_BYTES:
            raise DatasetReadError(f"{total} bytes is more than the {MAX_READ_BYTES} one read may take")
        url = f"{self.url}/api/agent/jobs/{job_id}/dataset-reads"
        try:
            with self._session.post(url, json={"ranges": [list(r) for r in ranges]}, timeout=self.timeout,
                                    stream=True) as response:
                if response.status_code >= 300:
                    raise DatasetReadError(f"POST {url} → HTTP {response.status_code}: {_text(response)}")
                if response.headers.get("Content-Type", "").startswith("application/json"):
                    urls = json.loads(response.raw.read(1 << 20, decode_content=True)).get("urls")
                    if not isinstance(urls, list) or len(urls) != len(ranges):
                        raise DatasetReadError(f"POST {url} answered no presigned URL per range")
                    return [self._read_presigned(u, start, stop) for u, (start, stop) in zip(urls, ranges, strict=True)]
                body = response.raw.read(total + 1, decode_content=True)
        except (requests.RequestException, ValueError) as exc:
            raise DatasetReadError(f"POST {url} failed: {exc}") from exc
        if len(body) != total:
            raise DatasetReadError(f"POST {url} answered {len(body)} bytes for ranges of {total}")
        offsets = [0, *itertools.accumulate(stop - start for start, stop in ranges)]
        return [body[a:b] for a, b in itertools.pairwise(offsets)]

    def _read_presigned(self, url: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a stored object by its presigned ranged GET; DatasetReadError unless exactly those."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise DatasetReadError("the control plane answered a presigned URL that is not HTTP(S)")
        with requests.get(url, headers={"Range": f"bytes={start}-{stop - 1}"}, timeout=self.timeout,
                          stream=True) as response:
            if response.status_code != 206 or not response.headers.get("Content-Range", "").startswith(
                f"bytes {start}-{stop - 1}/"
            ):
                raise DatasetReadError(f"the stored dataset's range [{start}, {stop}) → HTTP {response.status_code} "
                                       f"({response.headers.get('Content-Range', 'no Content-Range')})")
            return response.raw.read(stop - start + 1, decode_content=True)

    def upload_state(
        self, path: str, size: int, chunks: Callable[[], Iterable[bytes | memoryview]], seconds: float
    ) -> str:
        """Upload a stage's state file (`size` bytes, as `chunks()`) for the checkpoint upload at `path` on this
        control plane, while `seconds` last; the SHA-256 (hex) of the bytes sent. With an S3 bucket behind the
        control plane the file goes straight there, a part at a time (`_upload_direct`); an attempt interrupted (a
        part that failed every retry) is resumed while time is left: the control plane answers which parts the
        bucket holds and only the others are sent. Otherwise the file is PUT to `path`, streamed. Only paths on
        this control plane: the node token never goes to another host. Raises StateUploadError."""
        if not path.startswith("/"):
            raise StateUploadError(f"upload path {path!r} is not a path on the control plane")
        url = f"{self.url}{path}"
        deadline = time.monotonic() + seconds
        for attempt in range(1, UPLOAD_RESUMES + 2):
            response = _retried(
                f"POST {url}/parts",
                lambda remaining: self._session.post(
                    f"{url}/parts", json={"size_bytes": size}, timeout=(self.timeout, remaining)
                ),
                deadline,
            )
            if response.status_code >= 300:
                raise StateUploadError(f"POST {url}/parts → HTTP {response.status_code}: {_text(response)}")
            started = response.json()
            if started.get("multipart_id") is None:
                return self._upload_through(url, size, chunks, deadline)
            try:
                return self._upload_direct(url, size, chunks(), started, deadline)
            except _PartsInterrupted as exc:
                if attempt > UPLOAD_RESUMES or time.monotonic() + UPLOAD_RETRY_SECONDS >= deadline:
                    raise StateUploadError(
                        f"{exc}; multipart upload {started['multipart_id']} is left for a resume (the control "
                        "plane aborts it if the upload is withdrawn)"
                    ) from None
                log.warning("%s; resuming the upload: the parts the storage holds are not sent again", exc)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _upload_through(
        self, url: str, size: int, chunks: Callable[[], Iterable[bytes | memoryview]], deadline: float
    ) -> str:
        """PUT the file to the control plane, streamed: the agent holds one chunk of it at a time. An attempt the
        server failed (a 5xx: its database restarting under it) or that lost its connection is sent again, afresh:
        the upload stays open until one arrives whole."""
        digests: list[Any] = []  # one per attempt: the last one's was sent

        def hashed() -> Iterator[bytes | memoryview]:
            digests.append(digest := hashlib.sha256())
            for chunk in chunks():
                digest.update(chunk)
                yield chunk

        sent = 0

        def put(remaining: float) -> requests.Response:
            nonlocal sent
            sent += 1
            return self._session.put(
                url, data=_ChunkReader(size, hashed()), headers={"Content-Type": "application/octet-stream"},
                timeout=(self.timeout, remaining),
            )

        response = _retried(f"PUT {url}", put, deadline)
        if response.status_code >= 300 and not (
            sent > 1 and response.status_code == 409 and "already received" in response.text
        ):  # an earlier attempt arrived after all; the driver checks its hash against ours
            raise StateUploadError(f"PUT {url} → HTTP {response.status_code}: {_text(response)}")
        return digests[-1].hexdigest()

    def _upload_direct(
        self, url: str, size: int, chunks: Iterable[bytes | memoryview], started: dict[str, Any], deadline: float
    ) -> str:
        """PUT the file's parts to the presigned URLs the control plane answered (`started`), one part in memory at
        a time, each sent again while it fails (with its MD5, which the storage checks); a part the storage already
        holds (`started["stored_parts"]`: a resumed upload) is skipped when its size and ETag are this part's, sent
        again otherwise. Then ask the control plane to complete the upload. _PartsInterrupted when a part or the
        completion failed every retry: the multipart upload stays open for a resume. On any other failure (the state
        itself could not be read) it is aborted: no parts are left in the bucket."""
        multipart_id, part_bytes, urls = started["multipart_id"], int(started["part_bytes"]), started["part_urls"]
        stored = {int(p["number"]): p for p in started.get("stored_parts") or []}
        digest = hashlib.sha256()
        reader = _ChunkReader(size, chunks)
        bucket = requests.Session()  # no node token: these requests go to the storage
        sent = 0
        try:
            for number, part_url in enumerate(urls, start=1):
                part = reader.read_exact(min(part_bytes, size - (number - 1) * part_bytes))
                digest.update(part)
                md5 = hashlib.md5(part, usedforsecurity=False)
                held = stored.get(number)
                if held is not None and int(held["size_bytes"]) == len(part) and (
                    str(held["etag"]).strip('"') == md5.hexdigest()
                ):
                    continue
                headers = {"Content-MD5": base64.b64encode(md5.digest()).decode()}
                response = _retried(
                    f"PUT part {number} of {len(urls)}",
                    lambda remaining, u=part_url, p=part, h=headers: bucket.put(
                        u, data=p, headers=h, timeout=(self.timeout, remaining)
                    ),
                    deadline,
                    failure=_PartsInterrupted,
                )
                if response.status_code >= 300:
                    raise _PartsInterrupted(
                        f"PUT part {number} of {len(urls)} → HTTP {response.status_code}: {_text(response)}"
                    )
                sent += len(part)
            sha256 = digest.hexdigest()
            body = {"multipart_id": multipart_id, "sha256": sha256, "size_bytes": size}
            response = _retried(
                f"POST {url}/parts/complete",
                lambda remaining: self._session.post(
                    f"{url}/parts/complete", json=body, timeout=(self.timeout, remaining)
                ),
                deadline,
                failure=_PartsInterrupted,
            )
            if response.status_code == 409 and "lacks parts" in response.text:
                raise _PartsInterrupted(f"POST {url}/parts/complete → {_text(response)}")
            if response.status_code >= 300 and "already received" not in response.text:
                raise StateUploadError(f"POST {url}/parts/complete → HTTP {response.status_code}: {_text(response)}")
        except StateUploadError:  # interrupted (resumable), or refused: completed and dropped, or withdrawn and aborted
            raise
        except BaseException:
            try:
                self._session.delete(f"{url}/parts", params={"multipart_id": multipart_id}, timeout=self.timeout)
            except requests.RequestException as exc:  # the control plane aborts it when it withdraws the upload
                log.warning("could not abort multipart upload %s: %s", multipart_id, exc)
            raise
        finally:
            bucket.close()
        log.info("sent %d of %d bytes in %d parts straight to the checkpoint storage (the rest it held already)",
                 sent, size, len(urls))
        return sha256


def _retried(
    what: str, send: Callable[[float], requests.Response], deadline: float,
    failure: type[StateUploadError] = StateUploadError,
) -> requests.Response:
    """`send(seconds left)`'s first answer below 500; an answer of 500 or more (the server failing: its database
    restarting under it) or a lost connection is sent again after 1, 2, 4 s while `deadline` allows. Raises
    `failure` (a StateUploadError) once it gave up."""
    attempt = 0
    while True:
        try:
            response = send(max(1.0, deadline - time.monotonic()))
        except requests.RequestException as exc:
            failed = f"{what} failed: {exc}"
        else:
            if response.status_code < 500:
                return response
            failed = f"{what} → HTTP {response.status_code}: {_text(response)}"
        pause = UPLOAD_RETRY_SECONDS * 2**attempt
        if time.monotonic() + pause >= deadline or attempt + 1 >= UPLOAD_ATTEMPTS:
            raise failure(f"{failed} (attempt {attempt + 1})")
        log.warning("%s; sending it again in %.0f s", failed, pause)
        time.sleep(pause)
        attempt += 1


def _download_ranged(url: str, file: BinaryIO, max_bytes: int | None, timeout: float) -> int:
    """GET `url` (a presigned storage URL) into `file`; the bytes written. A transfer that breaks off is resumed from
    the last byte written, by a ranged GET of the same object (If-Match its ETag: one replaced meanwhile is refused,
    never spliced), after 1, 2, 4 s, while bytes keep arriving; the caller checks the whole file's digest."""
    origin, written, etag, failures = file.tell(), 0, None, 0
    while True:
        headers = {} if etag is None else {"Range": f"bytes={written}-", "If-Match": etag}
        try:
            with requests.get(url, headers=headers, timeout=timeout, stream=True) as response:
                if etag is None:
                    if response.status_code >= 300:
                        raise ControlPlaneError(f"GET the stored file → HTTP {response.status_code}: {_text(response)}")
                    etag = response.headers.get("ETag")
                elif response.status_code != 206 or not response.headers.get("Content-Range", "").startswith(
                    f"bytes {written}-"
                ):
                    raise ControlPlaneError(
                        f"resuming the stored file at byte {written} → HTTP {response.status_code} "
                        f"({response.headers.get('Content-Range', 'no Content-Range')}): {_text(response)}"
                    )
                before = written
                try:
                    return _write_body("the stored file", response, file, written, max_bytes)
                finally:
                    written = file.tell() - origin
                    failures = 0 if written > before else failures
        except requests.RequestException as exc:
            if etag is None or failures + 1 >= UPLOAD_ATTEMPTS:
                raise
            pause = UPLOAD_RETRY_SECONDS * 2**failures
            log.warning("the download of a stored file broke off at byte %d (%s); resuming it in %.0f s",
                        written, exc, pause)
            time.sleep(pause)
            failures += 1


def _write_body(what: str, response: requests.Response, file: BinaryIO, written: int, max_bytes: int | None) -> int:
    """Write `response`'s body to `file` after its first `written` bytes, refusing more than `max_bytes` in all; the
    bytes written in all."""
    if response.status_code >= 300:
        raise ControlPlaneError(f"GET {what} → HTTP {response.status_code}: {_text(response)}")
    for chunk in response.iter_content(chunk_size=CHUNK_BYTES):
        written += len(chunk)
        if max_bytes is not None and written > max_bytes:
            raise ControlPlaneError(f"GET {what} answered more than the {max_bytes} bytes expected")
        file.write(chunk)
    return written


class _PartsInterrupted(StateUploadError):
    """A direct upload stopped short of completing (a part, or its completion, failed every retry); its multipart
    upload stays open, so a resume sends only the parts the storage lacks."""


def _text(response: requests.Response) -> str:
    return " ".join(response.text[:500].split())


def _parse_assignments(body: dict[str, Any]) -> tuple[list[Assignment], list[ObservedStage]]:
    """A heartbeat answer's assignments, and a failed report for each listed one that cannot be parsed."""
    raw = body.get("assignments")
    if not isinstance(raw, list):
        # Never read a missing list as "host nothing": that would drop every stage.
        raise ControlPlaneError(f"heartbeat response has no 'assignments' list: {_short(body)}")
    assignments, rejected = [], []
    for index, item in enumerate(raw):
        try:
            assignments.append(Assignment.from_json(item))
        except SpecError as exc:
            stage_id = item.get("stage_id") if isinstance(item, dict) else None
            generation = item.get("generation") if isinstance(item, dict) else None
            log.error("assignment %d of the heartbeat response is invalid: %s", index, exc)
            rejected.append(
                ObservedStage(
                    stage_id=stage_id if isinstance(stage_id, str) else f"<assignment {index}>",
                    generation=generation if isinstance(generation, int) else 0,
                    state="failed",
                    message=f"invalid assignment: {exc}",
                )
            )
    return assignments, rejected


def _control(body: dict[str, Any], name: str) -> int | None:
    """One of the owner's caps in a heartbeat answer: a positive integer, or null for none."""
    controls = body.get("controls")
    value = controls.get(name) if isinstance(controls, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ControlPlaneError(f"heartbeat response has an invalid controls.{name}: {value!r}")
    return value


class _ChunkReader:
    """A file-like view of a stream of chunks with a known total size: requests sends it with a
    Content-Length, reading it a block at a time."""

    def __init__(self, size: int, chunks: Iterable[bytes | memoryview]) -> None:
        self._size = size
        self._chunks = iter(chunks)
        self._pending = memoryview(b"")

    def __len__(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._pending = memoryview(chunk).cast("B")
        n = len(self._pending) if n is None or n < 0 else n
        out, self._pending = self._pending[:n], self._pending[n:]
        return out.tobytes()

    def read_exact(self, n: int) -> bytes:
        """The next `n` bytes (fewer only at the end)."""
        pieces, left = [], n
        while left and (piece := self.read(left)):
            pieces.append(piece)
            left -= len(piece)
        return b"".join(pieces)


def _relay(body: dict[str, Any]) -> dict[str, str] | None:
    relay = body.get("relay")
    if relay is None:
        return None
    if not (isinstance(relay, dict) and isinstance(relay.get("address"), str) and isinstance(relay.get("ticket"), str)):
        raise ControlPlaneError(f"heartbeat response's 'relay' is not {{address, ticket}}: {_short(body)}")
    return {"address": relay["address"], "ticket": relay["ticket"]}


def _relay_certificate(body: dict[str, Any]) -> str:
    certificate = body.get("relay_certificate") or ""
    if not isinstance(certificate, str):
        raise ControlPlaneError(f"heartbeat response's 'relay_certificate' is not a PEM string: {_short(body)}")
    return certificate


def _metrics_token_sha256(body: dict[str, Any]) -> str | None:
    digest = body.get("metrics_token_sha256")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise ControlPlaneError(f"heartbeat response's 'metrics_token_sha256' is not a SHA-256: {_short(body)}")
    return digest


def _step_grants(body: dict[str, Any]) -> dict[str, int]:
    grants = body.get("step_grants")
    if not isinstance(grants, dict) or not all(
        isinstance(job, str) and isinstance(step, int) and not isinstance(step, bool) and step >= 0
        for job, step in grants.items()
    ):
        raise ControlPlaneError(f"heartbeat response has no usable 'step_grants': {_short(body)}")
    return grants


def _node_id(body: dict[str, Any]) -> str:
    node_id = body.get("node_id")
    if not isinstance(node_id, str | int) or isinstance(node_id, bool) or node_id == "":
        raise ControlPlaneError(f"response has no usable node_id: {_short(body)}")
    return str(node_id)


def _interval(body: dict[str, Any]) -> float:
    value = body.get("heartbeat_interval_seconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise ControlPlaneError(f"response has no usable heartbeat_interval_seconds: {_short(body)}")
    return float(value)


def _short(body: Any) -> str:
    text = repr(body)
    return text if len(text) <= 300 else text[:300] + "..."


PROBE_BYTES = 256 * 1024
# The link is re-measured this often and sent with the next heartbeat (Wi-Fi, VPNs and traffic change it); the
# first time sooner after registering, which measured it while the agent started (often beside others on its host).
REMEASURE_SECONDS = 300.0
FIRST_REMEASURE_SECONDS = 30.0


def measure_link(
    client: ControlPlaneClient, rounds: int = 3, budget: float = DELAY_BUDGET_SECONDS
) -> dict[str, float] | None:
    """{"rtt_seconds", "bandwidth_bytes_per_second"} to the control plane. The round trip: the least of several TCP
    handshakes begun within `budget` seconds (`nodeagent.link_probe.least_delay`), the network's alone. An empty
    probe's would also count the web server's handling of a request (ms when idle, more when busy), which every
    round pays, so no least-of-N removes it, and which replicas exchanging with each other never pay: placement
    charged it to each replica's exchange and refused replicas worth adding. The bandwidth: PROBE_BYTES over the
    best of `rounds` uploads less the best of `rounds` empty probes (the same request's handling). None (logged) if
    probing fails."""
    try:
        rtt = least_delay(client.handshake, budget=budget)
        handled = min(client.probe(b"") for _ in range(rounds))
        upload = min(client.probe(bytes(PROBE_BYTES)) for _ in range(rounds))
    except ControlPlaneError as exc:
        log.warning("could not measure the link to the control plane: %s", exc)
        return None
    return {"rtt_seconds": rtt, "bandwidth_bytes_per_second": PROBE_BYTES / max(upload - handled, 1e-6)}


class HeartbeatAgent(Protocol):
    """The agent as the heartbeat loop sees it (nodeagent.agent.Agent is one): what each heartbeat reports, and
    the few things an answer tells it."""

    def observed(self) -> list[dict[str, Any]]:
        """Each assigned stage's state (arceus.contracts.observed)."""

    def take_neighbour_links(self) -> list[dict[str, Any]]:
        """The links to pipeline neighbours measured since the last call."""

    def relay_report(self) -> dict[str, Any] | None:
        """Where the agent is attached for relayed callers (None: not yet serving)."""

    def heartbeat_answered(self, *, metrics_token_sha256: str | None) -> None:
        """The control plane answered a heartbeat (the lease is renewed), naming the digest of the token a scrape
        of /metrics must present (None: no scrapes)."""

    def follow_relay(self, relay: dict[str, str] | None, relays: Sequence[str], certificate: str) -> None:
        """The relay to attach to, and every relay (and their certificate) to reach relayed neighbours by."""

    def take_caps(self, *, max_threads: int | None, max_memory_bytes: int | None) -> None:
        """The owner's caps on compute threads and on the memory of the stages (None: no cap)."""

    def take_step_grants(self, grants: dict[str, int]) -> None:
        """The last train step each job may run (nodeagent/step_grants.py)."""

    def ask_heartbeats_with(self, beat: Callable[[], None]) -> None:
        """How a step waiting for its grant asks for a heartbeat now."""

    def apply_assignments(self, assignments: list[Assignment], rejected: Sequence[ObservedStage] = ()) -> bool:
        """Host the desired state (the whole of it); whether anything changed."""


class HeartbeatLoop:
    """A daemon thread: heartbeat every interval, back off on errors; another applies each answer's desired
    state, so a stage that takes long to build (a large checkpoint to download and load) never holds back the
    heartbeats that keep the node's lease: the node would look dead and its stages move.

    `on_fatal(message)` is called once, from the thread, if the token is rejected; the loop then ends.
    `on_reply(reply)`, if given, is called from the thread after each heartbeat the control plane answered.
    """

    def __init__(
        self,
        client: ControlPlaneClient,
        agent: HeartbeatAgent,
        *,
        interval: float,
        on_fatal: Callable[[str], None],
        on_reply: Callable[[HeartbeatReply], None] | None = None,
        min_backoff: float = 1.0,
        max_backoff: float = 30.0,
    ) -> None:
        self._client = client
        self._on_reply = on_reply
        self._agent = agent
        self._interval = interval
        self._on_fatal = on_fatal
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._applier = threading.Thread(target=self._apply, name="apply-assignments", daemon=True)
        self._desired_lock = threading.Lock()
        self._desired: tuple[list[Assignment], list[ObservedStage]] | None = None  # the newest answer, unapplied
        self._desired_ready = threading.Event()
        self._applied_change = threading.Event()  # the applier changed the stages: report them at once
        self._host_load = HostLoad()
        self._link_measured = time.monotonic() - REMEASURE_SECONDS + FIRST_REMEASURE_SECONDS
        self._unsent_links: dict[str, dict[str, Any]] = {}  # neighbour figures kept until a heartbeat succeeds
        agent.ask_heartbeats_with(self.beat_now)

    def beat_now(self) -> None:
        """Heartbeat at once (a step waits for its grant to be extended), as after a change: not twice in a row."""
        self._applied_change.set()

    def start(self) -> None:
        self._applier.start()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._desired_ready.set()
        self._applied_change.set()
        self._thread.join(timeout)
        self._applier.join(timeout)

    def _run(self) -> None:
        backoff = self._min_backoff
        resent = False
        while not self._stop.is_set():
            try:
                link = None
                if time.monotonic() - self._link_measured >= REMEASURE_SECONDS:
                    # Within half an interval: the heartbeat after it must come before the node's lease runs out.
                    link = measure_link(self._client, budget=self._interval / 2)
                    self._link_measured = time.monotonic()
                self._unsent_links.update((f["address"], f) for f in self._agent.take_neighbour_links())
                reply = self._client.heartbeat(
                    self._agent.observed(),
                    self._host_load.others_busy_fraction(),
                    link,
                    list(self._unsent_links.values()),
                    self._agent.relay_report(),
                )
                self._unsent_links = {}
                self._agent.follow_relay(reply.relay, reply.relays, reply.relay_certificate)
                self._agent.heartbeat_answered(metrics_token_sha256=reply.metrics_token_sha256)
                self._agent.take_caps(max_threads=reply.max_threads, max_memory_bytes=reply.max_memory_bytes)
                self._interval = reply.heartbeat_interval_seconds
                self._agent.take_step_grants(reply.step_grants)
                backoff = self._min_backoff
                with self._desired_lock:
                    self._desired = (reply.assignments, reply.rejected)
                self._desired_ready.set()
                if self._on_reply is not None:
                    self._on_reply(reply)
                wait = self._interval
            except Unauthorized as exc:
                self._on_fatal(str(exc))
                return
            except ControlPlaneError as exc:
                log.warning("heartbeat failed: %s; retrying in %.1fs", exc, backoff)
                wait, backoff = backoff, min(backoff * 2, self._max_backoff)
            except Exception:  # a bug must not silently end heartbeats: the node would look dead
                log.exception("unexpected error in the heartbeat loop; retrying in %.1fs", backoff)
                wait, backoff = backoff, min(backoff * 2, self._max_backoff)
            # Report a change at once, but not twice in a row, so a flapping answer cannot spin.
            if resent:
                self._stop.wait(wait)
                resent = False
            else:
                resent = self._applied_change.wait(wait) and not self._stop.is_set()
            self._applied_change.clear()

    def _apply(self) -> None:
        """Apply the newest desired state whenever one arrives (answers that came meanwhile are skipped)."""
        while True:
            self._desired_ready.wait()
            if self._stop.is_set():
                return
            with self._desired_lock:
                desired, self._desired = self._desired, None
                self._desired_ready.clear()
            if desired is None:
                continue
            try:
                if self._agent.apply_assignments(*desired):
                    self._applied_change.set()
            except Exception:  # a bug must not end the applying: the node would keep stale stages
                log.exception("unexpected error applying the desired state")


def register_until_accepted(
    client: ControlPlaneClient,
    grpc_address: str,
    capabilities: dict[str, Any],
    public_key: str,
    identity: TlsIdentity,
    *,
    stop: threading.Event,
    metrics_port: int | None = None,
    lan_address: str | None = None,
    exchange_port: int | None = None,
    exchange_address: str | None = None,
    min_backoff: float = 1.0,
    max_backoff: float = 30.0,
) -> Registration | None:
    """Register, retrying with backoff while the control plane is unreachable; None if `stop` is set first.
    Raises Unauthorized at once."""
    backoff = min_backoff
    while not stop.is_set():
        try:
            return client.register(grpc_address, capabilities, public_key, identity, metrics_port, lan_address,
                                   exchange_port, exchange_address)
        except Unauthorized:
            raise
        except ControlPlaneError as exc:
            log.warning("registration failed: %s; retrying in %.1fs", exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, max_backoff)
    return None
