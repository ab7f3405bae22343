"""Agents behind home routers: two of a job's three agents sit in network namespaces whose inbound connections
are dropped (devtools.netns). The control plane's dial-back finds them `relayed`; they attach to a relay, the
driver and their neighbours reach them through it, and the job trains to the weights of a single-process run.
The relay they use is killed mid-training: they attach to the other one (the control plane assigns it) and the
job still finishes with those weights. Then a job of one stage replicated on all three: the two relayed replicas
exchange their gradients with each other (both through the relay) and with the direct one, and the job trains to
the weights of a single-process run."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load

from devtools.cluster import Agent, LocalCluster, free_port
from devtools.cluster import stage_placement as placement
from devtools.netns import NetworkNamespace
from devtools.reference import reference_run

pytestmark = pytest.mark.slow

JOB: dict[str, Any] = {
    "name": "relayed-digits",
    "model_config": {"layer_sizes": [64, 32, 16, 10]},
    "dataset_config": {"name": "digits", "batch_size": 64, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 2,
    "seed": 5,
    "stages": 3,
    "checkpoint_interval_steps": 10,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
KILL_AT_STEP = 12
# One stage, a replica on every agent: each pair of siblings opens an exchange stream, the homes' pair through the
# relay at both ends.
REPLICATED: dict[str, Any] = {**JOB, "name": "relayed-replicas", "stages": 1, "replicas": 3, "micro_batches": 3,
                              "epochs": 1}


@pytest.fixture
def homes() -> Iterator[list[NetworkNamespace]]:
    """Two namespaces with names and subnets of this run's own."""
    made: list[NetworkNamespace] = []
    try:
        for _ in range(2):
            made.append(NetworkNamespace(f"ar{secrets.token_hex(4)}", random.randrange(1024, 65000)))
        yield made
    finally:
        for ns in made:
            ns.close()


def start_home_agent(cluster: LocalCluster, ns: NetworkNamespace, name: str) -> Agent:
    port = free_port()
    [agent] = cluster.start_agents([name], "--listen", f"0.0.0.0:{port}", "--advertise", f"{ns.address}:{port}",
                                   prefix=ns.command([]))
    return agent


def reachability(cluster: LocalCluster) -> dict[str, str]:
    return {n["id"]: n["reachability"] for n in cluster.client.nodes()}


def attached_relay(cluster: LocalCluster, agent: Agent) -> str:
    """The relay the agent's log says it attached to last."""
    lines = [line for line in agent.child.log_path.read_text().splitlines() if "attached to relay" in line]
    assert lines, f"{agent.name} never attached to a relay"
    return lines[-1].rsplit(" ", 1)[1]


def test_agents_behind_routers_train_through_relays_and_survive_a_relay_dying(
    cluster: LocalCluster, homes: list[NetworkNamespace]
) -> None:
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(reference_run, JOB)  # computed while the agents start
        replicated_reference = pool.submit(reference_run, REPLICATED)
        [direct] = cluster.start_agents(["direct"])
        # What a home reaches outbound: the control plane, the relays and the directly dialled agent (its gRPC port
        # and its replicas' exchange listener, which a home's replica dials).
        ports = [int(a.rpartition(":")[2]) for a in
                 (cluster.api_url, *cluster.relay_addresses, direct.grpc_address, direct.exchange_address)]
        for ns in homes:
            for port in ports:
                ns.bridge(port)
        # One after another, from this thread: an agent's process dies with the thread that started it.
        home = [start_home_agent(cluster, ns, f"home-{i}") for i, ns in enumerate(homes)]

        deadline = time.monotonic() + 30
        while (found := reachability(cluster)) != {direct.node_id: "direct", home[0].node_id: "relayed",
                                                   home[1].node_id: "relayed"}:
            assert time.monotonic() < deadline, f"reachability not measured as expected: {found}"
            time.sleep(0.2)

        job = cluster.client.submit_job(JOB)
        cluster.client.start_job(job["id"])
        running = cluster.wait_for_job(job["id"], lambda d: d["step"] >= KILL_AT_STEP, 60)
        assert set(placement(running).values()) == {direct.node_id, home[0].node_id, home[1].node_id}
        relayed_links = {p["node_id"]: p["relayed"] for p in running["placements"]}
        assert relayed_links == {direct.node_id: False, home[0].node_id: True, home[1].node_id: True}

        victim = attached_relay(cluster, home[0])
        cluster.crash(f"relay-{cluster.relay_addresses.index(victim)}")
        final = cluster.client.wait(job["id"], timeout=90)
        assert final["status"] == "succeeded", final["error"]
        survivor = next(r for r in cluster.relay_addresses if r != victim)
        assert attached_relay(cluster, home[0]) == survivor

        want = reference.result()
        assert final["step"] == len(want.losses)
        curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
        for step in (1, KILL_AT_STEP, final["step"]):
            assert curve[step] == pytest.approx(want.losses[step - 1], rel=1e-4), step
        weights = safetensors_load(cluster.client.download_model(job["id"]))
        assert sorted(weights) == sorted(want.weights)
        for name, expected in want.weights.items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-3, atol=2e-4)

        job = cluster.client.submit_job(REPLICATED)
        cluster.client.start_job(job["id"])
        final = cluster.client.wait(job["id"], timeout=90)
        assert final["status"] == "succeeded", final["error"]
        rows = {(p["replica"], p["node_id"], p["relayed"]) for p in final["placements"]}
        assert {(n, r) for _, n, r in rows} == {(direct.node_id, False), (home[0].node_id, True),
                                                 (home[1].node_id, True)}
        want = replicated_reference.result()
        curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
        assert final["step"] == len(want.losses)
        for step, loss in enumerate(want.losses, start=1):
            assert curve[step] == pytest.approx(loss, rel=1e-4), step
        weights = safetensors_load(cluster.client.download_model(job["id"]))
        for name, expected in want.weights.items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-3, atol=2e-4)
    cluster.relaunch(f"relay-{cluster.relay_addresses.index(victim)}")  # the next test finds both relays
