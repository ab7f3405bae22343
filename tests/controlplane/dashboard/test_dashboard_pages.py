"""The dashboard through Django's test client: login, each page and live document as its owner sees it,
404s for another user's jobs and nodes, forms that validate as the API does and act through its services,
and CSRF on every form."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle

from arceus.contracts.replica_sync import replica_sync_from_json
from arceus.training.plan import ReplicaFence, ReplicaJoin, StageTiming
from controlplane.common.conditions import get_condition
from controlplane.controller.executor import reconcile_once
from controlplane.driver.progress import (
    StepPoint,
    job_record_steps,
    stage_record_fenced,
    stage_record_joined,
    stage_timings_mean,
)
from controlplane.jobs.leases import job_driver_claim
from controlplane.jobs.models import Checkpoint, Job, Stage, StageContribution
from controlplane.market.models import PriceChange, SpotCheck
from controlplane.market.services import prices_reprice
from controlplane.nodes.labels import OTHERS_NODE
from controlplane.nodes.models import Node, Reachability

pytestmark = pytest.mark.django_db

PAGES = ["/dashboard/", "/dashboard/nodes/", "/dashboard/market/", "/dashboard/jobs/live.json",
         "/dashboard/nodes/live.json", "/dashboard/market/live.json"]


@pytest.fixture
def browser(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def stranger(other_user: User) -> Client:
    client = Client()
    client.force_login(other_user)
    return client


@pytest.fixture
def training_job(ready_node: Callable[..., Node], queued_job: Callable[..., Job]) -> Job:
    """A placed, running job with recorded steps and stage timings, one stage of which moved once."""
    nodes = [ready_node(f"n{i}", port=50051 + i) for i in range(3)]
    job = queued_job()
    reconcile_once()
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="",
                                         driver_lease_expires_at=now + timedelta(seconds=60))
    job_driver_claim(job_id=job.id, owner="driver", now=now)
    timings = [StageTiming(i, 0.01, 0.002 * i) for i in range(3)]
    points = [StepPoint(1, s, 90, 2.0 - 0.1 * s, 50.0) for s in range(1, 6)]
    assert job_record_steps(job_id=job.id, lease_owner="driver", points=points, timings=timings, now=now)
    stage = Stage.objects.get(job=job, index=1)
    other = next(n for n in nodes if n.pk != stage.node_id)
    for generation, node in ((stage.generation - 1, other), (stage.generation, stage.node)):
        StageContribution.objects.create(job=job, stage_index=1, generation=generation, node=node, samples=32)
    checkpoint = Checkpoint.objects.create(job=job, step=4, epoch=1, generation=stage.generation - 1)
    Job.objects.filter(pk=job.pk).update(resume_checkpoint=checkpoint)
    for passed in (True, False):
        SpotCheck.objects.create(job=job, node=stage.node, generation=stage.generation, step=3, train_step=3,
                                 micro_batch=0, stage_index=1, passed=passed, detail="recomputed")
    job.refresh_from_db()
    return job


def test_pages_send_strangers_to_the_login_page(client: Client) -> None:
    for url in PAGES:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/dashboard/login/"), url
    assert client.get("/")["Location"] == "/dashboard/"


def test_logging_in_with_django_auth(client: Client, user: User) -> None:
    page = client.get("/dashboard/login/")
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    wrong = client.post("/dashboard/login/", {"username": "alice", "password": "nope"})
    assert wrong.status_code == 200 and b"correct username and password" in wrong.content
    right = client.post("/dashboard/login/", {"username": "alice", "password": "alice-password"})
    assert right.status_code == 302 and right["Location"] == "/dashboard/"
    assert client.get("/dashboard/").status_code == 200


def test_login_attempts_share_the_apis_limit(client: Client, user: User, monkeypatch: pytest.MonkeyPatch) -> None:
    # The limit counts within a minute of the throttle's clock: held still, a slow machine cannot spread the
    # 11 attempts past it.
    now = time.time()
    monkeypatch.setattr(ScopedRateThrottle, "timer", lambda self: now)
    wrong = {"username": "alice", "password": "guess"}
    for _ in range(9):  # the API's "login" rate: 10 a minute per address, wherever they are spent
        assert APIClient().post("/api/auth/token", wrong, format="json").status_code == 400
    assert client.post("/dashboard/login/", wrong).status_code == 200
    blocked = client.post("/dashboard/login/", {"username": "alice", "password": "alice-password"})
    assert blocked.status_code == 429 and b"Too many attempts" in blocked.content
    assert client.get("/dashboard/").status_code == 302  # not logged in


def test_every_page_renders_for_its_owner(browser: Client, training_job: Job) -> None:
    for url in [*PAGES, f"/dashboard/jobs/{training_job.id}/", f"/dashboard/jobs/{training_job.id}/live.json"]:
        assert browser.get(url).status_code == 200, url
    jobs = browser.get("/dashboard/jobs/live.json").json()["jobs"]
    assert [j["id"] for j in jobs] == [str(training_job.id)] and jobs[0]["cost"]["charged_usd"] == "0.000000"


def test_another_contributors_node_goes_unnamed_on_the_owners_pages(
    browser: Client, api: APIClient, ready_node: Callable[..., Node], queued_job: Callable[..., Job], other_user: User
) -> None:
    """A node's name is its owner's to share: the job's owner sees another contributor's node by its id's start, in
    the placements, contributions, conditions and the dashboard's pipeline and timeline."""
    theirs = ready_node("bobs-attic-gpu", port=50061, flops=4e9, owner=other_user)  # the fastest: placed for sure
    mine = [ready_node(f"mine-{i}", port=50062 + i) for i in range(2)]
    job = queued_job()
    reconcile_once()
    StageContribution.objects.create(job=job, stage_index=0, generation=1, node=theirs, samples=32)
    label = f"{OTHERS_NODE} {str(theirs.id)[:8]}"

    detail = api.get(f"/api/jobs/{job.id}").json()
    live = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()
    shown = json.dumps(detail) + json.dumps(live)
    assert "bobs-attic-gpu" not in shown
    assert label in [p["node_name"] for p in detail["placements"]]
    assert label in [c["node_name"] for c in detail["contributions"]]
    assert label in [s["node_name"] for s in live["pipeline"]["stages"]]
    assert label in get_condition(detail["conditions"], "Placed")["message"]
    assert {p["node_name"] for p in detail["placements"]} - {label} <= {n.name for n in mine}  # own nodes: named


