"""A real browser for the end-to-end tests: Debian's chromium, headless, driven by selenium through Debian's
chromedriver (the Makefile installs both), and what the tests read from it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@contextmanager
def chromium(profile: Path) -> Iterator[webdriver.Chrome]:
    """A headless chromium with its own profile directory, its console log kept for `console_errors`."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1000", f"--user-data-dir={profile}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def live_wait(browser: webdriver.Chrome, seconds: float, poll: float = 0.2) -> WebDriverWait:
    """A wait for pages that re-render while it polls (the live job page redraws its lists; a form post reloads
    the page): an element found by one poll and replaced before it is read is looked up again by the next."""
    return WebDriverWait(browser, seconds, poll_frequency=poll, ignored_exceptions=(StaleElementReferenceException,))


def console_errors(browser: webdriver.Chrome) -> list[str]:
    """The console's errors since the last call (the log is read once)."""
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def assert_styled(browser: webdriver.Chrome, base_url: str) -> None:
    """Every stylesheet of the page loaded (the browser parsed its rules) and is served as CSS."""
    sheets = browser.execute_script(
        "return [...document.styleSheets].filter(s => s.href).map(s => [s.href, s.cssRules.length])"
    )
    assert sheets, "the page links no stylesheet"
    for href, rules in sheets:
        assert href.startswith(base_url), f"{href} is not served by the control plane"
        assert rules > 0, f"{href} has no rules: the browser refused it"
        response = requests.get(href, timeout=30)
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/css"), href
