"""The dashboard in a real browser, on a real cluster, in one scenario (a cluster's agents and a job are the
expensive part): a developer logs in, sees the estimate of a job in the submit form and submits it, watches
its loss curve gain points while real agents train it, sees a stage move to the spare node after its agent is
killed, cancels it from its page, and then sees the contributor's earnings and the market; no page logs a console
error. Each page's screenshot is saved under the test's work directory (its path is printed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions

from devtools.cluster import LocalCluster, ManageCommand
from tests.e2e.browser import assert_styled, console_errors, live_wait

pytestmark = pytest.mark.slow

FORM = {
    "name": "dashboard-digits",
    "model_config": json.dumps({"layer_sizes": [64, 128, 64, 10]}),
    "dataset_config": json.dumps({"name": "digits", "batch_size": 32, "val_batch_size": 360}),
    "epochs": "200",  # far more than the test waits for: it is cancelled from its page once a stage has moved
    "learning_rate": "0.05",
    "micro_batches": "2",
    "stages": "2",
    "checkpoint_interval_steps": "10",
}


def chart_points(browser: webdriver.Chrome, canvas: str) -> list[float | None]:
    """The values a Chart.js chart draws (its first dataset, or the sum over datasets per label)."""
    return browser.execute_script(
        "const c = Chart.getChart(arguments[0]);"
        "return c.data.labels.map((_, i) => c.data.datasets.reduce((a, d) => a + (Number(d.data[i]) || 0), 0));",
        canvas,
    )


def stage_node(browser: webdriver.Chrome, index: int) -> str | None:
    """The node shown for a stage, read in one script: the pipeline is redrawn on every poll, so an element
    found first and read after may be gone."""
    return browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e === null ? null : e.innerText;",
        f"#pipeline .stage[data-index='{index}'] .node",
    )


def test_a_developer_and_contributor_watch_it_live(
    cluster: LocalCluster, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    wait = live_wait(browser, 60)

    def snap(name: str) -> None:
        browser.save_screenshot(str(shots / f"{name}.png"))
        assert console_errors(browser) == [], name

    agents = {a.name: a for a in cluster.start_agents(["dash-a", "dash-b", "dash-c"])}
    base = cluster.api_url.replace("127.0.0.1", "localhost")  # a secure context keeps the Secure session cookie
    browser.get(f"{base}/dashboard/")
    assert browser.current_url.startswith(f"{base}/dashboard/login/")
    browser.find_element(By.ID, "id_username").send_keys("demo")
    browser.find_element(By.ID, "id_password").send_keys("arceus-demo")
    snap("login")
    browser.find_element(By.ID, "login-submit").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "submit-form")))
    assert_styled(browser, base)

    for field, value in FORM.items():
        element = browser.find_element(By.ID, f"id_{field}")
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "id_owner_diversity").click()  # unticked: the three agents are the demo user's
    browser.find_element(By.ID, "estimate-button").click()
    estimate = wait.until(expected_conditions.presence_of_element_located((By.ID, "estimate-result")))
    assert "samples/s" in estimate.text and "$" in estimate.text
    snap("jobs")
    browser.find_element(By.ID, "submit-button").click()
    wait.until(expected_conditions.url_matches(r"/dashboard/jobs/[0-9a-f-]{36}/$"))
    job_id = browser.current_url.rstrip("/").rsplit("/", 1)[1]

    # The loss curve gains points while the agents train (the page polls its live document).
    wait.until(lambda b: len(chart_points(b, "loss-chart")) >= 3)
    seen = len(chart_points(browser, "loss-chart"))
    wait.until(lambda b: len(chart_points(b, "loss-chart")) > seen)
    wait.until(lambda b: "compute" in b.find_element(By.CSS_SELECTOR, "#pipeline .stage .timing").text
               and "–" not in b.find_element(By.CSS_SELECTOR, "#pipeline .stage .timing").text)
    assert "ideal" in browser.find_element(By.ID, "pipeline-summary").text
    snap("job-training")

    # Its stage 1's agent is killed: the page shows the stage on the spare node, and the move among the events.
    victim = stage_node(browser, 1)
    spare = next(name for name in agents if name not in {victim, stage_node(browser, 0)})
    cluster.crash(f"agent-{victim}")
    live_wait(browser, 90, poll=0.3).until(lambda b: stage_node(b, 1) == spare)
    live_wait(browser, 60, poll=0.3).until(
        lambda b: any(f"stage 1 moved from {victim} to {spare}" in e.text
                      for e in b.find_elements(By.CSS_SELECTOR, "#events .event-moved")))
    snap("job-moved")

    # Checkpoints (every 10 steps) with the newest one's download; then the owner cancels the job from its page.
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#checkpoints li"))
    assert browser.find_element(By.ID, "download-model").is_displayed()
    browser.find_element(By.ID, "cancel-button").click()
    wait.until(lambda b: b.find_element(By.ID, "job-status").text == "cancelled")
    assert cluster.client.job(job_id)["status"] == "cancelled"
    assert not browser.find_element(By.ID, "cancel-form").is_displayed()
    snap("job-cancelled")

    # Prices are posted every 30 s (beat): one posting now, through the service, so the market has a history.
    reprice = ManageCommand(["shell", "-c", "from controlplane.market.services import prices_reprice; "
                                            "prices_reprice()"], env=cluster.env)

    # The contributor's side: their devices, and what they earned on this job, charted.
    browser.get(f"{base}/dashboard/nodes/")
    wait.until(lambda b: sum(chart_points(b, "earnings-job-chart")) > 0)
    assert sum(chart_points(browser, "earnings-day-chart")) > 0
    statuses = {s.find_element(By.TAG_NAME, "h2").text.split()[0]: s.find_element(By.CLASS_NAME, "node-status").text
                for s in browser.find_elements(By.CSS_SELECTOR, "section.node")}
    assert statuses[victim] == "unreachable" and statuses[spare] in {"ready", "training"}
    snap("contributors")

    reprice.communicate()
    browser.get(f"{base}/dashboard/market/")
    row = wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#prices tbody tr")))
    device_class = row.find_element(By.TAG_NAME, "td").text
    history = dict(browser.execute_script(
        "return Chart.getChart('price-chart').data.datasets.map(d => [d.label, d.data.length]);"))
    assert history.get(device_class, 0) >= 1, history  # this posting, and any beat made while the job ran
    snap("market")
