"""`DistributedTrainer`: the seed's SDK, on top of the REST API (`arceus.sdk.ArceusClient`).

    from arceus import DistributedTrainer
    trainer = DistributedTrainer(model={"type": "mlp", "layer_sizes": [64, 128, 64, 10]},
                                 discovery_method="auto", partition_strategy="hybrid", fault_tolerance=True)
    trainer.discover_peers()         # the control plane ($ARCEUS_URL, else mDNS) and its ready devices
    history = trainer.train(dataset={"name": "digits"}, epochs=10, checkpoint_interval=100)
    trainer.model                    # an nn.Module holding the trained weights

`model` may also be any `nn.Module` (captured with torch.export: arceus.model.exported) and `dataset` tensors, a
torch Dataset, a file or an uploaded dataset's id (uploaded first: arceus.data.uploadable). What a model and a
dataset may be is decided in one place each: `_model_source` and `dataset_config_for`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from arceus.contracts.status import JobStatus
from arceus.data.config import UPLOADED_DATASET
from arceus.data.formats import TENSOR_FORMATS, TEXT_FORMATS
from arceus.data.uploadable import uploadable
from arceus.discovery import DEFAULT_BROWSE_SECONDS, DISCOVERY_METHODS, control_plane_url
from arceus.errors import SpecError
from arceus.model.build import build_full_model, global_param_name
from arceus.model.exported.capture import CapturedModel, capture
from arceus.model.registry import check_tensor_parallel, model_spec_from_config
from arceus.model.spec import ModelSpec
from arceus.partition import PARTITION_STRATEGIES, TENSOR_PARALLEL_WIDTH, Partition, partition_for
from arceus.progress_bar import JobProgressBar
from arceus.sdk import TOKEN_ENV, URL_ENV, ArceusClient

log = logging.getLogger("arceus.trainer")
# Job fields the trainer sets itself from its own arguments; `train(**job_fields)` may set any other.
_OWN_FIELDS = frozenset({"model_config", "dataset_config", "epochs", "stages", "tensor_parallel",
                         "checkpoint_interval_steps"})


@contextmanager
def interrupted_by_ctrl_c() -> Iterator[None]:
    """Within, SIGINT raises KeyboardInterrupt also where the process inherited it ignored (as `cmd &` from a
    script or some service managers start it; Python then installs no handler of its own), so Ctrl-C or `kill
    -INT` cancels the job. Any other disposition is the program's own and is kept; so is everything off the
    main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class TrainingFailed(RuntimeError):
    """The job ended without succeeding; `detail` is its last state."""

    def __init__(self, detail: dict[str, Any]) -> None:
        self.detail = detail
        super().__init__(f"job {detail['id']} {detail['status']}: {detail.get('error') or 'no error recorded'}")


@dataclass(frozen=True)
class DeviceClass:
    device_class: str  # "<compute tier>-<memory tier>"
    ready_nodes: int
    price_per_hour: float


@dataclass(frozen=True)
class Peers:
    """What `discover_peers` found: the control plane, how, and the devices ready there by class."""

    url: str
    found_by: str  # "given", the mDNS service instance, or the variable the URL came from
    devices: list[DeviceClass]

    @property
    def ready_devices(self) -> int:
        return sum(d.ready_nodes for d in self.devices)


@dataclass
class TrainingHistory:
    job_id: str
    status: str
    steps: int
    losses: list[float]  # per training step, in order (the job's loss curve)
    val_loss: float | None
    val_accuracy: float | None
    epochs: list[dict[str, Any]]  # validation after each epoch
    detail: dict[str, Any] = field(repr=False)  # the job's final API detail


@dataclass(frozen=True)
class _ModelSource:
    """What a job needs of the developer's model: its config, and for an `nn.Module` its capture (program and
    initial weights to upload, the way back to the module's parameter names)."""

    model_config: dict[str, Any]
    captured: CapturedModel | None = None


