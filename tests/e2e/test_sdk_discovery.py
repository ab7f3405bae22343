"""Discovery on a local network, and the `DistributedTrainer` of the README, against real agents.

Two network namespaces on one bridge stand for two machines of a LAN (devtools.netns.Lan): in the first, a web
server of the control plane (the shared cluster's database and broker bridged in) and its mDNS advertiser; in
the second, three agents started without `--control-plane` and the developer's script, given only an API token.
The agents find the control plane by mDNS and register through the URL they found; the script's trainer finds
it the same way, sees the three ready devices, and trains a GPT partitioned "hybrid" (two pipeline stages, the
second a tensor-parallel pair) like one process does; `trainer.model` holds the job's trained weights. A second
run of the script is interrupted with SIGINT: its job is cancelled. The script starts with SIGINT ignored, as a
service manager or `cmd &` from a script starts a program, whatever the disposition of the suite itself.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from safetensors.torch import load, load_file

from arceus.data.text_config import BUNDLED_TEXT
from arceus.discovery import ADVERTISING_PREFIX
from arceus.sdk import TOKEN_ENV, URL_ENV
from devtools.cluster import REPO_ROOT, LocalCluster, free_port
from devtools.netns import Lan
from devtools.reference import reference_run
from nodeagent.node_token import TOKEN_ENV as NODE_TOKEN_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = {"type": "transformer", "n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16}
FIELDS = {"learning_rate": 0.003, "optimizer": "adam", "micro_batches": 2, "seed": 7,
          "requirements": {"owner_diversity": False}}  # the three agents are one owner's
SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]  # runs the rest with SIGINT ignored, as inherited


@pytest.fixture
def lan() -> Iterator[Lan]:
    made = Lan(f"d{secrets.token_hex(3)}", random.randrange(1024, 65000), hosts=2)
    try:
        yield made
    finally:
        made.close()


def line(process: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The rest of the first stdout line starting with `prefix` (fails on exit or after `timeout` s)."""
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        text = process.stdout.readline()
        if text.startswith(prefix):
            return text[len(prefix):].strip()
        if not text and process.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line (exit {process.poll()})")


def test_agents_and_the_trainer_find_the_control_plane_by_mdns_and_train_like_one_process(
    cluster: LocalCluster, lan: Lan, tmp_path: Path
) -> None:
    server, home = lan.namespaces
    server_address, home_address = lan.addresses
    for url in (cluster.env["DATABASE_URL"], cluster.env["REDIS_URL"]):
        server.bridge(urlsplit(url).port or 0)
    web = f"{server_address}:{free_port()}"
    url = cluster.start_web("web-lan", web, prefix=server.command([]),
                            env={"ARCEUS_ALLOWED_HOSTS": f"localhost,127.0.0.1,{server_address}"})
    env = {k: v for k, v in cluster.env.items() if k != URL_ENV}
    env[TOKEN_ENV] = cluster.client.session.headers["Authorization"].removeprefix("Token ")
    # Nothing advertised yet: the agent and the SDK say what they tried and how to go on.
    sdk = "from arceus import DistributedTrainer; DistributedTrainer(model={}).discover_peers()"
    unset = {**env, "XDG_CONFIG_HOME": str(tmp_path), NODE_TOKEN_ENV: "a-node-token"}  # no settings file
    lost = {hint: subprocess.Popen(home.command(argv), env=unset,
                                   cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
            for hint, argv in (("with --control-plane URL", [sys.executable, "-m", "nodeagent"]),
                               (f"pass url=... or set {URL_ENV}", [sys.executable, "-c", sdk]))}
    for hint, process in lost.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode != 0
        assert "no control plane answered an mDNS query for _arceus._tcp.local." in stderr and hint in stderr, stderr
    advertiser = cluster.supervisor.start(
        "advertise", server.command([sys.executable, "-m", "arceus.discovery", "advertise", "--url", url]),
        env=cluster.env, cwd=REPO_ROOT)
    try:
        cluster.supervisor.wait_for_log_line(advertiser, ADVERTISING_PREFIX, timeout=30)
        agents = [cluster.start_agents([f"lan-{i}"], "--listen", f"0.0.0.0:{p}", "--advertise", f"{home_address}:{p}",
                                       prefix=home.command([]), discover=True)[0]
                  for i, p in enumerate(free_port() for _ in range(3))]
        for agent in agents:  # each registered through the URL it found
            assert f"found the control plane {url} on the local network" in agent.child.log_path.read_text()
        nodes = {n["id"]: n for n in cluster.client.nodes()}
        assert {nodes[a.node_id]["grpc_address"].rpartition(":")[0] for a in agents} == {home_address}

        source = tmp_path / "genesis.txt"
        source.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
        dataset = {"name": "text", "source": cluster.add_data_file(source), "batch_size": 16, "val_batch_size": 64}
        job = json.dumps({"model_config": MODEL, "dataset_config": dataset, **FIELDS})
        trained = tmp_path / "trained.safetensors"
        script = subprocess.Popen(
            home.command([*SIGINT_IGNORED, sys.executable, "-m", "tests.e2e.trainer_in_namespace", job, str(trained),
                          "--again"]),
            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        try:
            peers = json.loads(line(script, "PEERS", 60))
            assert peers["url"] == url and peers["found_by"].endswith("._arceus._tcp.local.")
            assert peers["ready_devices"] == 3

            result = json.loads(line(script, "TRAINED", 240))
            final = cluster.client.job(result["job_id"])
            assert final["status"] == "succeeded"
            assert final["tensor_parallel"] == {"size": 2, "stages": [1]} and final["checkpoint_interval_steps"] == 5
            assert [(p["stage_index"], p["rank"]) for p in final["placements"]] == [(0, 0), (1, 0), (1, 1)]
            assert {p["node_id"] for p in final["placements"]} == {a.node_id for a in agents}
            expected = reference_run({**FIELDS, "epochs": 1, "model_config": final["model_config"],
                                      "dataset_config": final["dataset_config"]})
            assert result["steps"] == len(expected.losses) == len(result["losses"]) > 5
            for step, (got, want) in enumerate(zip(result["losses"], expected.losses, strict=True), 1):
                assert math.isclose(got, want, rel_tol=1e-5), f"step {step}: {got!r} != single-process {want!r}"
            downloaded = load(cluster.client.download_model(result["job_id"]))
            model = load_file(trained)
            assert sorted(model) == sorted(downloaded)
            for name, tensor in downloaded.items():
                assert torch.equal(model[name], tensor), name

            # Ctrl-C while the second job runs: the trainer cancels it.
            deadline = time.monotonic() + 120
            while not (running := [j for j in cluster.client.jobs()
                                   if j["id"] != result["job_id"] and j["status"] == "running" and j["step"] > 0]):
                assert time.monotonic() < deadline and script.poll() is None, "the second job never ran"
                time.sleep(0.2)
            os.kill(script.pid, signal.SIGINT)
            assert script.wait(60) != 0
            assert cluster.wait_for_job(running[0]["id"], lambda d: d["status"] == "cancelled", 30,
                                        give_up_on=())["status"] == "cancelled"
        finally:
            if script.poll() is None:
                script.kill()
            script.wait()
    finally:
        for name in ("advertise", "web-lan"):
            cluster.crash(name)
