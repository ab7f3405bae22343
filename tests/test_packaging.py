"""A contributor's install: the wheel built from a fresh clone of HEAD carries the gRPC stubs, and
`arceus[agent]` installs an agent without the control plane (no Django, Celery or psycopg).

uv builds and installs (a warm run takes seconds where pip takes a minute, mostly unpacking torch), from the
package sources pip is configured with, as `make install` uses them; torch is the Makefile's pin, whose CPU
wheel those sources carry (an unpinned torch pulls CUDA packages).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).parent / "uv"

pytestmark = pytest.mark.slow


def _pip_sources() -> list[str]:
    """uv's options for the find-links and extra indexes pip's configuration names, every version of each
    package from all of them considered together, as pip does."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    options = ["--index-strategy", "unsafe-best-match"]
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = {"find-links": "--find-links", "extra-index-url": "--extra-index-url"}.get(key.rpartition(".")[2])
        for source in value.strip("'\"").split() if option else []:
            if [option, source] not in [options[i : i + 2] for i in range(2, len(options), 2)]:
                options += [option, source]
    return options


def _run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs)


def test_the_agent_installs_from_a_fresh_clone_without_the_control_plane(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    assert _run("git", "clone", "--quiet", REPO_ROOT, clone).returncode == 0
    built = _run(UV, "build", "--quiet", "--out-dir", tmp_path / "dist", clone)  # sdist, then the wheel from it
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("arceus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for stub in ("stage_pb2.py", "stage_pb2_grpc.py", "link_probe_pb2.py", "tensor_parallel_pb2_grpc.py"):
        assert f"arceus/v1/{stub}" in names

    venv = tmp_path / "venv"
    assert _run(UV, "venv", "--quiet", "--python", sys.executable, venv).returncode == 0
    python = venv / "bin" / "python"
    installed = _run(UV, "pip", "install", "--quiet", "--python", python, *_pip_sources(),
                     "torch==2.13.0", f"{wheel}[agent]")
    assert installed.returncode == 0, installed.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ARCEUS_NODE_TOKEN")}
    for module in ("django", "rest_framework", "celery", "psycopg", "gunicorn", "sklearn"):
        result = _run(python, "-c", f"import {module}", env=env, cwd=tmp_path)
        assert f"No module named '{module}'" in result.stderr, f"{module} is installed with arceus[agent]"
    imported = _run(python, "-c", "import nodeagent.cli, arceus.v1.stage_pb2_grpc, nodeagent; "
                    "print(nodeagent.__file__)", env=env, cwd=tmp_path)
    assert imported.returncode == 0 and str(venv) in imported.stdout, imported.stderr

    agent = venv / "bin" / "arceus-agent"
    helped = _run(agent, "--help", env=env, cwd=tmp_path)
    assert helped.returncode == 0 and "arceus-agent init" in helped.stdout, helped.stderr
    config = tmp_path / "conf" / "agent.toml"
    init = _run(agent, "init", "--control-plane", "http://127.0.0.1:9", "--token-stdin", "--config", config,
                input="secret-node-token\n", env=env, cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    status = _run(agent, "status", "--config", config, env=env, cwd=tmp_path)
    assert status.returncode == 0 and "registration:  none yet" in status.stdout, status.stderr
    assert io.StringIO(status.stdout).read().count("secret-node-token") == 0
    service = _run(agent, "service", "install", "--config", config, "--unit-dir", tmp_path / "units", env=env,
                   cwd=tmp_path)
    assert service.returncode == 0, service.stderr
    # The unit runs the installed agent, with the venv's interpreter.
    assert f'ExecStart="{python}" "-m" "nodeagent" "run"' in (tmp_path / "units" / "arceus-agent.service").read_text()
