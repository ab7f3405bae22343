"""The operator's path in a real browser (Debian's chromium, driven by selenium): the control plane as the README
runs it (collectstatic, gunicorn, DEBUG off), a staff user made with `createsuperuser` logs in to the admin, the
pages are styled with no console errors, and an admin action cancels a running job: the job ends cancelled
through the service, the agents drop its stages and the ledger adds up. The API docs render styled too."""

from __future__ import annotations

import secrets
import time
from decimal import Decimal

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from devtools.cluster import LocalCluster, ManageCommand
from tests.e2e.browser import assert_styled, console_errors

pytestmark = pytest.mark.slow

ADMIN_HEADER_BACKGROUND = "rgba(65, 118, 144, 1)"  # the admin's --header-bg (#417690), from its base.css
JOB = {
    "name": "browser-cancel",
    "model_config": {"layer_sizes": [64, 128, 64, 10]},
    "dataset_config": {"name": "digits", "batch_size": 32, "val_batch_size": 360},
    "epochs": 200,  # far more than the test waits for: it is cancelled while running
    "learning_rate": 0.05,
    "micro_batches": 2,
    "stages": 2,
    "requirements": {"owner_diversity": False},  # every agent here is one owner's
}


def make_operator(cluster: LocalCluster) -> tuple[str, str]:
    """A staff user made as the README says (`manage.py createsuperuser`); its name and password."""
    username, password = f"operator-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    ManageCommand(["createsuperuser", "--noinput", "--username", username, "--email", f"{username}@example.org"],
                  env={**cluster.env, "DJANGO_SUPERUSER_PASSWORD": password}).communicate()
    return username, password


def test_an_operator_cancels_a_running_job_in_the_styled_admin(
    cluster: LocalCluster, browser: webdriver.Chrome
) -> None:
    agents = cluster.start_agents(["browser-a", "browser-b"])
    job = cluster.client.submit_job(JOB)
    cluster.client.start_job(job["id"])
    username, password = make_operator(cluster)
    # localhost: a secure context to the browser, which keeps the (Secure) session cookie over plain HTTP.
    base = cluster.api_url.replace("127.0.0.1", "localhost")

    browser.get(f"{base}/admin/login/")
    browser.find_element(By.ID, "id_username").send_keys(username)
    browser.find_element(By.ID, "id_password").send_keys(password)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    WebDriverWait(browser, 30).until(expected_conditions.presence_of_element_located((By.ID, "user-tools")))
    header = browser.find_element(By.ID, "header")
    assert header.value_of_css_property("background-color") == ADMIN_HEADER_BACKGROUND
    assert_styled(browser, base)

    cluster.wait_for_job(job["id"], lambda d: d["status"] == "running" and d["step"] >= 2, timeout=120)
    browser.get(f"{base}/admin/jobs/job/?q={job['id']}")
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{job['id']}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("cancel")
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    message = WebDriverWait(browser, 30).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "ul.messagelist li.success"))
    )
    assert message.text.endswith(": cancelled")
    assert_styled(browser, base)
    assert console_errors(browser) == []

    detail = cluster.client.job(job["id"])
    assert detail["status"] == "cancelled"
    training = next(c for c in detail["conditions"] if c["type"] == "Training")
    assert training["message"] == f"cancelled by operator {username}"
    # Each agent drops its stage at its next heartbeat.
    deadline = time.monotonic() + 30
    logs = {a.name: cluster.supervisor.log_dir / f"agent-{a.name}.log" for a in agents}
    while not all(f"dropped {job['id']}-stage-" in log.read_text() for log in logs.values()):
        assert time.monotonic() < deadline, {name: log.read_text()[-2000:] for name, log in logs.items()}
        time.sleep(0.5)

    # The ledger adds up: the contributors' credits plus the platform's fees are what the developer is charged.
    cost = cluster.client.job(job["id"])["cost"]
    credits = sum(
        Decimal(cluster.client.session.get(f"{cluster.api_url}/api/nodes/{a.node_id}/earnings", timeout=30)
                .json()["credit_usd"])
        for a in agents
    )
    assert credits + Decimal(cost["platform_fee_usd"]) == Decimal(cost["charged_usd"]) > 0


def test_the_api_docs_render_styled(cluster: LocalCluster, browser: webdriver.Chrome) -> None:
    base = cluster.api_url.replace("127.0.0.1", "localhost")
    browser.get(f"{base}/api/docs/")
    title = WebDriverWait(browser, 60).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, ".swagger-ui .info .title"))
    )
    assert title.text.startswith("Arceus control plane API")
    assert_styled(browser, base)
    scripts = browser.execute_script("return [...document.scripts].filter(s => s.src).map(s => s.src)")
    assert scripts and all(src.startswith(base) for src in scripts), scripts  # no CDN
    assert console_errors(browser) == []
