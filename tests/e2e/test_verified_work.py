"""Verified work end to end: a dishonest agent (honest for 5 steps, then it perturbs the activations it
sends) is caught by spot checks, flagged with the reason, its credit withheld, its stage moved to an
honest spare node, and the job rolled back to before its first unchecked step: the final model is the
one an honest run trains. A replica of a replicated job that perturbs its partial gradient (which every replica
applies alike) is caught by a sibling's recomputation, flagged and its credit withheld the same way."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch
from safetensors.torch import load as safetensors_load

from arceus.sdk import ArceusClient
from devtools.cluster import LocalCluster
from devtools.reference import reference_run

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
    "checkpoint_interval_steps": 2,
    # Once the cheat is flagged, the honest nodes left are one owner's (the job's): its stage moves there.
    "requirements": {"owner_diversity": False},
}
HONEST_STEPS = 5  # every step is checked: steps 1-5 pass, step 6 fails; checkpoint 4 is the last one vouched for


def test_a_dishonest_agent_is_caught_flagged_and_its_credit_withheld(cluster: LocalCluster) -> None:
    # Declared rates at which compute (tens of ms per micro-batch), not the few ms of latency the solver takes
    # from each agent's measured link, decides the cut: the cheat, 4x faster, produces (stage 0).
    # The cheat is a contributor of its own: no node of its owner may verify its work.
    cheat = cluster.start_agent(
        "cheat", "--declare-flops", "4e8", "--honest-steps", str(HONEST_STEPS), module="tests.e2e.dishonest_agent",
        owner="mallory",
    )
    mallory = cluster.owner_client("mallory")
    honest = cluster.start_agents(["honest-a", "honest-b"], "--declare-flops", "1e8")
    job = cluster.client.submit_job(JOB)
    cluster.client.start_job(job["id"])
    final = cluster.client.wait(job["id"], timeout=120)
    assert final["status"] == "succeeded", final["error"]

    nodes = {n["id"]: n for client in (cluster.client, mallory) for n in client.nodes()}  # each sees its own
    flag = nodes[cheat.node_id]["flag"]
    assert flag is not None and "differs from the recomputation" in flag["reason"]
    assert all(nodes[a.node_id]["flag"] is None for a in honest)
    assert all(len(n["public_key"]) == 64 for n in nodes.values())
    # The flagged node's stage moved to an honest node, which finished the job from checkpoint 4.
    assert cheat.node_id not in {p["node_id"] for p in final["placements"]}
    assert final["resumed_from_step"] == 4, final["conditions"]
    # Nothing of the cheat's perturbed steps is left: the model and losses are an honest run's.
    reference = reference_run(JOB)
    assert final["step"] == len(reference.losses)
    assert math.isclose(final["final_loss"], reference.losses[-1], rel_tol=1e-3)
    assert math.isclose(final["val_loss"], reference.val_loss, rel_tol=1e-3)
    weights = safetensors_load(cluster.client.download_model(job["id"]))
    for name, want in reference.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-3, atol=2e-4)

    def earnings(node_id: str, owner: ArceusClient) -> dict:
        return owner.session.get(f"{cluster.api_url}/api/nodes/{node_id}/earnings", timeout=30).json()

    # (The test clusters price compute at $3600/h, so this short job's few ms are worth whole micro-dollars.)
    cheated = earnings(cheat.node_id, mallory)
    assert Decimal(cheated["credit_usd"]) == 0 < Decimal(cheated["withheld_usd"])
    paid = [earnings(a.node_id, cluster.client) for a in honest]
    assert any(Decimal(e["credit_usd"]) > 0 for e in paid)
    # Credits, the platform's fees and the withheld credit add up to what the developer is charged.
    cost = final["cost"]
    credits = sum(Decimal(e["credit_usd"]) for e in [cheated, *paid])
    assert credits + Decimal(cost["platform_fee_usd"]) + Decimal(cost["withheld_usd"]) == Decimal(cost["charged_usd"])


REPLICATED_JOB = {
    "name": "verified-replicas",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 1,
    "learning_rate": 0.05,
    "micro_batches": 4,
    "stages": 2,
    "replicas": 2,
    "audit_rate": 1.0,
    "checkpoint_interval_steps": 4,
    "requirements": {"owner_diversity": False},  # once the cheat is flagged, the honest nodes left are one owner's
}


def test_a_replica_with_a_dishonest_partial_gradient_is_caught_by_a_sibling_and_flagged(cluster: LocalCluster) -> None:
    # Four nodes for 2 stages x 2 replicas, the cheat (mallory's) among them; a spare joins once the job runs.
    cheat = cluster.start_agent("replica-cheat", "--cheat", "partial", "--honest-steps", "3",
                                module="tests.e2e.dishonest_agent", owner="mallory")
    mallory = cluster.owner_client("mallory")
    honest = cluster.start_agents([f"replica-honest-{i}" for i in range(3)])
    job = cluster.client.submit_job(REPLICATED_JOB)
    cluster.client.start_job(job["id"])
    running = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= 1, 120)
    assert cheat.node_id in {p["node_id"] for p in running["placements"]}
    honest.append(cluster.start_agent("replica-honest-spare"))
    final = cluster.client.wait(job["id"], timeout=240)
    assert final["status"] == "succeeded", (final["error"], final["conditions"])

    nodes = {n["id"]: n for client in (cluster.client, mallory) for n in client.nodes()}
    flag = nodes[cheat.node_id]["flag"]
    assert flag is not None and "partial gradient" in flag["reason"], flag
    assert "differs from the recomputation by sibling replica" in flag["reason"]
    assert all(nodes[a.node_id]["flag"] is None for a in honest)
    assert cheat.node_id not in {p["node_id"] for p in final["placements"]}
    # Nothing of its work is paid: no passed check of its partial gradient vouched for any checkpoint, so the job
    # went back to its start, reversing every entry of the cheat's (culprit: credit lost), and any later one is
    # withheld. Credits, fees and what is withheld still add up to the charges.
    earned = mallory.session.get(f"{cluster.api_url}/api/nodes/{cheat.node_id}/earnings", timeout=30).json()
    assert Decimal(earned["credit_usd"]) == 0, earned
    assert final["resumed_from_step"] in (None, 0), final["conditions"]  # its 4th exchanged step was dishonest
    cost = final["cost"]
    credits = sum(Decimal(cluster.client.session.get(f"{cluster.api_url}/api/nodes/{a.node_id}/earnings",
                                                     timeout=30).json()["credit_usd"]) for a in honest)
    assert credits > 0
    assert credits + Decimal(cost["platform_fee_usd"]) + Decimal(cost["withheld_usd"]) == Decimal(cost["charged_usd"])
    # The rollback went back before the poisoned steps: the model is an honest run's (to the replicas' rounding).
    reference = reference_run(REPLICATED_JOB)
    assert final["step"] == len(reference.losses)
    assert math.isclose(final["val_loss"], reference.val_loss, rel_tol=1e-3)