def test_the_live_job_shows_the_pipeline_bubble_speed_and_events(browser: Client, training_job: Job) -> None:
    live = browser.get(f"/dashboard/jobs/{training_job.id}/live.json").json()
    assert [p["step"] for p in live["loss_curve"]] == [1, 2, 3, 4, 5]
    assert live["samples_per_second"] == 50.0 and live["writes_text"] is False and live["tokens_per_second"] is None
    assert live["eta_seconds"] == pytest.approx((90 - 5) * 32 / 50.0)
    pipeline = live["pipeline"]
    assert pipeline["ideal_bubble"] == pytest.approx((3 - 1) / (4 + 3 - 1))  # p=3 stages, m=4 micro-batches
    stages = pipeline["stages"]
    assert [s["stage_index"] for s in stages] == [0, 1, 2]
    assert [s["step_wait_seconds"] for s in stages] == pytest.approx([0.0, 0.002, 0.004])
    assert stages[2]["bubble"] == pytest.approx(0.004 / 0.014)
    assert all(s["node_name"] and s["device"] == "cpu test cpu" for s in stages)
    assert [s["relayed"] for s in stages] == [False, False, False]  # not dialled back yet: reached directly
    relayed = Node.objects.get(name=stages[1]["node_name"])
    Node.objects.filter(pk=relayed.pk).update(reachability=Reachability.RELAYED)
    stages = browser.get(f"/dashboard/jobs/{training_job.id}/live.json").json()["pipeline"]["stages"]
    assert [s["relayed"] for s in stages] == [False, True, False]
    kinds = {e["kind"] for e in live["events"]}
    assert kinds == {"condition", "moved", "checkpoint", "resumed", "spot_check_passed", "spot_check_failed"}
    times = [e["at"] for e in live["events"]]
    assert times == sorted(times, reverse=True)  # newest first
    moved = next(e for e in live["events"] if e["kind"] == "moved")
    assert moved["text"].startswith("stage 1 moved from ")


