"""The web server and the Celery processes refuse to serve on the public development SECRET_KEY."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.common.startup import refuse_development_secret

ROOT = Path(__file__).resolve().parents[3]


def test_the_development_key_is_refused_outside_debug_only(settings) -> None:  # noqa: ANN001
    settings.SECRET_KEY, settings.DEBUG = settings.DEVELOPMENT_SECRET_KEY, False
    with pytest.raises(ImproperlyConfigured, match="ARCEUS_SECRET_KEY is not set"):
        refuse_development_secret()
    settings.DEBUG = True
    refuse_development_secret()  # development
    settings.SECRET_KEY, settings.DEBUG = "an operator's own secret, long and random", False
    refuse_development_secret()


def without_a_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("ARCEUS_SECRET_KEY", "ARCEUS_DEBUG")}


def test_the_web_server_will_not_start_on_it() -> None:
    load = [sys.executable, "-c", "import controlplane.asgi"]  # what gunicorn does first
    refused = subprocess.run(load, cwd=ROOT, env=without_a_key(), capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "ARCEUS_SECRET_KEY is not set" in refused.stderr
    own = {**without_a_key(), "ARCEUS_SECRET_KEY": "an operator's own secret, long and random"}
    assert subprocess.run(load, cwd=ROOT, env=own, timeout=120).returncode == 0


@pytest.mark.parametrize("role", [["worker", "--pool", "solo", "-Q", "control"], ["beat"]])
def test_celery_will_not_start_on_it(role: list[str], tmp_path: Path) -> None:
    command = [sys.executable, "-m", "celery", "-A", "controlplane.celery", *role, "--loglevel", "INFO"]
    if role[0] == "beat":
        command += ["--schedule", str(tmp_path / "beat-schedule")]
    refused = subprocess.run(command, cwd=ROOT, env=without_a_key(), capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "ARCEUS_SECRET_KEY is not set" in refused.stderr + refused.stdout
