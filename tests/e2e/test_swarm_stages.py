"""Replicated stages over REST under churn (arceus/swarm, issue 29): a job of 3 stages x 2 replicas on real agents
loses a replica of its middle stage four times in a row, each at a phase of a step its agent's fault hook names
(nodeagent/faults.py), not at a moment a timer guessed: SIGKILLed mid-forward, after it sent its gradients upstream,
during the replicas' gradient exchange, and SIGSTOPped there (a silent peer, found when the control plane takes its
node off the job) and woken once the job went on without it; each victim after the first is the spare that replaced
the one before. The job's step counter never goes back, no checkpoint is loaded (nothing read from checkpoint
storage), each spare joins as the new replica by copying the stage's whole state from its live peer, bit for bit,
the other stages do an undisturbed run's work, and the job ends with the losses of one process on the same global
batches. A stage that loses both replicas rewinds to its checkpoint. An elastic job ({"min": 1, "max": 3}) gains
replicas without a restart as two more nodes register, and its job page in a real browser shows them with the
job's samples/s."""

from __future__ import annotations

import itertools
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions

from devtools.cluster import Agent, LocalCluster
from devtools.reference import ReferenceRun, reference_run
from tests.e2e.browser import console_errors, live_wait

pytestmark = pytest.mark.slow

JOB: dict[str, Any] = {
    "name": "swarm-digits",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 2,
    "learning_rate": 0.05,
    "optimizer": "sgd",
    "momentum": 0.9,
    "micro_batches": 4,
    "seed": 3,
    "stages": 3,
    "replicas": 2,
    "checkpoint_interval_steps": 10,
    "node_grace_seconds": 2.0,  # the lost replica leaves the placement soon, so the spare joins well before the end
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}
# The churn case: one job whose middle stage loses a replica four times in a row, each time at another phase of a
# step, each spare that replaced the last victim becoming the next. The first six agents are armed to SIGKILL stage
# 1's replica 0 early on (step 3 of 45 an epoch); a spare starts once the job is placed, armed for the next fault at the
# first step it takes (it only ever hosts the middle stage's new replica), and the next spare once it joined, so the
# faults follow one another as fast as spares join, never by timing. The stop comes last: its victim is woken once the
# last spare (unarmed) trains, while the job still runs. A spare joins seconds after its victim's kill (the lost
# node's detection, node_grace_seconds; a reconcile pass; the spare's build) while the job trains on without it: the
# chain took ~260 steps on a quiet 2-core machine, and 13 epochs (585 steps) leave it room on one twice as fast. Its
# learning rate keeps one process and the pipeline (micro-batched sums) within 1e-5 over as many steps: with JOB's
# 0.05 (and momentum 0.9) fp32 rounding grows past it in fewer, churn or not.
CHURN_JOB = {**JOB, "epochs": 13, "learning_rate": 0.02}
FIRST_FAULT = ("kill", "forward", 3)  # stage 1's replica 0
SPARE_FAULTS = (("kill", "gradient-sent"), ("kill", "exchange"), ("stop", "exchange"))  # at a spare's first step
# The rewind case: one epoch (45 steps), both replicas of the middle stage killed from step 12 on (a checkpoint every
# 10 steps).
REWIND_JOB = {**JOB, "epochs": 1}
KILL_AT_STEP = 12


# One process's run of a job, computed beside the test that asks for it (its agents start and its job runs meanwhile).
REFERENCES = ThreadPoolExecutor(1)