def test_a_text_model_shows_tokens_per_second_and_perplexity(
    browser: Client, ready_node: Callable[..., Node], queued_job: Callable[..., Job]
) -> None:
    ready_node("n0")
    job = queued_job(model_config={"type": "transformer", "n_layer": 1, "n_head": 2, "d_model": 16,
                                   "block_size": 16},
                     dataset_config={"batch_size": 8}, stages=1)
    Job.objects.filter(pk=job.pk).update(samples_per_second=10.0, val_loss=1.0)
    live = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()
    assert live["writes_text"] is True
    assert live["tokens_per_second"] == pytest.approx(160.0)  # 16 positions per sample
    assert live["perplexity"] == pytest.approx(2.718281828)


def test_another_tenants_job_and_node_are_404(stranger: Client, training_job: Job) -> None:
    node = Node.objects.filter(owner=training_job.owner).first()
    for url in [f"/dashboard/jobs/{training_job.id}/", f"/dashboard/jobs/{training_job.id}/live.json",
                f"/dashboard/jobs/{uuid.uuid4()}/", "/dashboard/jobs/not-a-uuid/live.json"]:
        assert stranger.get(url).status_code == 404, url
    for action in ("pause", "resume", "controls"):
        assert stranger.post(f"/dashboard/nodes/{node.id}/{action}", {}).status_code == 404, action
    assert stranger.get("/dashboard/jobs/live.json").json() == {"jobs": []}
    assert stranger.get("/dashboard/nodes/live.json").json() == {"nodes": []}
    assert str(node.id) not in stranger.get("/dashboard/nodes/").content.decode()
    assert Node.objects.get(pk=node.pk).paused is False


def test_submitting_a_job_from_the_form(browser: Client, ready_node: Callable[..., Node]) -> None:
    form = {"name": "from-the-form", "model_config": json.dumps({"layer_sizes": [64, 32, 10]}),
            "dataset_config": json.dumps({"name": "digits", "batch_size": 32}), "epochs": "1",
            "learning_rate": "0.05", "micro_batches": "2", "schedule": "gpipe", "start": "on"}
    response = browser.post("/dashboard/", form)
    job = Job.objects.get(name="from-the-form")
    assert response.status_code == 302 and response["Location"] == f"/dashboard/jobs/{job.id}/"
    assert job.status == "queued" and job.micro_batches == 2 and job.model_config["layer_sizes"] == [64, 32, 10]
    kept = browser.post("/dashboard/", {**form, "name": "kept", "start": ""})
    assert kept.status_code == 302 and Job.objects.get(name="kept").status == "created"
    assert (job.replicas_min, job.replicas_max) == (1, 1)