def _model_source(model: Any, example_input: torch.Tensor | None, **capture_options: Any) -> _ModelSource | None:
    """The one place that decides what `model` may be: an Arceus model config (`{"type": "mlp", "layer_sizes":
    [...]}`, a GPT, a Llama, a convnet: docs/architecture.md "Model spec and datasets"), or any `nn.Module`,
    captured with torch.export on `example_input` (arceus.model.exported); None for a module whose example batch
    is still to come from the dataset given to `train`."""
    if isinstance(model, dict):
        return _ModelSource(model_config=model)
    if isinstance(model, nn.Module):
        if example_input is None:
            return None
        captured = capture(model, example_input, **capture_options)
        return _ModelSource(model_config=captured.model_config, captured=captured)
    raise TypeError(f"model must be an nn.Module or an Arceus model config (a dict such as {{'type': 'mlp', "
                    f"'layer_sizes': [64, 128, 10]}}), got {type(model).__name__}")


def _example_batch(dataset: Any) -> torch.Tensor:
    """Two samples' inputs from what the developer holds, to capture their module on."""
    if isinstance(dataset, tuple | list) and len(dataset) == 2 and isinstance(dataset[0], torch.Tensor):
        return dataset[0][:2].to(torch.float32)
    if isinstance(dataset, torch.utils.data.Dataset):
        return torch.stack([dataset[i][0] for i in range(2)]).to(torch.float32)  # type: ignore[index]
    raise ValueError("an nn.Module is captured on an example batch: pass example_input= to DistributedTrainer, or "
                     "train on (x, y) tensors or a torch Dataset, whose first samples serve")


def dataset_config_for(dataset: Any, client: ArceusClient) -> dict[str, Any]:
    """The one place that decides what `dataset` may be: a dataset config the control plane knows (`{"name":
    "digits"}`, `{"name": "text", "source": ...}`: docs/architecture.md "Model spec and datasets"), an uploaded
    dataset's id, or what `arceus.data.uploadable` converts (a pair of tensors, a torch Dataset of (x, y) samples,
    a text, JSONL, Parquet, safetensors or npz file), which is uploaded first (resuming an unfinished upload of the
    same file)."""
    if isinstance(dataset, dict):
        return dataset
    if isinstance(dataset, str) and _is_dataset_id(dataset) and not Path(dataset).exists():
        return _uploaded_config(client.dataset(dataset))
    with tempfile.TemporaryDirectory(prefix="arceus-dataset-") as folder:
        path, fmt = uploadable(dataset, Path(folder))
        if fmt not in TEXT_FORMATS + TENSOR_FORMATS:
            raise ValueError(f"{path} is a {fmt}, not a dataset to train on")
        return _uploaded_config(client.upload_dataset(path, fmt))


