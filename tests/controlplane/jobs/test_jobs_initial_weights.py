"""A job's uploaded initial weights (fine-tuning): only a model with a Hugging Face format, only before it
trains, only exactly the model's parameters; kept in the checkpoint storage, named in its assignments, and
served to the agents hosting the job only."""

from __future__ import annotations

import importlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
import torch
from django.apps import apps as django_apps
from django.utils import timezone
from rest_framework.test import APIClient
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save

from arceus.checkpoint import checkpoint_digest
from arceus.contracts.assignment import Assignment
from arceus.model.build import build_full_model, build_layers, named_global_parameters
from arceus.model.hugging_face import SHARDS_INDEX, initial_weights_layer_digests, initial_weights_slice_check
from arceus.model.llama.hf import hf_config, hf_name
from arceus.model.registry import model_spec_from_config
from arceus.safetensors_file import tensor_layouts
from controlplane.accounts.services import user_token_get_or_create
from controlplane.agents.services import node_heartbeat
from controlplane.controller.executor import reconcile_once
from controlplane.jobs.models import Job, Stage
from controlplane.jobs.services import job_start, job_submit
from controlplane.nodes.models import Node
from controlplane.nodes.services import node_token_rotate
from tests.controlplane.conftest import DIGITS_JOB
from tests.controlplane.jobs.test_jobs_checkpoints import (  # noqa: F401 (fixtures)
    agents,
    checkpoint_dir,
    download,
    s3_bucket,
)

pytestmark = pytest.mark.django_db

LLAMA = {
    "type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
    "max_position_embeddings": 8,
}


@pytest.fixture
def llama_job(user) -> Job:  # noqa: ANN001
    return job_submit(
        owner=user, **{**DIGITS_JOB, "model_config": LLAMA, "dataset_config": {"name": "text", "batch_size": 4}}
    )


def weights_file(job: Job, **changes: torch.Tensor | None) -> bytes:
    """The job's model under transformers' names (another seed's weights), with `changes` (None: left out)."""
    spec = model_spec_from_config(job.model_config)
    tensors = {hf_name(spec, n): p.detach() for n, p in named_global_parameters(build_full_model(spec, seed=11))}
    for name, value in changes.items():
        tensors.pop(name.replace("__", "."), None)
        if value is not None:
            tensors[name.replace("__", ".")] = value
    return save(tensors)


def put(api: APIClient, job: Job, data: bytes) -> dict:
    response = api.put(f"/api/jobs/{job.id}/initial-weights", data, content_type="application/octet-stream")
    return {**response.json(), "http": response.status_code}