def test_the_form_takes_replicas_and_replica_sync_as_rest_does(browser: Client) -> None:
    form = {"model_config": json.dumps({"layer_sizes": [64, 32, 10]}),
            "dataset_config": json.dumps({"name": "digits", "batch_size": 32}), "epochs": "1",
            "learning_rate": "0.05", "micro_batches": "4", "schedule": "gpipe"}
    for name, replicas, sync, want in [
        ("elastic", "1-3", "", (1, 3, {"every_steps": 1})),
        ("fixed", " 2 ", '{"every_steps": 8, "outer_lr": 0.7}',  # normalised as REST saves it
         (2, 2, replica_sync_from_json({"every_steps": 8, "outer_lr": 0.7}).to_json())),
    ]:
        response = browser.post("/dashboard/", {**form, "name": name, "replicas": replicas, "replica_sync": sync})
        assert response.status_code == 302, response.content.decode()
        job = Job.objects.get(name=name)
        assert (job.replicas_min, job.replicas_max, job.replica_sync_config.to_json()) == want
    for replicas, sync, message in [
        ("two", "", "neither a number of replicas (2) nor a range min-max (1-3)"),
        ("3-1", "", "replicas.max: Must be at least min."),
        ("8", "", "at most 4 replicas"),
        ("", '{"every_steps": 4}', "replicas &gt; 1"),
        ("2", '{"every": 4}', "replica_sync.every"),
        ("2", "[4]", "must be a JSON object"),
    ]:
        refused = browser.post("/dashboard/", {**form, "name": "refused", "replicas": replicas, "replica_sync": sync})
        assert refused.status_code == 400 and message in refused.content.decode(), (replicas, sync)
    assert not Job.objects.filter(name="refused").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_config": "{not json"}, "is not JSON"),
        ({"model_config": "[1, 2]"}, "must be a JSON object"),
        ({"model_config": json.dumps({"layer_sizes": [64]})}, "layer_sizes"),
        ({"dataset_config": json.dumps({"name": "nope"})}, "dataset_config"),
        ({"epochs": "0"}, "greater than or equal to 1"),
        ({"micro_batches": "many"}, "Enter a whole number"),
        ({"schedule": "zigzag"}, "Select a valid choice"),
        ({"model_config": "x" * 20_001}, "at most 20000 are accepted"),
        ({"model_config": "[" * 10_000 + "]" * 10_000}, "nests objects and arrays more than 32 deep"),
        ({"model_config": json.dumps({"layer_sizes": [64, 32, 10], "type": "mlp\x00"})},
         "type: contains a NUL character"),
        ({"model_config": '{"layer_sizes": [64, 32, 1e999]}'}, "layer_sizes[2]: must be a finite number"),
    ],
)
def test_the_form_refuses_bad_jobs_naming_the_field(browser: Client, change: dict[str, str], message: str) -> None:
    form = {"model_config": json.dumps({"layer_sizes": [64, 32, 10]}),
            "dataset_config": json.dumps({"name": "digits", "batch_size": 32}), "epochs": "1",
            "learning_rate": "0.05", "micro_batches": "2", "schedule": "gpipe"}
    response = browser.post("/dashboard/", {**form, **change})
    assert response.status_code == 400 and message in response.content.decode()
    assert not Job.objects.exists()


def test_forms_need_the_csrf_token(user: User, ready_node: Callable[..., Node]) -> None:
    node = ready_node("n0")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post("/dashboard/", {"model_config": "{}"}).status_code == 403
    assert client.post(f"/dashboard/nodes/{node.id}/pause").status_code == 403
    assert client.post(f"/dashboard/nodes/{node.id}/controls", {}).status_code == 403
    assert client.post("/api/jobs/estimate", {}, content_type="application/json").status_code == 403
    assert Node.objects.get(pk=node.pk).paused is False


def test_node_controls_act_through_the_services(browser: Client, ready_node: Callable[..., Node]) -> None:
    node = ready_node("n0")
    assert browser.post(f"/dashboard/nodes/{node.id}/pause").status_code == 302
    assert Node.objects.get(pk=node.pk).paused is True
    [row] = browser.get("/dashboard/nodes/live.json").json()["nodes"]
    assert row["status"] == "paused" and row["device_type"] == "cpu"
    assert browser.post(f"/dashboard/nodes/{node.id}/resume").status_code == 302
    assert browser.get("/dashboard/nodes/live.json").json()["nodes"][0]["status"] == "ready"
    p = str(node.id)
    saved = browser.post(f"/dashboard/nodes/{node.id}/controls", {
        f"{p}-work_windows": "22:00-07:00, 12:00-13:00", f"{p}-idle_only": "on", f"{p}-idle_cpu_threshold": "0.3",
        f"{p}-max_threads": "2", f"{p}-max_memory_bytes": "",
    })
    assert saved.status_code == 302
    node.refresh_from_db()
    assert (node.work_windows, node.idle_only, node.idle_cpu_threshold, node.max_threads, node.max_memory_bytes) == (
        ["22:00-07:00", "12:00-13:00"], True, 0.3, 2, None)
    bad = browser.post(f"/dashboard/nodes/{node.id}/controls", {
        f"{p}-work_windows": "25:00-26:00", f"{p}-idle_cpu_threshold": "2", f"{p}-max_threads": "0"})
    body = bad.content.decode()
    assert bad.status_code == 400 and "work_windows" in body and "less than or equal to 1" in body
    node.refresh_from_db()
    assert node.max_threads == 2  # nothing of a refused form is saved
    assert browser.get(f"/dashboard/nodes/{node.id}/pause").status_code == 405  # a GET changes nothing