def replicas(detail: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """(stage index, replica id) -> its placement row."""
    return {(p["stage_index"], p["replica"]): p for p in detail["placements"]}


def checkpoint_bytes_read(cluster: LocalCluster) -> float:
    """The control plane's arceus_checkpoint_bytes_read_total (every process's, summed by /metrics)."""
    body = requests.get(f"{cluster.api_url}/metrics", headers={"Authorization": f"Bearer {cluster.metrics_token}"},
                        timeout=10).text
    return sum(float(line.split()[-1]) for line in body.splitlines()
               if line.split("{")[0].split(" ")[0] == "arceus_checkpoint_bytes_read_total")


def stage_state_bytes(weights: ReferenceRun, row: dict[str, Any]) -> int:
    """A stage's weights and SGD's momentum buffers (one per weight), in bytes."""
    layers = tuple(f"layers.{i}." for i in range(row["layer_start"], row["layer_end"]))
    return 2 * sum(t.numel() * t.element_size() for name, t in weights.weights.items() if name.startswith(layers))


def assert_losses(final: dict[str, Any], expected: ReferenceRun) -> None:
    assert final["step"] == len(expected.losses)
    curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
    for step, want in enumerate(expected.losses, start=1):
        assert math.isclose(curve[step], want, rel_tol=1e-5, abs_tol=1e-5), (step, curve[step], want)
    assert math.isclose(final["val_loss"], expected.val_loss, rel_tol=1e-5, abs_tol=1e-5)


def stages_hosted(agent: Agent) -> float:
    """The agent's arceus_stage_assigned (its /metrics, with its scrape token)."""
    body = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token},
                        timeout=10).text
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.split(" ")[0] == "arceus_stage_assigned")


def agent_log(cluster: LocalCluster, agent: Agent) -> str:
    return (cluster.supervisor.log_dir / f"{agent.child.name}.log").read_text()


def fired(cluster: LocalCluster, agent: Agent) -> list[tuple[str, str, int, int, int]]:
    """The fault hook's firings in the agent's log: (signal, phase, step, stage, replica) each."""
    return [(sig, phase, int(step), int(stage), int(replica)) for sig, phase, step, stage, replica in re.findall(
        r"TEST HOOK FIRES: SIG(\w+) at phase '([\w-]+)' of step (\d+) \(stage (\d+) replica (\d+)\)",
        agent_log(cluster, agent))]


