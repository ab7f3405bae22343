from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from arceus.contracts.assignment import Assignment, CheckpointRef, InitialWeightsRef, OptimizerConfig
from arceus.errors import SpecError
from devtools.pipeline import certificates_for, pipeline_assignments, rank_credentials
from nodeagent.static import load_static_assignments


def assignment(**changes: Any) -> dict[str, Any]:
    data = {
        "stage_id": "job-stage-1",
        "job_id": "job",
        "stage_index": 1,
        "num_stages": 3,
        "generation": 2,
        "model": {"type": "mlp", "layer_sizes": [64, 128, 64, 10]},
        "layer_start": 1,
        "layer_end": 2,
        "seed": 0,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        "micro_batches": 4,
        "max_micro_batch_size": 64,
        "prev_address": "127.0.0.1:5000",
        "next_address": "127.0.0.1:5002",
        "credentials": rank_credentials("job", 2, 1, 0, [1, 1, 1]).to_json(),
        # Every address any variant below calls.
        "certificates": certificates_for(["127.0.0.1:5000", "127.0.0.1:5002", "a:1", "b:1", *PEERS, "c:1"]),
    }
    data.update(changes)
    return data


def test_parse_a_valid_assignment() -> None:
    a = Assignment.from_json(assignment())
    assert (a.stage_index, a.layer_start, a.layer_end, a.generation) == (1, 1, 2, 2)
    assert a.optimizer == OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.0)
    assert not a.is_first and not a.is_last
    assert a.spec.num_layers == 3
    assert Assignment.from_json(a.to_json()) == a
    assert a.schedule == "gpipe"  # without one: the schedule that holds the most, which the budget is checked for
    assert Assignment.from_json(assignment(schedule="1f1b")).schedule == "1f1b"


def test_optimizer_defaults() -> None:
    a = Assignment.from_json(assignment(optimizer={"name": "adam", "lr": 1e-3}))
    assert a.optimizer == OptimizerConfig(name="adam", lr=1e-3, momentum=0.0, weight_decay=0.0)