def test_the_market_shows_prices_and_their_history(browser: Client, ready_node: Callable[..., Node]) -> None:
    ready_node("n0")
    prices_reprice()
    market = browser.get("/dashboard/market/live.json").json()
    [price] = market["prices"]
    assert price["price_per_hour"] > 0
    assert [p["price_per_hour"] for p in market["history"][price["device_class"]]] == [
        c.price_per_hour for c in PriceChange.objects.order_by("created_at")
    ]
    assert price["device_class"] in browser.get("/dashboard/market/").content.decode()


def test_cancelling_a_job_from_its_page(browser: Client, stranger: Client, queued_job: Callable[..., Job]) -> None:
    job = queued_job()
    assert browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["cancellable"] is True
    assert stranger.post(f"/dashboard/jobs/{job.id}/cancel").status_code == 404
    assert browser.get(f"/dashboard/jobs/{job.id}/cancel").status_code == 405
    assert browser.post(f"/dashboard/jobs/{job.id}/cancel")["Location"] == f"/dashboard/jobs/{job.id}/"
    assert Job.objects.get(pk=job.pk).status == "cancelled"
    assert browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["cancellable"] is False
    again = browser.post(f"/dashboard/jobs/{job.id}/cancel")
    assert again.status_code == 409 and "nothing to cancel" in again.content.decode()