def test_replicas_lost_mid_step_at_each_phase_cost_no_rewind_and_each_spare_joins_from_its_peer(
    cluster: LocalCluster,
) -> None:
    expected_soon = REFERENCES.submit(reference_run, CHURN_JOB)
    # The first six armed alike: whichever the control plane places as stage 1's replica 0 fires, the others never do.
    signal_name, phase, step = FIRST_FAULT
    agents = cluster.start_agents([f"swarm-churn-{i}" for i in range(6)], fault=f"{signal_name}:{phase}:{step}:1:0")
    read_before = checkpoint_bytes_read(cluster)
    job = cluster.client.submit_job(CHURN_JOB)
    cluster.client.start_job(job["id"])
    before = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and len(d["placements"]) == 6, 120)
    placed = replicas(before)
    assert sorted(placed) == [(i, r) for i in range(3) for r in range(2)]
    assert len({p["node_id"] for p in placed.values()}) == 6

    spares: list[Agent] = []

    def start_spare() -> None:  # armed for the next fault, the last one not
        armed = SPARE_FAULTS[len(spares)] if len(spares) < len(SPARE_FAULTS) else None
        fault = None if armed is None else f"{armed[0]}:{armed[1]}:1"
        spares.extend(cluster.start_agents([f"swarm-churn-spare-{len(spares)}"], fault=fault))

    start_spare()
    steps, generations = [before["step"]], {before["generation"]}
    joins: dict[str, dict[str, Any]] = {}  # node id -> its stage 1 row, once it copied its peer's state
    woken: dict[str, Any] | None = None  # the detail when the stopped victim was woken
    fenced = False  # the woken victim hosts no stage while the job still runs
    deadline = time.monotonic() + 240
    while (detail := cluster.client.job(job["id"]))["status"] == "running" and time.monotonic() < deadline:
        steps.append(detail["step"])
        generations.add(detail["generation"])
        joins.update({p["node_id"]: p for p in detail["placements"]
                      if p["stage_index"] == 1 and p["joined"] is not None})
        if len(spares) <= len(SPARE_FAULTS) and spares[-1].node_id in joins:
            start_spare()
        elif woken is None and len(spares) > len(SPARE_FAULTS) and joins.get(spares[-1].node_id, {}).get(
                "micro_batches", 0) > 0:
            cluster.resume(spares[-2])  # SIGCONT: it wakes mid-exchange of a step the job finished without it
            woken = detail
        elif woken is not None and not fenced:
            fenced = stages_hosted(spares[-2]) == 0
        time.sleep(0.1)
    final = cluster.client.wait(job["id"], timeout=120)
    assert final["status"] == "succeeded", (final["error"], final["conditions"])
    expected = expected_soon.result()

    # Each fault fired where it was asked to, on its victim alone, one after another: stage 1's replica 0, then each
    # spare that joined in the last victim's place (as a fresh replica id).
    assert len(spares) == len(SPARE_FAULTS) + 1 and all(s.node_id in joins for s in spares), (spares, joins)
    victims = [next(a for a in agents if a.node_id == placed[(1, 0)]["node_id"]), *spares[:-1]]
    faults = [(*FIRST_FAULT, 0), *((sig, phase, 1, joins[s.node_id]["replica"]) for (sig, phase), s in
                                    zip(SPARE_FAULTS, spares, strict=False))]
    fired_at = []
    for victim, (signal_name, phase, step, replica) in zip(victims, faults, strict=True):
        [(sig, at_phase, at_step, stage, at_replica)] = fired(cluster, victim)
        assert (sig, at_phase, stage, at_replica) == (signal_name.upper(), phase, 1, replica) and at_step >= step
        fired_at.append(at_step)
    assert fired_at[0] == FIRST_FAULT[2] and all(a < b for a, b in itertools.pairwise(fired_at)), fired_at
    assert not any(fired(cluster, a) for a in [*agents, spares[-1]] if a not in victims)
    ids = [joins[s.node_id]["replica"] for s in spares]
    assert ids[0] >= 2 and ids == sorted(set(ids)), ids
    # no rewind: the step never went back, one generation throughout, nothing loaded from a checkpoint
    assert steps == sorted(steps), steps
    assert generations == {before["generation"]}, generations  # (its end then bumps it, as any job's does)
    assert final["resumed_from_step"] is None and final["restarts"] == 0
    assert checkpoint_bytes_read(cluster) == read_before
    # Each spare took the last victim's place in the middle stage, copying the stage's whole state from its live peer
    # (replica 1, there throughout) and holding exactly that; the last one stays and processed micro-batches.
    for spare in spares:
        row = joins[spare.node_id]
        copied = row["joined"]
        assert copied["from_replica"] == 1 and copied["size_bytes"] >= stage_state_bytes(expected, row), row
        assert copied["sha256"] == copied["state_sha256"] and len(copied["sha256"]) == 64
    now = replicas(final)
    assert sorted(k for k in now if k[0] == 1) == [(1, 1), (1, ids[-1])]
    assert now[(1, 1)]["node_id"] == placed[(1, 1)]["node_id"]
    assert now[(1, ids[-1])]["node_id"] == spares[-1].node_id and now[(1, ids[-1])]["micro_batches"] > 0
    assert {k: p["node_id"] for k, p in now.items() if k[0] != 1} == {
        k: p["node_id"] for k, p in placed.items() if k[0] != 1
    }
    # what one process computes on the same global batches, and the other stages did the work of an undisturbed run:
    # every micro-batch of every step and validation (one batch of 360 an epoch) once (each lost replica's share was
    # recomputed in its own stage, not sent through them again)
    assert_losses(final, expected)
    undisturbed = CHURN_JOB["micro_batches"] * (len(expected.losses) + CHURN_JOB["epochs"])
    for index in (0, 2):
        assert sum(p["micro_batches"] for k, p in now.items() if k[0] == index) == undisturbed, (index, now)
    # and the middle stage's replicas were billed for it, every node that served it summed (a lost replica's row is
    # gone, its contribution stays): each lost replica for the steps it finished and nothing of the one it was lost
    # in, whose share its survivor recomputed and was credited for with its own
    middle = [c for c in final["contributions"] if c["stage_index"] == 1]
    assert sum(c["micro_batches"] for c in middle) == undisturbed, middle
    first_victim = [c["micro_batches"] for c in middle if c["node_id"] == victims[0].node_id]
    assert first_victim and first_victim[0] >= 2, middle  # a micro-batch at least in each of steps 1 and 2

    *killed, stopped = victims
    for victim in killed:
        assert victim.child.process.wait(10) == -9
    # The stopped victim, woken after the job went on without it, is fenced: it runs on, but the control plane took
    # its stage off it while the job still ran, and the driver never counted its work again (nor did its stale
    # exchange reach the survivors: the losses above).
    assert woken is not None and stopped.child.alive()
    assert "continued after SIGSTOP at phase 'exchange'" in agent_log(cluster, stopped)
    assert fenced, "the woken victim still hosted its stage when the job ended"

    def victims_work(detail: dict[str, Any]) -> int:  # (none at all where no write of the driver's counters named it)
        return sum(c["micro_batches"] for c in detail["contributions"] if c["node_id"] == stopped.node_id)

    assert victims_work(final) == victims_work(woken)


