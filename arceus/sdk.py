"""Python SDK for the Arceus REST API.

    from arceus.sdk import ArceusClient
    client = ArceusClient.login("http://127.0.0.1:8000", "alice", "secret")
    job = client.submit_job({"model_config": {"layer_sizes": [64, 128, 64, 10]},
                             "dataset_config": {"name": "digits"}, "epochs": 5})
    client.start_job(job["id"])
    final = client.wait(job["id"])

Any `nn.Module` (an exported model: its graphs and weights uploaded as data, see arceus.model.exported):

    from arceus.model.exported.capture import capture
    captured = capture(my_module, example_batch)
    job = client.submit_captured(captured, {"dataset_config": {"name": "digits"}, "epochs": 5})
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import requests

from arceus.contracts.status import TERMINAL_STATUSES
from arceus.model.hugging_face import CONFIG_FILE, folder_weights, hugging_face_config_check
from arceus.model.registry import model_spec_from_config

if TYPE_CHECKING:
    from arceus.model.exported.capture import CapturedModel

MODEL_CHUNK_BYTES = 1024 * 1024
URL_ENV = "ARCEUS_URL"  # the control plane's base URL, for the CLI and the SDK
TOKEN_ENV = "ARCEUS_TOKEN"  # the developer's API token
DATASET_CHUNK_BYTES = 16 << 20  # a dataset upload's pieces (the control plane takes up to 64 MiB)


class ApiError(RuntimeError):
    """The API answered with an error; `errors` holds its field-level messages when it gave any."""

    def __init__(self, status: int, method: str, path: str, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} → HTTP {status}: {_describe(body)}")


class EstimateFailed(RuntimeError):
    """The control plane accepted an estimate but could not compute it; the message says why."""


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (a download being unpacked as it arrives)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        super().__init__()
        self._chunks = chunks
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._rest:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._rest = chunk
        n = min(len(buffer), len(self._rest))
        buffer[:n] = self._rest[:n]
        self._rest = self._rest[n:]
        return n


class _SizedChunks:
    """A request body streamed from chunks whose total length is known: requests sends it as the Content-Length
    (the API refuses a body without one) and sends the chunks as they come."""

    def __init__(self, size: int, chunks: Iterator[bytes]) -> None:
        self._size, self._chunks = size, chunks

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks


def _describe(body: Any) -> str:
    if isinstance(body, dict):
        parts = []
        for key, value in body.items():
            messages = value if isinstance(value, list) else [value]
            parts.append(f"{key}: {'; '.join(str(m) for m in messages)}")
        return ", ".join(parts)
    return str(body)


class ArceusClient:
    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Token {token}"

    @classmethod
    def login(cls, base_url: str, username: str, password: str, *, timeout: float = 30.0) -> ArceusClient:
        client = cls(base_url, timeout=timeout)
        token = client._request("POST", "/api/auth/token", {"username": username, "password": password})["token"]
        return cls(base_url, token, timeout=timeout)

    @classmethod
    def register(
        cls, base_url: str, username: str, email: str, password: str, *, timeout: float = 30.0
    ) -> ArceusClient:
        """Sign up: a new account, and a client holding its API token."""
        body = {"username": username, "email": email, "password": password}
        token = cls(base_url, timeout=timeout)._request("POST", "/api/auth/register", body)["token"]
        return cls(base_url, token, timeout=timeout)

    def rotate_token(self) -> str:
        """Replace this account's API token (the old one stops working at once); this client uses the new one."""
        token = self._request("POST", "/api/auth/token/rotate")["token"]
        self.session.headers["Authorization"] = f"Token {token}"
        return token

    # --- nodes ------------------------------------------------------------------------------------
    def create_node(self, name: str) -> dict[str, Any]:
        """Mint a node and its agent token (shown only in this response)."""
        return self._request("POST", "/api/nodes", {"name": name})

    def nodes(self) -> list[dict[str, Any]]:
        return self._request("GET", "/api/nodes")

    def pause_node(self, node_id: str) -> dict[str, Any]:
        """Drain your node: it takes no new stage and hands back what it hosts, without losing work."""
        return self._request("POST", f"/api/nodes/{node_id}/pause", {})

    def resume_node(self, node_id: str) -> dict[str, Any]:
        return self._request("POST", f"/api/nodes/{node_id}/resume", {})

    # --- market -----------------------------------------------------------------------------------
    def prices(self) -> list[dict[str, Any]]:
        """Every device class's price in force and how many of its devices could take work now."""
        return self._request("GET", "/api/market/prices")

    # --- jobs -------------------------------------------------------------------------------------
    def submit_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/api/jobs", spec)

    def estimate(self, spec: dict[str, Any], *, poll_seconds: float = 0.25, timeout: float = 60.0) -> dict[str, Any]:
        """What the job `spec` would get if submitted now (placement, speed, hours, price): asks for an estimate,
        which a control-plane worker computes, and polls it. ApiError for a bad spec (a 400 naming the field),
        EstimateFailed if the worker could not compute it, TimeoutError if still pending after `timeout` s."""
        pending = self._request("POST", "/api/jobs/estimate", spec)
        path = f"/api/jobs/estimates/{pending['id']}"
        deadline = time.monotonic() + timeout
        while True:
            answer = self._request("GET", path)
            if answer["status"] == "done":
                return answer["result"]
            if answer["status"] == "failed":
                raise EstimateFailed(f"estimate {pending['id']} failed: {answer['error']}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"estimate {pending['id']} still pending after {timeout:.0f}s")
            time.sleep(poll_seconds)

    def start_job(self, job_id: str, *, epochs: int | None = None,
                  learning_rate: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if epochs is not None:
            body["epochs"] = epochs
        if learning_rate is not None:
            body["learning_rate"] = learning_rate
        return self._request("POST", f"/api/jobs/{job_id}/train", body)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/api/jobs/{job_id}/cancel", {})

    def job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/api/jobs/{job_id}")

    def serve_job(self, job_id: str, *, serving: bool = True) -> dict[str, Any]:
        """Ask for a succeeded text job to be served for sampling (its stages on agents, from its final
        checkpoint), or (`serving=False`) no longer; the job's detail. `wait_served` waits until it samples."""
        return self._request("POST", f"/api/jobs/{job_id}/serve", {"serving": serving})

    def stop_serving(self, job_id: str) -> dict[str, Any]:
        """Stop serving the job: its agents drop its stages and its nodes are released."""
        return self._request("DELETE", f"/api/jobs/{job_id}/serve")

    def wait_served(self, job_id: str, *, poll_seconds: float = 0.5, timeout: float = 300.0) -> dict[str, Any]:
        """Poll until every stage of a served job is ready to decode (its Serving condition True); the job's
        detail. RuntimeError if serving stopped (the condition says why), TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            detail = self.job(job_id)
            condition = next((c for c in detail["conditions"] if c["type"] == "Serving"), None)
            if condition is not None and condition["status"] == "True":
                return detail
            if not detail["serving"]:
                why = f"{condition['reason']}: {condition['message']}" if condition else "it was never asked for"
                raise RuntimeError(f"job {job_id} is not served ({why})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not ready to sample after {timeout:.0f}s (Serving: {condition})")
            time.sleep(poll_seconds)

    def jobs(self) -> list[dict[str, Any]]:
        return self._request("GET", "/api/jobs")

    def download_model(self, job_id: str) -> bytes:
        """The job's trained weights (its newest checkpoint) as safetensors bytes, in memory: for small
        models; `save_model` streams any model to a file."""
        buffer = io.BytesIO()
        self._stream_model(job_id, buffer.write)
        return buffer.getvalue()

    def save_model(self, job_id: str, destination: Path) -> int:
        """Stream the job's trained weights into the safetensors file `destination`, a chunk at a time;
        the bytes written. A failed download leaves no file."""
        partial = destination.with_name(destination.name + ".partial")
        try:
            with partial.open("wb") as out:
                written = self._stream_model(job_id, out.write)
            partial.replace(destination)
        finally:
            partial.unlink(missing_ok=True)
        return written

    def save_hugging_face_model(self, job_id: str, destination: Path) -> int:
        """Stream a job's trained Llama or GPT into the folder `destination` as Hugging Face `transformers` loads it
        (`config.json`, `model.safetensors`: `LlamaForCausalLM.from_pretrained(destination)`, `GPT2LMHeadModel`'s;
        the job's uploaded `tokenizer.json`, if any), unpacking the
        tar the control plane sends as it arrives; the bytes received. A failed download leaves no folder."""
        partial = destination.with_name(destination.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        received = 0

        def counted() -> Iterator[bytes]:
            nonlocal received
            for chunk in self._model_chunks(job_id, "hf"):
                received += len(chunk)
                yield chunk

        try:
            reader = io.BufferedReader(_ChunkReader(counted()), MODEL_CHUNK_BYTES)
            try:
                with tarfile.open(fileobj=reader, mode="r|") as archive:
                    archive.extractall(partial, filter="data")  # nothing outside the folder, no links or devices
            except tarfile.TarError as exc:
                path = f"/api/jobs/{job_id}/model?format=hf"
                raise ApiError(502, "GET", path, f"the download is no tar of a model folder: {exc}") from exc
            reader.read()  # the end of the stream: its length is checked there
            partial.replace(destination)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return received

    def upload_initial_weights(self, job_id: str, source: Path | bytes) -> dict[str, Any]:
        """Stream a Hugging Face model (`source`: its folder, its `model.safetensors` sharded or not, fp32, bf16 or
        fp16; or that file; an exported model's weights: the bytes capture() wrote) to a job that has not started
        as the weights it starts from; the job's detail. A folder's config.json is checked against the job's model
        first (`hugging_face_config_check`: CheckpointError)."""
        path = f"/api/jobs/{job_id}/initial-weights"
        if isinstance(source, bytes):
            return self._put_bytes(path, source)
        if not source.is_dir():
            with source.open("rb") as body:  # requests sends a file's size as its Content-Length and streams it
                return self._put_bytes(path, body)
        config = source / CONFIG_FILE
        if config.exists():  # before any byte is sent: weights of another function are refused here
            spec = model_spec_from_config(self.job(job_id)["model_config"])
            hugging_face_config_check(spec, json.loads(config.read_text(encoding="utf-8")))
        with folder_weights(source) as (size, chunks):
            return self._put_bytes(path, _SizedChunks(size, chunks))

    def upload_program(self, job_id: str, program: bytes) -> dict[str, Any]:
        """An exported model's program (`CapturedModel.program`) for a job that has not started; the job's detail."""
        return self._put_bytes(f"/api/jobs/{job_id}/program", program)

    def submit_captured(self, captured: CapturedModel, spec: dict[str, Any]) -> dict[str, Any]:
        """Submit a job of a captured `nn.Module` (`spec`: the job's other fields, its model_config left out) and
        upload its program and initial weights; the job's detail, ready to start."""
        job = self.submit_job({**spec, "model_config": captured.model_config})
        self.upload_program(job["id"], captured.program)
        return self.upload_initial_weights(job["id"], captured.weights)

    def _put_bytes(self, path: str, body: bytes | BinaryIO | _SizedChunks) -> dict[str, Any]:
        response = self.session.put(
            self.base_url + path, data=body, timeout=self.timeout, headers={"Content-Type": "application/octet-stream"}
        )
        if response.status_code >= 400:
            raise ApiError(response.status_code, "PUT", path, _payload(response))
        return response.json()

    # --- datasets ---------------------------------------------------------------------------------
    def upload_dataset(
        self,
        source: Path,
        format: str,
        *,
        name: str | None = None,
        column: str = "text",
        chunk_bytes: int = DATASET_CHUNK_BYTES,
        retries: int = 5,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Upload a dataset file (`format`: text, jsonl, parquet, safetensors, npz or tokenizer) in pieces and
        complete it; the ready dataset's detail (its `id` is what a job's dataset_config names). Resumes: an
        upload of the same file (size and SHA-256) left unfinished, by this or an earlier call, continues from
        the control plane's offset, and a piece whose connection fails is sent again from there."""
        size, sha256 = source.stat().st_size, _file_sha256(source)
        dataset = next(
            (d for d in self.datasets() if d["status"] == "uploading" and (d["sha256"], d["size_bytes"],
             d["format"]) == (sha256, size, format)),
            None,
        ) or self._request("POST", "/api/datasets", {
            "name": name or source.name, "format": format, "column": column, "size_bytes": size, "sha256": sha256,
        })
        path, failures = f"/api/datasets/{dataset['id']}/data", 0
        offset = dataset["uploaded_bytes"]
        with source.open("rb") as handle:
            while offset < size:
                handle.seek(offset)
                piece = handle.read(min(chunk_bytes, size - offset))
                try:
                    response = self.session.put(
                        self.base_url + path, params={"offset": offset}, data=piece, timeout=self.timeout,
                        headers={"Content-Type": "application/octet-stream"},
                    )
                except (requests.ConnectionError, requests.Timeout):
                    response = None
                if response is not None and response.status_code < 400:
                    offset, failures = response.json()["uploaded_bytes"], 0
                    if on_progress is not None:
                        on_progress(offset, size)
                    continue
                if response is not None and response.status_code != 409:
                    raise ApiError(response.status_code, "PUT", path, _payload(response))
                failures += 1
                if failures > retries:
                    raise ApiError(503, "PUT", path, f"the upload stopped at byte {offset:,} after {retries} retries")
                offset = self.dataset(dataset["id"])["uploaded_bytes"]  # where the control plane has it
        return self._request("POST", f"/api/datasets/{dataset['id']}/complete")

    def datasets(self) -> list[dict[str, Any]]:
        return self._request("GET", "/api/datasets")

    def dataset(self, dataset_id: str) -> dict[str, Any]:
        return self._request("GET", f"/api/datasets/{dataset_id}")

    def delete_dataset(self, dataset_id: str) -> None:
        self._request("DELETE", f"/api/datasets/{dataset_id}")

    def _stream_model(self, job_id: str, write: Callable[[bytes], Any]) -> int:
        written = 0
        for chunk in self._model_chunks(job_id, "safetensors"):
            write(chunk)
            written += len(chunk)
        return written

    def _model_chunks(self, job_id: str, model_format: str) -> Iterator[bytes]:
        """The job's model download in `model_format`, chunk by chunk; ApiError if it ends early."""
        path = f"/api/jobs/{job_id}/model"
        params = {"format": model_format}
        with self.session.get(self.base_url + path, params=params, timeout=self.timeout, stream=True) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, "GET", path, _payload(response))
            expected = int(response.headers.get("Content-Length", -1))
            received = 0
            for chunk in response.iter_content(chunk_size=MODEL_CHUNK_BYTES):
                received += len(chunk)
                yield chunk
        if expected >= 0 and received != expected:
            raise ApiError(502, "GET", path, f"the model download ended after {received:,} of {expected:,} bytes")

    def sample(
        self, job_id: str, *, prompt: str = "\n", length: int = 300, temperature: float = 0.8, seed: int = 0
    ) -> dict[str, Any]:
        """Text from a running or served (`serve_job`) text job, decoded through its agents: `{"text": prompt +
        generated text, "step": the training step the weights had reached}`."""
        body = {"prompt": prompt, "length": length, "temperature": temperature, "seed": seed}
        return self._request("POST", f"/api/jobs/{job_id}/sample", body)

    def wait(
        self,
        job_id: str,
        *,
        poll_seconds: float = 0.5,
        timeout: float | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the job reaches a terminal status; returns its final detail."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            detail = self.job(job_id)
            if on_update is not None:
                on_update(detail)
            if detail["status"] in TERMINAL_STATUSES:
                return detail
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {detail['status']} after {timeout:.0f}s "
                    f"(conditions: {detail.get('conditions')})"
                )
            time.sleep(poll_seconds)

    # --- transport --------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.session.request(method, self.base_url + path, json=body, timeout=self.timeout)
        payload = _payload(response)
        if response.status_code >= 400:
            raise ApiError(response.status_code, method, path, payload)
        return payload


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(MODEL_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _payload(response: requests.Response) -> Any:
    try:
        return response.json() if response.content else None
    except ValueError:
        return response.text
