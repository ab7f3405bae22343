"""`Assignment`: one stage a node should host. The control plane builds it (`to_json` in the heartbeat
answer), static assignment files hold it, and the agent parses it (`from_json`).

The JSON shape is the contract in docs/architecture.md. Parsing is strict so a bad assignment is
reported back as a failed stage with a message instead of breaking the agent later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arceus.contracts.certificates import check_certificate
from arceus.contracts.credentials import StageCredentials
from arceus.contracts.data_plane import DataPlane
from arceus.contracts.replica_sync import ReplicaSync, replica_sync_from_json
from arceus.contracts.transfer import TransferConfig, transfer_config_from_json
from arceus.errors import SpecError
from arceus.model.precision import check_precision
from arceus.model.registry import check_tensor_parallel, model_spec_from_config
from arceus.model.spec import ModelSpec
from arceus.pipeline.schedule import SCHEDULES, staleness_check

OPTIMIZERS = ("sgd", "adam", "adam8bit")  # arceus.model.optimizers
_FIELDS = frozenset(
    {
        "stage_id",
        "job_id",
        "stage_index",
        "num_stages",
        "generation",
        "model",
        "layer_start",
        "layer_end",
        "seed",
        "optimizer",
        "micro_batches",
        "max_micro_batch_size",
        "prev_address",
        "next_address",
        "credentials",
        "certificates",
    }
)
_OPTIONAL_FIELDS = frozenset(
    {
        "checkpoint", "initial_weights", "program", "transfer", "precision", "tensor_parallel",
        "activation_checkpointing", "schedule", "inference", "replica", "replica_sync", "tied", "staleness",
        "data_plane",
    }
)
_OPTIMIZER_FIELDS = frozenset({"name", "lr", "momentum", "weight_decay"})
_CHECKPOINT_FIELDS = frozenset({"step", "url", "sha256"})
_INITIAL_WEIGHTS_FIELDS = frozenset({"url", "layer_sha256"})
_TENSOR_PARALLEL_FIELDS = frozenset({"rank", "size", "peers"})
_TIED_FIELDS = frozenset({"stage_index", "layer_start", "layer_end", "addresses"})


def max_micro_batch_size(dataset_config: dict[str, Any], micro_batches: int) -> int:
    """The largest micro-batch a driver sends for this (validated) dataset config: what an assignment's
    `max_micro_batch_size` must allow."""
    largest = max(dataset_config["batch_size"], dataset_config["val_batch_size"])
    return math.ceil(largest / micro_batches)


@dataclass(frozen=True)
class CheckpointRef:
    """Where the stage's state at `step` is kept: the agent fetches `url` and checks the hash."""

    step: int
    url: str
    sha256: str


@dataclass(frozen=True)
class InitialWeightsRef:
    """Where the stage's layers of the job's uploaded weights are fetched (a path on the control plane;
    `?start=&end=` picks the layers) and each layer's digest (`arceus.model.hugging_face`), in layer order
    from the stage's first: the agent checks what it receives against them."""

    url: str
    layer_sha256: tuple[str, ...]


@dataclass(frozen=True)
class TensorParallelConfig:
    """This agent is rank `rank` of a stage split over `len(peers)` agents (`peers`: every rank's address,
    in rank order, this one's included)."""

    rank: int
    peers: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.peers)