def test_a_stage_that_loses_every_replica_rewinds_to_its_checkpoint(cluster: LocalCluster) -> None:
    expected_soon = REFERENCES.submit(reference_run, REWIND_JOB)
    agents = cluster.start_agents([f"swarm-{i}" for i in range(7)])
    read_before = checkpoint_bytes_read(cluster)
    job = cluster.client.submit_job(REWIND_JOB)
    cluster.client.start_job(job["id"])
    before = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= KILL_AT_STEP, 120)
    placed = replicas(before)
    spare = next(a for a in agents if a.node_id not in {p["node_id"] for p in placed.values()})
    for replica in (0, 1):
        cluster.crash(next(a for a in agents if a.node_id == placed[(1, replica)]["node_id"]).child.name)
    final = cluster.client.wait(job["id"], timeout=180)
    assert final["status"] == "succeeded", (final["error"], final["conditions"])
    # the last checkpoint before the kills (every 10 steps; the kills land a few steps after `before`), which every
    # stage loaded from checkpoint storage
    assert final["resumed_from_step"] in (10, 20) and final["generation"] > before["generation"] + 1
    assert checkpoint_bytes_read(cluster) > read_before
    # the stage kept one row, moved to the spare; the other stages kept their replicas
    now = replicas(final)
    assert [p["node_id"] for k, p in now.items() if k[0] == 1] == [spare.node_id]
    assert {k: p["node_id"] for k, p in now.items() if k[0] != 1} == {
        k: p["node_id"] for k, p in placed.items() if k[0] != 1
    }
    curve = {p["step"]: p["loss"] for p in final["loss_curve"]}
    for step, want in enumerate(expected_soon.result().losses, start=1):
        assert math.isclose(curve[step], want, rel_tol=1e-5, abs_tol=1e-5), (step, curve[step], want)


# Each replica past the first is placed only where the swarm model predicts it worth it (MIN_REPLICA_GAIN): here its
# 69 kB exchange crosses loopback (a round trip of µs, as the agents' TCP handshakes measure it) while its share
# of the step saves ms of the driver-timed step, so it is worth it at any machine speed and load.
GROWING: dict[str, Any] = {
    "name": "swarm-grows",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 200,  # far more than the test waits for: it is cancelled once its page shows the replicas
    "learning_rate": 0.05,
    # 6 split 3 + 3 over two replicas and 2 + 2 + 2 over three: a third replica takes work off the other two (of 4,
    # one replica of three would still take 2, as each of two does, and the reconciler rightly adds none)
    "micro_batches": 6,
    "stages": 1,  # the smallest job that grows: one stage, its replicas one per node
    "replicas": {"min": 1, "max": 3},
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}