def test_the_pipeline_shows_each_replica_of_a_replicated_stage(
    browser: Client, ready_node: Callable[..., Node], queued_job: Callable[..., Job]
) -> None:
    """Each replica with what it does, its share of its stage's micro-batches and its speed, as the driver measured
    them (its timings of the replicas' steps, through the service it writes them with); the replica counts."""
    nodes = {n.pk: n for n in (ready_node(f"r{i}", port=50051 + i) for i in range(7))}
    job = queued_job(replicas={"min": 2, "max": 3})
    reconcile_once()
    placing = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["pipeline"]
    assert {s["activity"] for s in placing["stages"]} == {"pending"}  # no agent has reported a build yet
    assert [s["share"] for s in placing["stages"]] == [None] * 6
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(status="running", driver_lease_owner="",
                                         driver_lease_expires_at=now + timedelta(seconds=60))
    job_driver_claim(job_id=job.id, owner="driver", now=now)
    rows = list(Stage.objects.filter(job=job).order_by("index", "replica"))
    Stage.objects.filter(job=job).update(observed_generation=rows[0].generation, observed_state="ready")
    # replica 1 of stage 1 is three times as fast as replica 0 and took 3 of the 4 micro-batches of each step
    taken = {(1, 0): (1, 8, 0.04), (1, 1): (3, 24, 0.04)}
    step = [StageTiming(r.index, taken.get((r.index, r.replica), (2, 16, 0.02))[2], 0.001, 0.05,
                        node_id=str(r.node_id), samples=taken.get((r.index, r.replica), (2, 16))[1],
                        micro_batches=taken.get((r.index, r.replica), (2,))[0]) for r in rows]
    points = [StepPoint(1, s, 90, 2.0, 800.0) for s in (1, 2)]
    assert job_record_steps(job_id=job.id, lease_owner="driver", points=points,
                            timings=stage_timings_mean([step, step]), now=now)
    Stage.objects.filter(job=job, index=1, replica=1).update(micro_batches=7)
    live = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()
    stages = {(s["stage_index"], s["replica"]): s for s in live["pipeline"]["stages"]}
    assert sorted(stages) == [(i, r) for i in range(3) for r in range(2)]
    assert stages[(1, 1)]["micro_batches"] == 7
    assert (stages[(1, 0)]["share"], stages[(1, 1)]["share"]) == (0.25, 0.75)
    assert (stages[(1, 0)]["samples_per_second"], stages[(1, 1)]["samples_per_second"]) == pytest.approx((200, 600))
    assert {stages[(i, r)]["share"] for i in (0, 2) for r in (0, 1)} == {0.5}
    assert {s["activity"] for s in stages.values()} == {"training"} and not any(s["joining"] for s in stages.values())
    assert live["pipeline"]["replicas"] == {"min": 2, "max": 3, "per_stage": [2, 2, 2], "training": 6}
    assert live["samples_per_second"] == 800.0
    # the API lists the same replicas with the same figures
    placements = APIClient()
    placements.force_authenticate(job.owner)
    detail = {(p["stage_index"], p["replica"]): p for p in placements.get(f"/api/jobs/{job.id}").json()["placements"]}
    for key, shown in stages.items():
        assert (detail[key]["activity"], detail[key]["share"], detail[key]["samples_per_second"],
                detail[key]["step_micro_batches"]) == (
            shown["activity"], shown["share"], shown["samples_per_second"], taken.get(key, (2,))[0])

    # a replica added while the job runs is joining until it takes a micro-batch; one whose node is paused leaves
    spare = next(n for pk, n in nodes.items() if pk not in {r.node_id for r in rows})
    Stage.objects.create(job=job, index=2, replica=9, layer_start=rows[-1].layer_start, layer_end=rows[-1].layer_end,
                         node=spare, generation=rows[0].generation, joining=True)
    Node.objects.filter(pk=rows[0].node_id).update(paused=True)
    pipeline = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["pipeline"]
    activity = {(s["stage_index"], s["replica"]): s["activity"] for s in pipeline["stages"]}
    assert (activity[(2, 9)], activity[(0, 0)], activity[(0, 1)]) == ("joining", "leaving", "training")
    assert pipeline["replicas"]["per_stage"] == [2, 2, 3] and pipeline["replicas"]["training"] == 5
    Stage.objects.filter(job=job, index=2, replica=9).update(  # built, copied its peer's state, took two
        observed_generation=rows[0].generation, observed_state="ready", micro_batches=2)
    pipeline = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["pipeline"]
    assert next(s for s in pipeline["stages"] if s["replica"] == 9)["activity"] == "training"
    # the driver fences a live replica: it shows fenced, until when, and no share, until it joins again
    generation = rows[0].generation
    assert stage_record_fenced(job_id=job.id, lease_owner="driver", generation=generation,
                               fence=ReplicaFence(1, 1, 7, 6), now=timezone.now())
    pipeline = browser.get(f"/dashboard/jobs/{job.id}/live.json").json()["pipeline"]
    stages = {(s["stage_index"], s["replica"]): s for s in pipeline["stages"]}
    assert (stages[(1, 1)]["activity"], stages[(1, 1)]["fenced_until_step"], stages[(1, 1)]["share"],
            stages[(1, 1)]["fences"]) == ("fenced", 7, 0.0, 1)
    assert stages[(1, 0)]["share"] == 1.0 and pipeline["replicas"]["training"] == 5
    shown = {(p["stage_index"], p["replica"]): p for p in placements.get(f"/api/jobs/{job.id}").json()["placements"]}
    assert (shown[(1, 1)]["activity"], shown[(1, 1)]["fenced_until_step"], shown[(1, 1)]["fences"]) == ("fenced", 7, 1)
    assert stage_record_joined(job_id=job.id, lease_owner="driver", generation=generation,
                               join=ReplicaJoin(1, 1, 0, 10, "a", "a"), now=timezone.now())
    shown = {(p["stage_index"], p["replica"]): p for p in placements.get(f"/api/jobs/{job.id}").json()["placements"]}
    assert (shown[(1, 1)]["activity"], shown[(1, 1)]["fenced_until_step"]) == ("training", None)
    page = browser.get(f"/dashboard/jobs/{job.id}/").content.decode()
    assert 'id="stat-replicas"' in page