def _is_dataset_id(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _uploaded_config(detail: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset config naming a ready upload: text trains a text model, tensors the rest."""
    if detail["status"] != "ready":
        raise ValueError(f"dataset {detail['id']} is {detail['status']}, not ready: upload it again")
    name = "text" if detail["format"] in TEXT_FORMATS else UPLOADED_DATASET
    return {"name": name, "dataset_id": str(detail["id"])}


def _layer_plan(model_config: dict[str, Any]) -> ModelSpec:
    """The model's spec for partitioning: its layers and which of them split do not depend on the vocabulary's
    size, which submission fills in for a text model."""
    try:
        return model_spec_from_config(model_config)
    except SpecError as exc:
        if exc.field != "model_config.vocab_size":
            raise
        return model_spec_from_config({**model_config, "vocab_size": 2})


def _splits_in_two(spec: ModelSpec) -> bool:
    try:
        check_tensor_parallel(spec, TENSOR_PARALLEL_WIDTH)
    except SpecError:
        return False
    return True


class DistributedTrainer:
    """Train a model on the devices of a control plane.

    `discovery_method`: "auto" (`url`, else $ARCEUS_URL, else the control plane advertised on the local network
    by mDNS), "url" (no discovery) or "mdns" (only discovery, unless `url` is given). `token`: the API token
    (default $ARCEUS_TOKEN). `partition_strategy`: "pipeline" (a stage per ready device) or "hybrid" (pipeline
    stages, the later ones split over tensor-parallel pairs where the model allows it: arceus.partition).
    `fault_tolerance`: checkpoint while training, so a lost device costs at most the steps since the last
    checkpoint (the control plane moves its stage and resumes); without it nothing is saved before the end and a
    lost device restarts the job."""

    def __init__(
        self, model: Any, *, discovery_method: str = "auto", partition_strategy: str = "pipeline",
        fault_tolerance: bool = True, url: str | None = None, token: str | None = None,
        discovery_timeout: float = DEFAULT_BROWSE_SECONDS, progress: bool = True, name: str = "",
        example_input: torch.Tensor | None = None, split_points: list[str] | None = None,
        input_bound: int | None = None,
    ) -> None:
        if partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(f"partition_strategy must be one of {', '.join(PARTITION_STRATEGIES)}, "
                             f"got {partition_strategy!r}")
        self._capture_options = {"split_points": split_points, "input_bound": input_bound}
        self._source = _model_source(model, example_input, **self._capture_options)
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.discovery_method = discovery_method
        self.partition_strategy = partition_strategy
        self.fault_tolerance = fault_tolerance
        self.progress = progress
        self.name = name
        self.job_id: str | None = None
        self.peers: Peers | None = None
        self._url, self._token, self._timeout = url, token, discovery_timeout
        self._client: ArceusClient | None = None
        if discovery_method not in DISCOVERY_METHODS:  # checked now; the control plane is found on first use
            raise ValueError(f"discovery_method must be one of {', '.join(DISCOVERY_METHODS)}, "
                             f"got {discovery_method!r}")

    @property
    def client(self) -> ArceusClient:
        """The API client, once the control plane is found (discovered on first use)."""
        if self._client is None:
            self.discover_peers()
        assert self._client is not None
        return self._client

    def discover_peers(self) -> Peers:
        """Find the control plane (see `discovery_method`) and the devices ready on it, by class."""
        token = self._token or os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(f"no API token: pass token=... or set {TOKEN_ENV} (`arceus login USER` prints one)")
        found = control_plane_url(self.discovery_method, given=self._url, configured=os.environ.get(URL_ENV),
                                  configured_by=URL_ENV, timeout=self._timeout)
        client = ArceusClient(found.url, token)
        rows = client.prices()
        self._client = client
        self.peers = Peers(url=found.url, found_by=found.service, devices=[
            DeviceClass(device_class=r["device_class"], ready_nodes=r["ready_nodes"],
                        price_per_hour=r["price_per_hour"]) for r in rows])
        log.info("control plane %s (%s): %d ready devices", found.url, found.service, self.peers.ready_devices)
        return self.peers

    def partition(self) -> Partition:
        """The stages (and split stages) the partition strategy asks for on the devices ready now."""
        if self._source is None:
            raise ValueError("the module is captured on its first batch: call train(), or pass example_input= to "
                             "DistributedTrainer to partition before it")
        peers = self.peers or self.discover_peers()
        if peers.ready_devices < 1:
            raise RuntimeError(f"no device is ready on {peers.url}: start a node agent (`arceus-agent`) and try again")
        spec = _layer_plan(self._source.model_config)
        return partition_for(self.partition_strategy, num_layers=spec.num_layers, splits=_splits_in_two(spec),
                             ready_devices=peers.ready_devices)

    def train(self, dataset: Any, *, epochs: int = 1, checkpoint_interval: int | None = None,
              timeout: float | None = None, **job_fields: Any) -> TrainingHistory:
        """Submit and start a job, show its progress, wait for it and load its trained weights into
        `self.model`. `checkpoint_interval`: steps between checkpoints (the control plane's default if None;
        only with fault tolerance). `job_fields`: any other field of the job (learning_rate, optimizer,
        micro_batches, seed, ...: POST /api/jobs). Ctrl-C cancels the job. TrainingFailed if it does not
        succeed."""
        clash = _OWN_FIELDS & job_fields.keys()
        if clash:
            raise TypeError(f"train() sets {', '.join(sorted(clash))} itself: use its arguments and the trainer's")
        if checkpoint_interval is not None and not self.fault_tolerance:
            raise ValueError("checkpoint_interval needs fault_tolerance=True: without it nothing is saved "
                             "before the end")
        if self._source is None:
            self._source = _model_source(self.model, _example_batch(dataset), **self._capture_options)
        spec: dict[str, Any] = {
            "name": self.name, "dataset_config": dataset_config_for(dataset, self.client), "epochs": epochs,
            **self.partition().job_fields(), **job_fields,
        }
        if not self.fault_tolerance:
            spec["checkpoint_interval_steps"] = 0
        elif checkpoint_interval is not None:
            spec["checkpoint_interval_steps"] = checkpoint_interval
        captured = self._source.captured
        job = (self.client.submit_job({**spec, "model_config": self._source.model_config}) if captured is None
               else self.client.submit_captured(captured, spec))
        self.job_id = str(job["id"])
        log.info("job %s submitted: %d stages, tensor parallel %s", self.job_id, spec["stages"],
                 spec["tensor_parallel"])
        with interrupted_by_ctrl_c():
            try:
                self.client.start_job(self.job_id)
                final = self._wait(timeout)
            except KeyboardInterrupt:
                self.client.cancel_job(self.job_id)
                print(f"cancelled job {self.job_id}", file=sys.stderr)
                raise
        if final["status"] != JobStatus.SUCCEEDED:
            raise TrainingFailed(final)
        self._load_trained(final)
        return TrainingHistory(
            job_id=self.job_id, status=final["status"], steps=final["step"],
            losses=[p["loss"] for p in final["loss_curve"]], val_loss=final["val_loss"],
            val_accuracy=final["val_accuracy"], epochs=final["epochs"], detail=final,
        )

    def _wait(self, timeout: float | None) -> dict[str, Any]:
        assert self.job_id is not None
        if not self.progress:
            return self.client.wait(self.job_id, timeout=timeout)
        bar = JobProgressBar(file=sys.stderr)
        try:
            return self.client.wait(self.job_id, timeout=timeout, on_update=bar.update)
        finally:
            bar.close()

    def _load_trained(self, final: dict[str, Any]) -> None:
        """Stream the trained weights to a temporary file and copy them, a tensor at a time, into `self.model`
        (built from the job's completed model config the first time: the seeded weights every split starts
        from; a captured module's own parameters, by the names its capture recorded)."""
        assert self.job_id is not None and self._source is not None
        if self.model is None:
            self.model = build_full_model(model_spec_from_config(final["model_config"]), final["seed"])
        own = dict(self.model.named_parameters(remove_duplicate=False))  # a tied parameter under each of its names
        captured = self._source.captured
        params = ({global_param_name(name): p for name, p in own.items()} if captured is None
                  else {pipeline: own[name] for pipeline, name in captured.names.items()})
        with tempfile.TemporaryDirectory(prefix="arceus-model-") as folder:
            path = Path(folder) / "model.safetensors"
            self.client.save_model(self.job_id, path)
            with safe_open(str(path), framework="pt") as weights, torch.no_grad():
                names = set(weights.keys())
                if names != params.keys():
                    raise ValueError(f"the job's weights do not fit the model: missing "
                                     f"{sorted(params.keys() - names)}, unexpected {sorted(names - params.keys())}")
                for name in sorted(names):
                    tensor = weights.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ValueError(f"{name}: the job's weights are {list(tensor.shape)}, the model's "
                                         f"{list(params[name].shape)}")
                    params[name].copy_(tensor)