@dataclass(frozen=True)
class TiedPeer:
    """Another stage holding a copy of a tied weight this stage holds: its layers and every rank's address."""

    stage_index: int
    layer_start: int
    layer_end: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class OptimizerConfig:
    name: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Assignment:
    stage_id: str
    job_id: str
    stage_index: int
    num_stages: int
    generation: int
    model: dict[str, Any]
    layer_start: int
    layer_end: int
    seed: int
    optimizer: OptimizerConfig
    micro_batches: int
    max_micro_batch_size: int
    prev_address: str | None
    next_address: str | None
    credentials: StageCredentials  # this stage's token, and whose it accepts (arceus.contracts.credentials)
    # The TLS certificate (PEM) registered by the agent at each address this stage calls: it trusts no other.
    certificates: Mapping[str, str]
    checkpoint: CheckpointRef | None = None  # None: start from the initial weights
    # The stage's layers of the job's uploaded starting weights: the initial weights when set, else the seeded
    # ones.
    initial_weights: InitialWeightsRef | None = None
    # Where an exported model's layers are fetched (a path on the control plane; `?start=&end=` picks them),
    # each checked against its hash in `model`; None for a model built from code.
    program: str | None = None
    transfer: TransferConfig = TransferConfig()  # how this stage encodes what it sends
    precision: str = "fp32"  # or "bf16": autocast compute (arceus.model.precision)
    activation_checkpointing: bool = False  # keep a micro-batch's input only; recompute the rest backward
    # The pipeline schedule the job's steps follow: how many micro-batches' activations this stage holds at
    # once (`arceus.pipeline.schedule.peak_in_flight`), which its memory budget is checked against.
    schedule: str = "gpipe"
    tensor_parallel: TensorParallelConfig | None = None  # None: the stage is this one agent
    # Every rank of a tensor-parallel neighbour (rank 0's is prev/next_address); empty for a one-agent one.
    prev_ranks: tuple[str, ...] = ()
    next_ranks: tuple[str, ...] = ()
    # A served job's stage: it decodes for samplers only, so it is built without an optimizer and loads only the
    # weights of its checkpoint (never its optimizer state); nothing trains it. Never tensor-parallel.
    inference: bool = False
    # This stage's replica id where the stage is replicated (arceus/swarm): its neighbours and siblings are then
    # named step by step (RunStep's routes and peers), not here, so prev/next_address are null. None: one agent.
    replica: int | None = None
    # How often a replica agrees with its siblings (arceus.contracts.replica_sync): every step, exactly, by default.
    replica_sync: ReplicaSync = ReplicaSync()
    # The other stages that hold a copy of a tied weight this stage holds a copy of (arceus.model.tied), by index:
    # where it sends its copies' gradients each train step and whose it takes. Empty: it shares none (or holds
    # every copy itself).
    tied: tuple[TiedPeer, ...] = ()
    # The job's staleness (arceus.pipeline.schedule.STALENESS): 1, a train step chained after another runs its
    # forwards once that one's are done here, with the weights before that one's update (PipeDream-2BW).
    staleness: int = 0
    # The data-plane features this agent and its one-agent neighbours declared (arceus.contracts.data_plane): which
    # links take a neighbour stream. Empty: every link takes PushStream.
    data_plane: DataPlane = DataPlane()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def sends_on(self) -> bool:
        """Whether this agent sends the stage's outputs on: every rank computes the same replicated
        outputs and input gradients, so only rank 0 of a tensor-parallel stage sends them."""
        return self.tensor_parallel is None or self.tensor_parallel.rank == 0

    @property
    def prev_addresses(self) -> tuple[str, ...]:
        """Where gradients go: every rank of the previous stage."""
        return self.prev_ranks or ((self.prev_address,) if self.prev_address else ())

    @property
    def next_addresses(self) -> tuple[str, ...]:
        """Where activations go: every rank of the next stage."""
        return self.next_ranks or ((self.next_address,) if self.next_address else ())

    @property
    def spec(self) -> ModelSpec:
        return model_spec_from_config(self.model)

    @classmethod
    def from_json(cls, data: Any) -> Assignment:
        """Parse one assignment object; raises SpecError with a field like "assignment.layer_end"."""
        if not isinstance(data, dict):
            raise SpecError("assignment", f"must be a JSON object, got {type(data).__name__}")
        missing = sorted(_FIELDS - set(data))
        if missing:
            raise SpecError(f"assignment.{missing[0]}", f"is required (missing: {', '.join(missing)})")
        unknown = sorted(set(data) - _FIELDS - _OPTIONAL_FIELDS)
        if unknown:
            raise SpecError(f"assignment.{unknown[0]}", "unknown field")
        stage_id = _string(data, "stage_id")
        job_id = _string(data, "job_id")
        num_stages = _int(data, "num_stages", minimum=1)
        stage_index = _int(data, "stage_index", minimum=0)
        if stage_index >= num_stages:
            raise SpecError(
                "assignment.stage_index", f"must be below num_stages ({num_stages}), got {stage_index}"
            )
        try:
            spec = model_spec_from_config(data["model"])
        except SpecError as exc:
            raise SpecError(
                f"assignment.model.{exc.field.removeprefix('model_config.')}", exc.message
            ) from exc
        layer_start = _int(data, "layer_start", minimum=0)
        layer_end = _int(data, "layer_end", minimum=1)
        if not layer_start < layer_end <= spec.num_layers:
            raise SpecError(
                "assignment.layer_end",
                f"layer range [{layer_start}, {layer_end}) must be non-empty "
                f"and inside the model's {spec.num_layers} layers",
            )
        if stage_index == 0 and layer_start != 0:
            raise SpecError(
                "assignment.layer_start", f"the first stage must start at layer 0, got {layer_start}"
            )
        if stage_index == num_stages - 1 and layer_end != spec.num_layers:
            raise SpecError(
                "assignment.layer_end", f"the last stage must end at layer {spec.num_layers}, got {layer_end}"
            )
        replica = data.get("replica")
        if replica is not None:
            replica = _int(data, "replica", minimum=0)
        routed = replica is not None  # a replica's neighbours come with each step
        prev_address, prev_ranks = _neighbour(data, "prev_address", required=stage_index > 0 and not routed)
        next_address, next_ranks = _neighbour(
            data, "next_address", required=stage_index < num_stages - 1 and not routed
        )
        precision = check_precision(data.get("precision", "fp32"), "assignment.precision")
        recompute = data.get("activation_checkpointing", False)
        schedule = data.get("schedule", "gpipe")
        if schedule not in SCHEDULES:
            raise SpecError("assignment.schedule", f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if not isinstance(recompute, bool):
            raise SpecError("assignment.activation_checkpointing", f"must be true or false, got {recompute!r}")
        tensor_parallel = _tensor_parallel(data.get("tensor_parallel"), spec)
        inference = data.get("inference", False)
        if not isinstance(inference, bool):
            raise SpecError("assignment.inference", f"must be true or false, got {inference!r}")
        if replica is not None and tensor_parallel is not None:
            raise SpecError(
                "assignment.replica",
                "a tensor-parallel stage cannot be replicated yet: use one tensor-parallel group per stage, or "
                "replicas of unsplit stages",
            )
        replica_sync = replica_sync_from_json(data.get("replica_sync"), field="assignment.replica_sync")
        if replica is None and not replica_sync.exact:
            raise SpecError("assignment.replica_sync", "applies to a replica of a replicated stage only")
        credentials = StageCredentials.from_json(data.get("credentials"))
        if (replica is not None) != bool(credentials.replica_token):
            raise SpecError(
                "assignment.credentials.replica_token",
                "a replica of a replicated stage needs its own replica token, and only a replica has one",
            )
        if inference and tensor_parallel is not None:
            raise SpecError("assignment.inference", "a stage served for inference is one agent, never tensor-parallel")
        optimizer = _optimizer(data["optimizer"])
        quantized_refusal = quantized_state_refusal(
            optimizer.name, tensor_parallel=tensor_parallel is not None, averaged=not replica_sync.exact
        )
        if quantized_refusal:
            raise SpecError("assignment.optimizer.name", quantized_refusal)
        if recompute and tensor_parallel is not None:
            raise SpecError(
                "assignment.activation_checkpointing", "a tensor-parallel stage cannot recompute its activations"
            )
        staleness = staleness_check(data.get("staleness", 0), "assignment.staleness")
        if staleness and (replica is not None or tensor_parallel is not None or inference):
            raise SpecError(
                "assignment.staleness",
                "staleness 1 is for a training stage of one agent: not a replica, a tensor-parallel rank or a "
                "served stage (not supported yet)",
            )
        tied = _tied(data.get("tied", []), stage_index, num_stages)
        if tied and replica is not None:
            raise SpecError("assignment.tied", "a replicated stage cannot share tied weights with another stage yet")
        # Every agent this one calls: the neighbours' ranks, the other ranks of its own stage, the ranks of the
        # stages it shares tied weights with.
        peers = () if tensor_parallel is None else tensor_parallel.peers
        others = tuple(p for r, p in enumerate(peers) if tensor_parallel is None or r != tensor_parallel.rank)
        called = (*(prev_ranks or (prev_address,)), *(next_ranks or (next_address,)), *others,
                  *(address for peer in tied for address in peer.addresses))
        return cls(
            stage_id=stage_id,
            job_id=job_id,
            stage_index=stage_index,
            num_stages=num_stages,
            generation=_int(data, "generation", minimum=0),
            model=dict(data["model"]),
            layer_start=layer_start,
            layer_end=layer_end,
            seed=_int(data, "seed", minimum=0),
            optimizer=optimizer,
            micro_batches=_int(data, "micro_batches", minimum=1),
            max_micro_batch_size=_int(data, "max_micro_batch_size", minimum=1),
            prev_address=prev_address,
            next_address=next_address,
            credentials=credentials,
            certificates=_certificates(data["certificates"], called),
            checkpoint=_checkpoint(data.get("checkpoint")),
            initial_weights=_initial_weights(data.get("initial_weights"), layer_end - layer_start),
            program=_program(data.get("program")),
            transfer=transfer_config_from_json(data.get("transfer"), field="assignment.transfer"),
            precision=precision,
            activation_checkpointing=recompute,
            schedule=schedule,
            tensor_parallel=tensor_parallel,
            prev_ranks=prev_ranks,
            next_ranks=next_ranks,
            inference=inference,
            replica=replica,
            replica_sync=replica_sync,
            tied=tied,
            staleness=staleness,
            data_plane=DataPlane.from_json(data.get("data_plane")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage_id,
            "job_id": self.job_id,
            "stage_index": self.stage_index,
            "num_stages": self.num_stages,
            "generation": self.generation,
            "model": dict(self.model),
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "seed": self.seed,
            "optimizer": {
                "name": self.optimizer.name,
                "lr": self.optimizer.lr,
                "momentum": self.optimizer.momentum,
                "weight_decay": self.optimizer.weight_decay,
            },
            "micro_batches": self.micro_batches,
            "max_micro_batch_size": self.max_micro_batch_size,
            "prev_address": list(self.prev_ranks) if self.prev_ranks else self.prev_address,
            "next_address": list(self.next_ranks) if self.next_ranks else self.next_address,
            "credentials": self.credentials.to_json(),
            "certificates": dict(self.certificates),
            "checkpoint": None
            if self.checkpoint is None
            else {"step": self.checkpoint.step, "url": self.checkpoint.url, "sha256": self.checkpoint.sha256},
            **(
                {}
                if self.initial_weights is None
                else {
                    "initial_weights": {
                        "url": self.initial_weights.url, "layer_sha256": list(self.initial_weights.layer_sha256)
                    }
                }
            ),
            **({} if self.program is None else {"program": self.program}),
            **({"inference": True} if self.inference else {}),
            **({} if self.replica is None else {"replica": self.replica}),
            **({} if self.replica_sync.exact else {"replica_sync": self.replica_sync.to_json()}),
            **({"tied": [{"stage_index": p.stage_index, "layer_start": p.layer_start, "layer_end": p.layer_end,
                          "addresses": list(p.addresses)} for p in self.tied]} if self.tied else {}),
            "transfer": self.transfer.to_json(),
            "precision": self.precision,
            "activation_checkpointing": self.activation_checkpointing,
            "schedule": self.schedule,
            **({"staleness": self.staleness} if self.staleness else {}),
            **({"data_plane": self.data_plane.to_json()} if self.data_plane.own else {}),
            **(
                {}
                if self.tensor_parallel is None
                else {
                    "tensor_parallel": {
                        "rank": self.tensor_parallel.rank,
                        "size": self.tensor_parallel.size,
                        "peers": list(self.tensor_parallel.peers),
                    }
                }
            ),
        }


def _program(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.startswith("/") or len(value) > 300):
        raise SpecError("assignment.program", f"must be a path on the control plane, got {value!r}")
    return value


def _string(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise SpecError(f"assignment.{key}", f"must be a non-empty string, got {value!r}")
    return value


def _int(data: dict[str, Any], key: str, *, minimum: int, parent: str = "assignment") -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{parent}.{key}", f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{parent}.{key}", f"must be at least {minimum}, got {value}")
    return value


def _address(data: dict[str, Any], key: str, *, required: bool) -> str | None:
    value = data[key]
    if not required:
        if value is not None:
            raise SpecError(f"assignment.{key}", f"must be null at this end of the pipeline, got {value!r}")
        return None
    if not isinstance(value, str) or ":" not in value:
        raise SpecError(f"assignment.{key}", f'must be "host:port" of the neighbouring stage, got {value!r}')
    return value


def _neighbour(data: dict[str, Any], key: str, *, required: bool) -> tuple[str | None, tuple[str, ...]]:
    """(rank 0's address, every rank's) of a neighbour given as "host:port", or, when it is a
    tensor-parallel stage, as the list of its ranks' addresses in rank order."""
    value = data[key]
    if not isinstance(value, list):
        return _address(data, key, required=required), ()
    if not required:
        raise SpecError(f"assignment.{key}", f"must be null at this end of the pipeline, got {value!r}")
    ranks = tuple(_address({key: v}, key, required=True) or "" for v in value)
    if len(ranks) < 2 or len(set(ranks)) != len(ranks):
        raise SpecError(f"assignment.{key}", f"a list must name 2 or more distinct ranks, got {value!r}")
    return ranks[0], ranks


def _tied(value: Any, stage_index: int, num_stages: int) -> tuple[TiedPeer, ...]:
    """`[{stage_index, layer_start, layer_end, addresses: ["host:port", ...]}, ...]`: other stages, ascending."""
    field = "assignment.tied"
    if not isinstance(value, list):
        raise SpecError(field, f"must be a list of {{{', '.join(sorted(_TIED_FIELDS))}}}, got {type(value).__name__}")
    parsed: list[TiedPeer] = []
    for i, entry in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(entry, dict) or set(entry) != _TIED_FIELDS:
            raise SpecError(where, f"must have exactly the fields {', '.join(sorted(_TIED_FIELDS))}")
        index = _int(entry, "stage_index", minimum=0, parent=where)
        if index >= num_stages or index == stage_index or parsed and index <= parsed[-1].stage_index:
            raise SpecError(f"{where}.stage_index", f"must name another of the {num_stages} stages, ascending")
        start = _int(entry, "layer_start", minimum=0, parent=where)
        end = _int(entry, "layer_end", minimum=1, parent=where)
        if start >= end:
            raise SpecError(f"{where}.layer_end", f"must be above layer_start ({start}), got {end}")
        addresses = entry["addresses"]
        if not isinstance(addresses, list) or not addresses or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ) or len(set(addresses)) != len(addresses):
            raise SpecError(f"{where}.addresses", 'must list each rank\'s distinct "host:port", in rank order')
        parsed.append(TiedPeer(index, start, end, tuple(addresses)))
    return tuple(parsed)


def _certificates(value: Any, called: tuple[str | None, ...]) -> dict[str, str]:
    """address → PEM certificate, one for every address the stage calls (`called`)."""
    field = "assignment.certificates"
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object of address: PEM certificate, got {type(value).__name__}")
    needed = {address for address in called if address is not None}
    if missing := sorted(needed - set(value)):
        raise SpecError(field, f"has no certificate for {', '.join(missing)}, which this stage calls")
    for address, pem in value.items():
        try:
            check_certificate(pem)
        except ValueError as exc:
            raise SpecError(f"{field}.{address}", str(exc)) from None
    return dict(value)


def _tensor_parallel(value: Any, spec: ModelSpec) -> TensorParallelConfig | None:
    field = "assignment.tensor_parallel"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object or null, got {type(value).__name__}")
    if set(value) != _TENSOR_PARALLEL_FIELDS:
        raise SpecError(field, f"must have exactly the fields {', '.join(sorted(_TENSOR_PARALLEL_FIELDS))}")
    size = _int(value, "size", minimum=2, parent=field)
    rank = _int(value, "rank", minimum=0, parent=field)
    if rank >= size:
        raise SpecError(f"{field}.rank", f"must be below size ({size}), got {rank}")
    peers = value["peers"]
    if not isinstance(peers, list) or len(peers) != size:
        raise SpecError(f"{field}.peers", f"must list the addresses of all {size} ranks, got {peers!r}")
    for peer in peers:
        if not isinstance(peer, str) or ":" not in peer:
            raise SpecError(f"{field}.peers", f'must be "host:port" addresses, got {peer!r}')
    if len(set(peers)) != size:
        raise SpecError(f"{field}.peers", f"must be distinct addresses, got {peers!r}")
    try:
        check_tensor_parallel(spec, size)
    except SpecError as exc:
        raise SpecError(f"assignment.{exc.field}", exc.message) from exc
    return TensorParallelConfig(rank=rank, peers=tuple(peers))


def quantized_state_refusal(optimizer: str, *, tensor_parallel: bool, averaged: bool) -> str | None:
    """Why a stage cannot train with `optimizer`, or None: 8-bit Adam's moments are blockwise quantized, so they
    can neither be cut into tensor-parallel ranks' rows nor averaged between replicas that sync every few steps."""
    if optimizer != "adam8bit":
        return None
    if tensor_parallel:
        return "adam8bit keeps its moments quantized in blocks that a tensor-parallel split would cut: use adam"
    if averaged:
        return "adam8bit's quantized moments cannot be averaged between replicas that sync every few steps: use adam"
    return None


def _optimizer(value: Any) -> OptimizerConfig:
    if not isinstance(value, dict):
        raise SpecError("assignment.optimizer", f"must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - _OPTIMIZER_FIELDS)
    if unknown:
        raise SpecError(f"assignment.optimizer.{unknown[0]}", "unknown field")
    name = value.get("name")
    if name not in OPTIMIZERS:
        raise SpecError("assignment.optimizer.name", f"must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    numbers: dict[str, float] = {}
    for key, default in (("lr", None), ("momentum", 0.0), ("weight_decay", 0.0)):
        raw = value.get(key, default)
        if raw is None:
            raise SpecError(f"assignment.optimizer.{key}", "is required")
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
            raise SpecError(f"assignment.optimizer.{key}", f"must be a finite number >= 0, got {raw!r}")
        numbers[key] = float(raw)
    if numbers["lr"] <= 0:
        raise SpecError("assignment.optimizer.lr", f"must be greater than 0, got {numbers['lr']}")
    return OptimizerConfig(name=name, **numbers)


def _initial_weights(value: Any, layers: int) -> InitialWeightsRef | None:
    field = "assignment.initial_weights"
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _INITIAL_WEIGHTS_FIELDS:
        fields = ", ".join(sorted(_INITIAL_WEIGHTS_FIELDS))
        raise SpecError(field, f"must be null or an object with exactly the fields {fields}")
    url, digests = value["url"], value["layer_sha256"]
    if not isinstance(url, str) or not url.startswith("/") or len(url) > 300:
        raise SpecError(f"{field}.url", f"must be a path on the control plane, got {url!r}")
    if not isinstance(digests, list) or len(digests) != layers or not all(map(_is_sha256, digests)):
        raise SpecError(
            f"{field}.layer_sha256", f"must be a list of {layers} SHA-256s (64 lowercase hex digits), one per layer"
        )
    return InitialWeightsRef(url=url, layer_sha256=tuple(digests))


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _checkpoint(value: Any) -> CheckpointRef | None:
    field = "assignment.checkpoint"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpecError(field, f"must be an object or null, got {type(value).__name__}")
    if set(value) != _CHECKPOINT_FIELDS:
        raise SpecError(
            field, f"must have exactly the fields {', '.join(sorted(_CHECKPOINT_FIELDS))}"
        )
    step = _int(value, "step", minimum=0, parent=field)
    url = value["url"]
    if not isinstance(url, str) or not url:
        raise SpecError(f"{field}.url", f"must be a non-empty string, got {url!r}")
    sha256 = value["sha256"]
    if not _is_sha256(sha256):
        raise SpecError(f"{field}.sha256", f"must be 64 lowercase hex digits, got {sha256!r}")
    return CheckpointRef(step=step, url=url, sha256=sha256)
