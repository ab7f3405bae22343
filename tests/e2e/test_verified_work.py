"""Verified work end to end: a dishonest agent (it perturbs the activations it sends) is caught by spot
checks, flagged with the reason, its credit withheld, and its stage moved to an honest spare node."""

from __future__ import annotations

from decimal import Decimal

import pytest

from arceus.devcluster.cluster import LocalCluster

pytestmark = pytest.mark.slow

JOB = {
    "name": "verified-digits",
    # Layer FLOPs per sample 32k, 16k, 0.6k: the fastest node gets stage 0, the producing stage.
    "model_config": {"layer_sizes": [64, 256, 32, 10]},
    "dataset_config": {"name": "digits", "batch_size": 128, "val_batch_size": 360},
    "epochs": 1,
    "learning_rate": 0.05,
    "micro_batches": 2,
    "stages": 2,
    "audit_rate": 1.0,
}


def test_a_dishonest_agent_is_caught_flagged_and_its_credit_withheld(cluster: LocalCluster) -> None:
    cheat = cluster.start_agent("cheat", "--declare-flops", "4e11", module="tests.e2e.dishonest_agent")
    honest = [cluster.start_agent(name, "--declare-flops", "1e11") for name in ("honest-a", "honest-b")]
    job = cluster.client.submit_job(JOB)
    cluster.client.start_job(job["id"])
    final = cluster.client.wait(job["id"], timeout=120)
    assert final["status"] == "succeeded", final["error"]

    nodes = {n["id"]: n for n in cluster.client.session.get(f"{cluster.api_url}/api/nodes", timeout=30).json()}
    flag = nodes[cheat.node_id]["flag"]
    assert flag is not None and "differs from the recomputation" in flag["reason"]
    assert all(nodes[a.node_id]["flag"] is None for a in honest)
    assert all(len(n["public_key"]) == 64 for n in nodes.values())
    # The flagged node's stage moved to an honest node, which finished the job.
    assert cheat.node_id not in {p["node_id"] for p in final["placements"]}

    def earnings(node_id: str) -> dict:
        return cluster.client.session.get(f"{cluster.api_url}/api/nodes/{node_id}/earnings", timeout=30).json()

    cheated = earnings(cheat.node_id)
    assert Decimal(cheated["credit_usd"]) == 0 < Decimal(cheated["withheld_usd"])
    paid = [earnings(a.node_id) for a in honest]
    assert any(Decimal(e["credit_usd"]) > 0 for e in paid)
    # Credits, the platform's fees and the withheld credit add up to what the developer is charged.
    cost = final["cost"]
    credits = sum(Decimal(e["credit_usd"]) for e in [cheated, *paid])
    assert credits + Decimal(cost["platform_fee_usd"]) + Decimal(cost["withheld_usd"]) == Decimal(cost["charged_usd"])