def test_first_and_last_stages() -> None:
    first = Assignment.from_json(assignment(stage_index=0, layer_start=0, layer_end=1, prev_address=None))
    last = Assignment.from_json(assignment(stage_index=2, layer_start=2, layer_end=3, next_address=None))
    assert first.is_first and last.is_last


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"stage_id": ""}, "assignment.stage_id", "non-empty string"),
        ({"stage_index": 3}, "assignment.stage_index", "below num_stages (3)"),
        ({"generation": -1}, "assignment.generation", "at least 0"),
        ({"seed": "0"}, "assignment.seed", "must be an integer"),
        ({"micro_batches": True}, "assignment.micro_batches", "must be an integer"),
        ({"max_micro_batch_size": 0}, "assignment.max_micro_batch_size", "at least 1"),
        ({"layer_end": 4}, "assignment.layer_end", "inside the model's 3 layers"),
        ({"layer_start": 2, "layer_end": 2}, "assignment.layer_end", "non-empty"),
        (
            {"stage_index": 0, "prev_address": None},
            "assignment.layer_start",
            "first stage must start at layer 0",
        ),
        ({"stage_index": 2, "next_address": None}, "assignment.layer_end", "last stage must end at layer 3"),
        ({"prev_address": None}, "assignment.prev_address", '"host:port" of the neighbouring stage'),
        ({"next_address": "nohost"}, "assignment.next_address", "host:port"),
        ({"model": {"layer_sizes": [64]}}, "assignment.model.layer_sizes", "at least 2 entries"),
        ({"optimizer": {"name": "rmsprop", "lr": 0.1}}, "assignment.optimizer.name", "sgd, adam, adam8bit"),
        ({"optimizer": {"name": "sgd"}}, "assignment.optimizer.lr", "is required"),
        ({"optimizer": {"name": "sgd", "lr": 0}}, "assignment.optimizer.lr", "greater than 0"),
        ({"optimizer": {"name": "sgd", "lr": 0.1, "momentum": -1}}, "assignment.optimizer.momentum", ">= 0"),
        (
            {"optimizer": {"name": "sgd", "lr": 0.1, "nesterov": True}},
            "assignment.optimizer.nesterov",
            "unknown",
        ),
        ({"extra": 1}, "assignment.extra", "unknown field"),
        ({"precision": "fp16"}, "assignment.precision", "one of fp32, bf16"),
        ({"activation_checkpointing": "yes"}, "assignment.activation_checkpointing", "true or false"),
        ({"schedule": "zigzag"}, "assignment.schedule", "one of gpipe, 1f1b"),
    ],
)
def test_invalid_assignments(changes: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(assignment(**changes))
    assert info.value.field == field
    assert fragment in info.value.message


def test_missing_fields_are_listed() -> None:
    data = assignment()
    del data["seed"], data["job_id"]
    with pytest.raises(SpecError, match="missing: job_id, seed"):
        Assignment.from_json(data)
    with pytest.raises(SpecError, match="must be a JSON object"):
        Assignment.from_json(["job"])


GPT = {"type": "transformer", "n_layer": 2, "n_head": 8, "d_model": 32, "block_size": 6, "vocab_size": 10}
PEERS = ["10.0.0.1:5001", "10.0.0.2:5001"]


def tensor_parallel(**changes: Any) -> dict[str, Any]:
    """An assignment of rank 1 of a 2-way split GPT stage 1 (blocks 1-2), whose neighbours are split too."""
    split = {"rank": 1, "size": 2, "peers": PEERS, **changes.pop("split", {})}
    data = assignment(model=GPT, layer_end=3, tensor_parallel=split, prev_address=["a:1", "b:1"])
    data.update(changes)
    return data


def test_a_tensor_parallel_rank() -> None:
    a = Assignment.from_json(tensor_parallel())
    assert a.tensor_parallel is not None and (a.tensor_parallel.rank, a.tensor_parallel.size) == (1, 2)
    assert a.tensor_parallel.peers == tuple(PEERS) and not a.sends_on
    assert (a.prev_address, a.prev_addresses) == ("a:1", ("a:1", "b:1"))
    assert a.next_addresses == ("127.0.0.1:5002",)
    assert Assignment.from_json(a.to_json()) == a
    mixed = Assignment.from_json(tensor_parallel(precision="bf16"))
    assert (mixed.precision, mixed.tensor_parallel) == ("bf16", a.tensor_parallel)
    plain = Assignment.from_json(assignment())
    assert plain.sends_on and plain.tensor_parallel is None and "tensor_parallel" not in plain.to_json()


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"split": {"rank": 2}}, "assignment.tensor_parallel.rank", "below size (2)"),
        ({"split": {"size": 1, "peers": PEERS[:1], "rank": 0}}, "assignment.tensor_parallel.size", "at least 2"),
        ({"split": {"size": 3}}, "assignment.tensor_parallel.peers", "all 3 ranks"),
        ({"split": {"peers": [PEERS[0], PEERS[0]]}}, "assignment.tensor_parallel.peers", "distinct"),
        ({"split": {"peers": [PEERS[0], "nohost"]}}, "assignment.tensor_parallel.peers", "host:port"),
        ({"split": {"size": 3, "peers": [*PEERS, "c:1"]}}, "assignment.tensor_parallel.size", "n_head (8)"),
        ({"split": {"extra": 1}}, "assignment.tensor_parallel", "exactly the fields"),
        ({"tensor_parallel": [0, 2]}, "assignment.tensor_parallel", "an object or null"),
        (
            {"model": {"type": "mlp", "layer_sizes": [8, 8, 8, 2]}},
            "assignment.tensor_parallel",
            "only a transformer",
        ),
        ({"prev_address": ["a:1"]}, "assignment.prev_address", "2 or more distinct ranks"),
        ({"activation_checkpointing": True}, "assignment.activation_checkpointing", "cannot recompute"),
        (
            {"optimizer": {"name": "adam8bit", "lr": 0.1}},
            "assignment.optimizer.name",
            "adam8bit keeps its moments quantized in blocks that a tensor-parallel split would cut",
        ),
        ({"prev_address": ["a:1", "a:1"]}, "assignment.prev_address", "2 or more distinct ranks"),
        ({"prev_address": ["a:1", 5]}, "assignment.prev_address", "host:port"),
        (
            {"stage_index": 2, "layer_start": 1, "layer_end": 4, "next_address": ["a:1", "b:1"]},
            "assignment.next_address",
            "must be null",
        ),
    ],
)
def test_invalid_tensor_parallel_assignments(changes: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(tensor_parallel(**changes))
    assert info.value.field == field
    assert fragment in info.value.message


def test_an_inference_assignment_is_one_agent_and_says_so() -> None:
    served = Assignment.from_json(assignment(inference=True))
    assert served.inference and Assignment.from_json(served.to_json()) == served
    assert "inference" not in Assignment.from_json(assignment()).to_json()  # a training stage's JSON is unchanged
    with pytest.raises(SpecError, match="true or false"):
        Assignment.from_json(assignment(inference="yes"))
    with pytest.raises(SpecError) as info:
        Assignment.from_json(tensor_parallel(inference=True))
    assert (info.value.field, info.value.message) == (
        "assignment.inference", "a stage served for inference is one agent, never tensor-parallel"
    )


SHA = "0123456789abcdef" * 4
CHECKPOINT = {"step": 40, "url": "/api/agent/checkpoints/7", "sha256": SHA}


def test_the_checkpoint_field_is_optional() -> None:
    absent = Assignment.from_json(assignment())
    assert absent.checkpoint is None
    assert absent.to_json()["checkpoint"] is None
    assert Assignment.from_json(assignment(checkpoint=None)) == absent
    resumed = Assignment.from_json(assignment(checkpoint=CHECKPOINT))
    assert resumed.checkpoint == CheckpointRef(step=40, url="/api/agent/checkpoints/7", sha256=SHA)
    assert resumed.to_json()["checkpoint"] == CHECKPOINT
    assert Assignment.from_json(resumed.to_json()) == resumed
    assert Assignment.from_json(assignment(checkpoint={**CHECKPOINT, "step": 0})).checkpoint.step == 0


@pytest.mark.parametrize(
    ("checkpoint", "field", "fragment"),
    [
        ("/api/agent/checkpoints/7", "assignment.checkpoint", "must be an object or null, got str"),
        ([CHECKPOINT], "assignment.checkpoint", "must be an object or null, got list"),
        ({"step": 40, "url": "/x"}, "assignment.checkpoint", "exactly the fields sha256, step, url"),
        ({**CHECKPOINT, "size": 10}, "assignment.checkpoint", "exactly the fields sha256, step, url"),
        ({**CHECKPOINT, "step": -1}, "assignment.checkpoint.step", "at least 0"),
        ({**CHECKPOINT, "step": "40"}, "assignment.checkpoint.step", "must be an integer"),
        ({**CHECKPOINT, "step": True}, "assignment.checkpoint.step", "must be an integer"),
        ({**CHECKPOINT, "url": ""}, "assignment.checkpoint.url", "non-empty string"),
        ({**CHECKPOINT, "url": None}, "assignment.checkpoint.url", "non-empty string"),
        ({**CHECKPOINT, "sha256": SHA[:-1]}, "assignment.checkpoint.sha256", "64 lowercase hex digits"),
        ({**CHECKPOINT, "sha256": SHA.upper()}, "assignment.checkpoint.sha256", "64 lowercase hex digits"),
        ({**CHECKPOINT, "sha256": "g" * 64}, "assignment.checkpoint.sha256", "64 lowercase hex digits"),
        ({**CHECKPOINT, "sha256": 5}, "assignment.checkpoint.sha256", "64 lowercase hex digits"),
    ],
)
def test_invalid_checkpoints_name_the_field(checkpoint: Any, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(assignment(checkpoint=checkpoint))
    assert info.value.field == field
    assert fragment in info.value.message


INITIAL = {"url": "/api/agent/jobs/j/initial-weights", "layer_sha256": [SHA]}  # layers [1, 2): one digest


def test_the_initial_weights_name_where_the_stages_layers_are_and_each_layers_digest() -> None:
    parsed = Assignment.from_json(assignment(initial_weights=INITIAL))
    assert parsed.initial_weights == InitialWeightsRef(url=INITIAL["url"], layer_sha256=(SHA,))
    assert parsed.to_json()["initial_weights"] == INITIAL
    assert Assignment.from_json(assignment(initial_weights=None)).initial_weights is None


@pytest.mark.parametrize(
    ("initial", "field", "fragment"),
    [
        ({**INITIAL, "sha256": SHA}, "assignment.initial_weights", "exactly the fields layer_sha256, url"),
        ([INITIAL], "assignment.initial_weights", "exactly the fields layer_sha256, url"),
        ({**INITIAL, "url": "https://elsewhere/w"}, "assignment.initial_weights.url", "a path on the control plane"),
        ({**INITIAL, "layer_sha256": [SHA, SHA]}, "assignment.initial_weights.layer_sha256", "list of 1 SHA-256s"),
        ({**INITIAL, "layer_sha256": [SHA.upper()]}, "assignment.initial_weights.layer_sha256", "one per layer"),
        ({**INITIAL, "layer_sha256": SHA}, "assignment.initial_weights.layer_sha256", "one per layer"),
    ],
)
def test_invalid_initial_weights_name_the_field(initial: Any, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(assignment(initial_weights=initial))
    assert info.value.field == field and fragment in info.value.message


def test_static_assignment_file(tmp_path: Path) -> None:
    stages = pipeline_assignments(
        job_id="j",
        model_config={"layer_sizes": [8, 4, 2]},
        boundaries=[0, 1, 2],
        addresses=["h:1", "h:2"],
        optimizer={"name": "sgd", "lr": 0.1},
        seed=3,
        micro_batches=2,
        max_micro_batch_size=8,
    )
    path = tmp_path / "static.json"
    path.write_text(json.dumps(stages))
    parsed = load_static_assignments(path)
    assert [(a.stage_id, a.prev_address, a.next_address) for a in parsed] == [
        ("j-stage-0", None, "h:2"),
        ("j-stage-1", "h:1", None),
    ]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{", "is not valid JSON"),
        ('{"stage_id": "x"}', "must hold a JSON list"),
        ('[{"stage_id": "x"}]', "is required"),
    ],
)
def test_invalid_static_files(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "static.json"
    path.write_text(content)
    with pytest.raises(SpecError, match=fragment) as info:
        load_static_assignments(path)
    assert info.value.field.startswith("static_assignment")
    with pytest.raises(SpecError, match="cannot read"):
        load_static_assignments(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"certificates": {}}, "assignment.certificates", "no certificate for 127.0.0.1:5000, 127.0.0.1:5002"),
        (
            {"certificates": {"127.0.0.1:5000": "x", "127.0.0.1:5002": "y"}},
            "assignment.certificates.127.0.0.1:5000",
            "PEM certificate",
        ),
        ({"certificates": ["127.0.0.1:5000"]}, "assignment.certificates", "address: PEM certificate"),
        ({"credentials": {"token": "abc", "accepts": {}}}, "assignment.credentials.token", "64 lowercase hex"),
        ({"credentials": {"token": "a" * 64}}, "assignment.credentials", "with `token`, `accepts` and, for a replica"),
        ({"credentials": {"token": "a" * 64, "accepts": {"x": []}}}, "assignment.credentials.accepts.x", "no role"),
        ({"credentials": {"token": "a" * 64, "accepts": {}}}, "assignment.credentials.accepts.driver", "required"),
        (
            {"credentials": {"token": "a" * 64, "accepts": {"driver": ["not-a-digest"]}}},
            "assignment.credentials.accepts.driver",
            "SHA-256 digests",
        ),
    ],
)
def test_invalid_credentials_and_certificates_name_the_field(
    changes: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(assignment(**changes))
    assert (info.value.field, fragment in info.value.message) == (field, True), info.value.message


def test_a_stage_sharing_tied_weights_names_the_other_stages_layers_and_ranks() -> None:
    tied = [{"stage_index": 2, "layer_start": 2, "layer_end": 3, "addresses": ["c:1"]}]
    a = Assignment.from_json(assignment(tied=tied))
    assert a.tied[0].stage_index == 2 and a.tied[0].addresses == ("c:1",)
    assert Assignment.from_json(a.to_json()) == a
    assert "tied" not in Assignment.from_json(assignment()).to_json()  # sharing none: no field


@pytest.mark.parametrize(
    ("tied", "field", "fragment"),
    [
        ({"stage_index": 2}, "assignment.tied", "must be a list"),
        ([{"stage_index": 2, "addresses": ["c:1"]}], "assignment.tied[0]", "exactly the fields"),
        ([{"stage_index": 1, "layer_start": 1, "layer_end": 2, "addresses": ["c:1"]}], "assignment.tied[0].stage_index",
         "another of the 3 stages"),
        ([{"stage_index": 3, "layer_start": 2, "layer_end": 3, "addresses": ["c:1"]}], "assignment.tied[0].stage_index",
         "another of the 3 stages"),
        ([{"stage_index": 2, "layer_start": 3, "layer_end": 3, "addresses": ["c:1"]}], "assignment.tied[0].layer_end",
         "above layer_start"),
        ([{"stage_index": 2, "layer_start": 2, "layer_end": 3, "addresses": []}], "assignment.tied[0].addresses",
         "host:port"),
        ([{"stage_index": 2, "layer_start": 2, "layer_end": 3, "addresses": ["d:1"]}], "assignment.certificates",
         "no certificate for d:1"),
    ],
)
def test_invalid_tied_peers_name_the_field(tied: Any, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        Assignment.from_json(assignment(tied=tied))
    assert info.value.field == field and fragment in info.value.message