def test_the_owner_uploads_weights_the_job_starts_from(
    api: APIClient, llama_job: Job, agents, checkpoint_dir: Path, django_capture_on_commit_callbacks  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    answer = put(api, llama_job, data)
    assert answer["http"] == 200 and answer["initial_weights_sha256"] == checkpoint_digest(data)
    llama_job.refresh_from_db()
    assert (checkpoint_dir / llama_job.initial_weights.name).read_bytes() == data
    spec = model_spec_from_config(llama_job.model_config)
    assert llama_job.initial_weights_layer_sha256 == initial_weights_layer_digests(spec, io.BytesIO(data), len(data))
    # A second upload replaces the first (and its file goes).
    first = checkpoint_dir / llama_job.initial_weights.name
    with django_capture_on_commit_callbacks(execute=True):
        assert put(api, llama_job, data)["http"] == 200
    assert not first.exists()

    job_start(job=llama_job)
    reconcile_once()
    assert put(api, llama_job, data)["http"] == 409  # started: too late


def query(url: str, params: dict) -> str:
    return f"{url}?{urlencode(params)}"


def stage_slice(client: APIClient, raw: dict) -> tuple[bytes, Assignment]:  # noqa: F811
    """What a hosting agent downloads for an assignment of its: its layers of the initial weights, checked."""
    assignment = Assignment.from_json(raw)
    ref, start, end = assignment.initial_weights, assignment.layer_start, assignment.layer_end
    assert ref is not None and raw["checkpoint"] is None
    response = download(client, query(ref.url, {"start": start, "end": end}))
    assert response.status_code == 200, response.content
    assert int(response["Content-Length"]) == len(response.body)
    initial_weights_slice_check(io.BytesIO(response.body), len(response.body), start, ref.layer_sha256)
    return response.body, assignment


def test_each_hosting_agent_downloads_only_its_stages_layers_under_the_pipelines_names(
    api: APIClient, llama_job: Job, agents, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    job_start(job=llama_job)
    reconcile_once()
    spec = model_spec_from_config(llama_job.model_config)
    uploaded = safetensors_load(data)
    received: list[str] = []
    for _, client in agents:
        for raw in client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]:
            body, assignment = stage_slice(client, raw)
            assert len(body) < len(data)
            tensors = safetensors_load(body)
            stage = build_layers(spec, assignment.layer_start, assignment.layer_end, seed=0)
            assert sorted(tensors) == sorted(n for n, _ in named_global_parameters(stage))
            for name, tensor in tensors.items():
                assert torch.equal(tensor, uploaded[hf_name(spec, name)]), name
            received += tensors
    assert len(received) == len(set(received)) == len(uploaded)


def test_only_a_host_of_those_layers_gets_them_and_a_bad_range_is_named(
    api: APIClient, user, agents, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    llama_job = job_submit(
        owner=user,
        **{**DIGITS_JOB, "model_config": LLAMA, "dataset_config": {"name": "text", "batch_size": 4}, "stages": 2},
    )
    assert put(api, llama_job, weights_file(llama_job))["http"] == 200
    job_start(job=llama_job)
    reconcile_once()
    url = f"/api/agent/jobs/{llama_job.id}/initial-weights"
    stages = {str(s.node_id): s for s in llama_job.stages.filter(active=True)}
    hosts = [(stages[str(n.id)], c) for n, c in agents if str(n.id) in stages]
    idle = [c for n, c in agents if str(n.id) not in stages]
    assert len(hosts) == 2 and len(idle) == 1
    (stage, host), (other, _) = hosts[0], hosts[1]
    ok = {"start": stage.layer_start, "end": stage.layer_end}
    for client in idle:  # a node hosting none of the job's stages learns nothing, not even what it asked wrong
        assert download(client, query(url, ok)).status_code == 404
        assert download(client, query(url, {"start": "x"})).status_code == 404
    assert download(host, query(f"/api/agent/jobs/{uuid.uuid4()}/initial-weights", ok)).status_code == 404
    for params, field, message in [
        ({"end": stage.layer_end}, "start", "must be a layer index"),
        ({**ok, "start": "-1"}, "start", "must be a layer index"),
        ({**ok, "end": "1e3"}, "end", "must be a layer index"),
        ({"start": stage.layer_end, "end": stage.layer_start}, "end", "must be above start"),
        ({"start": 0, "end": 99}, "end", "the model has 4 layers"),
    ]:
        response = host.get(url, params)
        assert response.status_code == 400 and message in response.json()["errors"][field][0], (params, response.json())
    other_layers = {"start": other.layer_start, "end": other.layer_end}
    assert download(host, query(url, other_layers)).status_code == 404  # another stage's layers
    assert download(host, query(url, ok)).status_code == 200
    Stage.objects.filter(pk=stage.pk).update(generation=stage.generation - 1)  # no longer the current generation
    assert download(host, query(url, ok)).status_code == 404


def test_uploaded_weights_in_an_s3_bucket_are_read_by_range(
    api: APIClient, llama_job: Job, agents, s3_bucket  # noqa: ANN001, F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    llama_job.refresh_from_db()
    assert [o["Key"] for o in s3_bucket.list_objects_v2(Bucket="arceus-checkpoints")["Contents"]] == [
        llama_job.initial_weights.name
    ]
    job_start(job=llama_job)
    for node, _ in agents:  # the upload took seconds on a busy machine: the nodes are still alive
        node_heartbeat(node=node, observed=[], now=timezone.now())
    reconcile_once()
    client = next(c for n, c in agents if llama_job.stages.filter(node=n, active=True, index=0).exists())
    [raw] = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
    body, assignment = stage_slice(client, raw)
    stage = build_layers(model_spec_from_config(llama_job.model_config), 0, assignment.layer_end, seed=0)
    assert len(body) < len(data)
    assert sorted(safetensors_load(body)) == sorted(n for n, _ in named_global_parameters(stage))


# Peak memory of a process from a point on: /proc's VmHWM set back to what it holds now (clear_refs 5), then read.
_PEAK = """
import re
def status(field): return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
def peak_from_now():
    open("/proc/self/clear_refs", "w").write("5")
    return status("VmRSS")
"""

# A random ~1B Llama as transformers ships one, written shard by shard (this process never holds more than one).
_SHIPPED = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
folder, shards = Path(sys.argv[1]), json.loads(sys.argv[2])
generator = torch.Generator().manual_seed(5)
for file, shapes in shards.items():
    save_file({n: torch.randn(s, generator=generator, dtype=torch.bfloat16) * 0.02 for n, s in shapes.items()},
              folder / file)
"""

# The uploader: `arceus jobs weights JOB FOLDER`; prints its peak's growth over what it held after its imports.
_UPLOADER = _PEAK + """
import sys
from arceus.cli import main
before = peak_from_now()
code = main(sys.argv[1:])
print(status("VmHWM") - before, code)
"""

# An agent building its stage of an assignment from the job's initial weights as agents do (build_hosted_stage with
# the control plane client's fetch); prints its peak's growth and its stage's parameters' sums.
_AGENT = _PEAK + """
import json, sys, torch
from arceus.contracts.assignment import Assignment
from arceus.model.build import named_global_parameters
from nodeagent.control_plane import ControlPlaneClient
from nodeagent.stage import build_hosted_stage
url, token, raw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
fetch = ControlPlaneClient(url, token, timeout=300).fetch_initial_weights
before = peak_from_now()
stage = build_hosted_stage(Assignment.from_json(raw), torch.device("cpu"), max_message_bytes=4 << 20,
                           load_initial_weights=fetch)
grown = status("VmHWM") - before
sums = {n: p.double().sum().item() for n, p in named_global_parameters(stage.runtime.layers)}
print(json.dumps({"grown": grown, "sums": sums}))
"""


def peak_from_now() -> int:
    """This process's VmRSS, its VmHWM set back to it (what the process holds from now on is measured against it)."""
    Path("/proc/self/clear_refs").write_text("5")
    return vm_bytes("VmRSS")


def vm_bytes(field: str) -> int:
    return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


@pytest.fixture
def emptied_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, emptied once the test ends: pytest keeps the last runs' folders, and this one fills 4 GB."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_random_1b_llama_shipped_sharded_in_bf16_imports_with_no_process_holding_more_than_a_stage(
    live_server, user, agents, emptied_tmp_path: Path, checkpoint_dir: Path,  # noqa: ANN001, F811
    record_property: Callable[[str, object], None],
) -> None:
    """A Llama of 0.97B parameters (22 decoder layers of width 2048, 4 key/value heads), random, saved as
    transformers ships one (bf16, sharded, with its index): `arceus jobs weights` uploads it, the job's three
    agents each build their stage from it. The uploader, the web server (this process) and each agent hold at most
    one stage's tensors at their peak (VmHWM): the uploader and the web server less than the smallest stage's bf16
    bytes, an agent its stage's float32 weights and what its code takes beside them."""
    job = job_submit(owner=user, **{**DIGITS_JOB, "dataset_config": {"name": "text", "batch_size": 4}, "model_config": {
        "type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
        "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 8,
    }})
    spec = model_spec_from_config(job.model_config)
    shapes = {n: spec.layer_parameters(i)[n.split(".", 2)[2]]
              for i in range(spec.num_layers) for n in (f"layers.{i}.{p}" for p in spec.layer_parameters(i))}
    parameters = sum(math.prod(s) for s in shapes.values())
    assert 0.95e9 < parameters < 1.05e9
    shards: dict[str, dict[str, list[int]]] = {}
    filled = 0
    for name, shape in shapes.items():  # shards of about 400 MB, as save_pretrained(max_shard_size=...) cuts
        if not shards or filled > 400e6:
            shard, filled = shards.setdefault(f"model-{len(shards) + 1:05d}", {}), 0
        shard[hf_name(spec, name)] = shape
        filled += math.prod(shape) * 2
    shards = {f"{stem}-of-{len(shards):05d}.safetensors": tensors for stem, tensors in shards.items()}
    folder = emptied_tmp_path / "shipped"
    folder.mkdir()
    subprocess.run([sys.executable, "-c", _SHIPPED, str(folder), json.dumps(shards)], check=True, timeout=600)
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (folder / SHARDS_INDEX).write_text(json.dumps({"metadata": {"total_size": 2 * parameters},
                                                   "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**hf_config(spec), "torch_dtype": "bfloat16"}))

    for node, _ in agents:  # room for a third of the model each
        Node.objects.filter(pk=node.pk).update(memory_bytes=64 << 30)
    server_before = peak_from_now()
    argv = ["--url", live_server.url, "--token", user_token_get_or_create(user=user), "jobs", "weights", str(job.id),
            str(folder)]
    run = subprocess.run([sys.executable, "-c", _UPLOADER, *argv], capture_output=True, text=True, timeout=600)
    uploader_grown, code = (int(v) for v in run.stdout.split()[-2:])
    assert code == 0, run.stdout + run.stderr
    job.refresh_from_db()
    stored = checkpoint_dir / job.initial_weights.name
    with stored.open("rb") as handle:  # one file of exactly the shards' tensors, kept in bf16
        layouts = tensor_layouts(handle, stored.stat().st_size)
    assert set(layouts) == set(weight_map) and {dtype for dtype, _ in layouts.values()} == {"BF16"}

    job_start(job=job)
    for node, _ in agents:  # the upload took a while: the nodes are still alive
        node_heartbeat(node=node, observed=[], now=timezone.now())
    reconcile_once()
    hosts = []
    for node, client in agents:
        [raw] = client.post("/api/agent/heartbeat", {"observed": []}, format="json").json()["assignments"]
        token = node_token_rotate(node=node, user=user)
        hosts.append((raw, subprocess.Popen([sys.executable, "-c", _AGENT, live_server.url, token, json.dumps(raw)],
                                            stdout=subprocess.PIPE, text=True)))
    built = [(raw, json.loads(agent.communicate(timeout=600)[0].splitlines()[-1])) for raw, agent in hosts]
    assert all(agent.returncode == 0 for _, agent in hosts)
    server_grown = vm_bytes("VmHWM") - server_before

    stage_layers = [range(raw["layer_start"], raw["layer_end"]) for raw, _ in built]
    assert sorted(i for layers in stage_layers for i in layers) == list(range(spec.num_layers))  # three stages, whole
    stage_bytes = [sum(math.prod(s) for n, s in shapes.items() if int(n.split(".")[1]) in layers) * 4
                   for layers in stage_layers]  # float32, as a stage holds them
    figures = f"uploader +{uploader_grown >> 20} MiB, web server +{server_grown >> 20} MiB, agents " + ", ".join(
        f"+{b['grown'] >> 20} MiB (stage {s >> 20} MiB)" for (_, b), s in zip(built, stage_bytes, strict=True))
    print(figures)
    record_property("peaks", figures)
    smallest_stage_bf16 = min(stage_bytes) // 2
    assert uploader_grown < smallest_stage_bf16 and server_grown < smallest_stage_bf16, figures
    for (raw, agent), held in zip(built, stage_bytes, strict=True):
        # Beside its tensors, what its code takes (torch's first use, its optimizer's imports, one tensor read in
        # bf16 at a time): 82 MiB on a 2 MiB stage, 130-174 MiB beside these stages of 1176-1344 MiB in two runs.
        assert agent["grown"] < held + (256 << 20), figures
        with safe_open(str(folder / weight_map[hf_name(spec, name := next(iter(agent["sums"])))]), "pt") as shard:
            want = shard.get_tensor(hf_name(spec, name)).double().sum().item()
        assert agent["sums"][name] == pytest.approx(want, rel=1e-9, abs=1e-9), (raw["layer_start"], name)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lm_head__weight": None}, "the weights lack lm_head.weight"),
        ({"extra__weight": torch.zeros(2)}, "extra.weight is no parameter of this model"),
        ({"model__norm__weight": torch.ones(17)}, "model.norm.weight is float32 [17]; the model's is float32 [16]"),
        ({"model__norm__weight": torch.ones(16, dtype=torch.float64)},  # bf16, fp16 widen to it; nothing else
         "model.norm.weight is float64 [16]; the model's is float32 [16] (or bfloat16, float16)"),
    ],
)
def test_weights_that_are_not_exactly_the_models_are_refused_and_not_kept(
    api: APIClient, llama_job: Job, checkpoint_dir: Path, changes: dict, message: str  # noqa: F811
) -> None:
    answer = put(api, llama_job, weights_file(llama_job, **changes))
    assert answer["http"] == 400 and message in answer["errors"]["body"][0]
    assert not any(p.is_file() for p in checkpoint_dir.rglob("*"))
    assert put(api, llama_job, b"not safetensors")["http"] == 400


def test_a_model_without_a_hugging_face_format_and_anothers_job_are_refused(
    api: APIClient, other_api: APIClient, user, llama_job: Job, checkpoint_dir: Path  # noqa: ANN001, F811
) -> None:
    mlp = job_submit(owner=user, **DIGITS_JOB)
    answer = put(api, mlp, b"x")
    assert answer["http"] == 400 and "a model of type 'mlp' cannot start from uploaded weights" in answer["detail"]
    assert put(other_api, llama_job, weights_file(llama_job))["http"] == 404


def test_weights_uploaded_before_layer_digests_get_them_when_migrating(
    api: APIClient, llama_job: Job, checkpoint_dir: Path  # noqa: F811
) -> None:
    data = weights_file(llama_job)
    assert put(api, llama_job, data)["http"] == 200
    llama_job.refresh_from_db()
    kept = llama_job.initial_weights_layer_sha256
    Job.objects.filter(pk=llama_job.pk).update(initial_weights_layer_sha256=[])
    migration = importlib.import_module("controlplane.jobs.migrations.0014_job_initial_weights_layer_sha256")
    migration.digest_uploaded_weights(django_apps, None)
    llama_job.refresh_from_db()
    assert llama_job.initial_weights_layer_sha256 == kept and len(kept) == 4