def page_text(browser: webdriver.Chrome, selector: str) -> list[str]:
    """The text of every element `selector` finds, read in one script (the page redraws on every poll)."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText);", selector
    )


def test_an_elastic_job_gains_replicas_as_nodes_register_and_its_page_shows_them(
    cluster: LocalCluster, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    [first] = cluster.start_agents(["grow-0"])
    job = cluster.client.submit_job(GROWING)
    cluster.client.start_job(job["id"])
    before = cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= 3, 120)
    assert [(p["stage_index"], p["replica"], p["node_id"]) for p in before["placements"]] == [(0, 0, first.node_id)]

    base = cluster.api_url.replace("127.0.0.1", "localhost")  # a secure context keeps the Secure session cookie
    browser.get(f"{base}/dashboard/jobs/{job['id']}/")
    browser.find_element(By.ID, "id_username").send_keys("demo")
    browser.find_element(By.ID, "id_password").send_keys("arceus-demo")
    browser.find_element(By.ID, "login-submit").click()
    wait = live_wait(browser, 60)
    wait.until(expected_conditions.url_matches(rf"/dashboard/jobs/{job['id']}/$"))
    wait.until(lambda b: page_text(b, "#stat-replicas") == ["1"])

    # Two more nodes register while it trains: the reconciler adds a replica on each, which copies its state from
    # the live one and takes micro-batches, at the same generation.
    late = cluster.start_agents(["grow-1", "grow-2"])
    steps, generations = [before["step"]], {before["generation"]}

    def grown(detail: dict[str, Any]) -> bool:
        steps.append(detail["step"])
        generations.add(detail["generation"])
        return len(detail["placements"]) == 3 and all(
            p["activity"] == "training" and p["micro_batches"] > 0 for p in detail["placements"])

    after = cluster.wait_for_job(job["id"], grown, 120, poll_seconds=0.3)
    assert steps == sorted(steps) and generations == {before["generation"]}, (steps, generations)
    assert (after["restarts"], after["resumed_from_step"], after["status"]) == (0, None, "running")
    placements = {p["node_id"]: p for p in after["placements"]}
    assert set(placements) == {a.node_id for a in (first, *late)} and placements[first.node_id]["replica"] == 0
    assert not placements[first.node_id]["joining"] and all(placements[a.node_id]["joining"] for a in late)
    assert {p["replica"] for p in placements.values()} == {0, 1, 2}

    # The page shows the three replicas training, each with its share of the micro-batches and its speed, and the
    # job's samples/s; the joined agents export their replica's micro-batches by stage and replica.
    wait.until(lambda b: page_text(b, "#stat-replicas") == ["3"]
               and b.find_element(By.ID, "stat-replicas").get_attribute("data-training") == "3")
    wait.until(lambda b: len(page_text(b, "#pipeline .stage.activity-training .share")) == 3
               and all("% of the stage's micro-batches" in t for t in page_text(b, "#pipeline .share")))
    wait.until(lambda b: all(t.split()[0] not in ("–", "0.00") for t in page_text(b, "#pipeline .speed")))
    samples_per_second = float(page_text(browser, "#stat-samples")[0])
    assert samples_per_second > 0
    assert "Replicas per stage: 3 (1 to 3), 3 training." in page_text(browser, "#pipeline-summary")[0]
    browser.save_screenshot(str(tmp_path / "swarm-grows.png"))
    print(f"swarm job page: {tmp_path / 'swarm-grows.png'}")
    assert console_errors(browser) == []
    for agent in late:
        replica = placements[agent.node_id]["replica"]
        metrics = requests.get(f"http://{agent.metrics_address}/metrics", params={"token": agent.metrics_token},
                               timeout=10).text
        name = f'arceus_replica_micro_batches_total{{replica="{replica}",stage="0"}} '
        assert float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[1]) > 0

    cluster.client.cancel_job(job["id"])
    assert cluster.client.wait(job["id"], timeout=60)["status"] == "cancelled"
