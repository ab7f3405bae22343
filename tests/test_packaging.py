"""A contributor's install: the wheel built from a fresh clone of HEAD carries the gRPC stubs, and
`arceus[agent]` installs an agent without the control plane (no Django, Celery or psycopg). The install is
devtools.agent_wheel's, made once per session (`installed_agent`, tests/conftest.py); the end-to-end SIGTERM test
trains on it.
"""

from __future__ import annotations

import io
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from devtools.agent_wheel import InstalledAgent

pytestmark = pytest.mark.slow


def _run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs)


def test_the_agent_installs_from_a_fresh_clone_without_the_control_plane(
    installed_agent: InstalledAgent, tmp_path: Path
) -> None:
    names = zipfile.ZipFile(installed_agent.wheel).namelist()
    for stub in ("stage_pb2.py", "stage_pb2_grpc.py", "link_probe_pb2.py", "tensor_parallel_pb2_grpc.py"):
        assert f"arceus/v1/{stub}" in names
    venv, python = installed_agent.venv, installed_agent.python

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ARCEUS_NODE_TOKEN")}
    # scikit-learn stays: stage 0 and the last stage read the bundled digits themselves (arceus.data.step_data).
    for module in ("django", "rest_framework", "celery", "psycopg", "gunicorn"):
        result = _run(python, "-c", f"import {module}", env=env, cwd=tmp_path)
        assert f"No module named '{module}'" in result.stderr, f"{module} is installed with arceus[agent]"
    imported = _run(python, "-c", "import nodeagent.cli, arceus.v1.stage_pb2_grpc, nodeagent, sklearn; "
                    "print(nodeagent.__file__)", env=env, cwd=tmp_path)
    assert imported.returncode == 0 and str(venv) in imported.stdout, imported.stderr

    agent = installed_agent.command
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
