"""`arceus nodes create` prints the commands that start the new node's agent: each runs as printed, in a shell,
and the agent registers with the control plane as that node (the token never on its command line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from arceus.cli import main as cli_main
from devtools.cluster import AGENT_READY_PREFIX, LocalCluster
from devtools.supervisor import Child

pytestmark = pytest.mark.slow


def _shell_env(config_home: Path) -> dict[str, str]:
    """A contributor's shell: `arceus-agent` on the PATH (this venv's), no node token set, settings of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("ARCEUS_NODE_TOKEN", "PROMETHEUS_MULTIPROC_DIR")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_CONFIG_HOME"] = str(config_home)
    return env


def _serving(cluster: LocalCluster, name: str, line: str, env: dict[str, str], cwd: Path) -> tuple[Child, str]:
    """Run a printed line that starts an agent; the agent and the gRPC address it registered."""
    child = cluster.supervisor.start(name, ["bash", "-c", line], env=env, cwd=cwd)
    ready = cluster.supervisor.wait_for_log_line(child, AGENT_READY_PREFIX, timeout=60)
    return child, dict(part.split("=", 1) for part in ready.split()[2:])["grpc"]


def _wait_until_registered(cluster: LocalCluster, node_id: str, grpc_address: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        node = next(n for n in cluster.client.nodes() if n["id"] == node_id)
        if node["grpc_address"] == grpc_address and node["ready"]["status"] == "True":
            return
        assert time.monotonic() < deadline, node
        time.sleep(0.2)


def _leaves_cleanly(child: Child) -> None:
    os.killpg(child.process.pid, signal.SIGTERM)  # it hosts nothing: it leaves at once
    assert child.process.wait(30) == 0, child.log_tail()


def test_the_printed_agent_commands_start_the_new_nodes_agent(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api_token = cluster.client.session.headers["Authorization"].removeprefix("Token ")
    assert cli_main(["--url", cluster.api_url, "--token", api_token, "nodes", "create", "my-laptop"]) == 0
    out = capsys.readouterr().out
    [node] = [n for n in cluster.client.nodes() if n["name"] == "my-laptop"]
    assert f"node {node['id']} created" in out
    commands = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert len(commands) == 3, out
    node_token = commands[0].split()[0].split("=", 1)[1]
    env = _shell_env(tmp_path / "config")

    # The one-line start: the token in the agent's environment, not in its arguments.
    child, address = _serving(cluster, "agent-printed", commands[0], env, tmp_path)
    try:
        assert node_token not in " ".join(psutil.Process(child.process.pid).cmdline())
        _wait_until_registered(cluster, node["id"], address)
    finally:
        _leaves_cleanly(child)

    # Set up once (the token kept in a 0600 file beside the settings), then started from the settings.
    init = subprocess.run(["bash", "-c", commands[1]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert init.returncode == 0, init.stderr
    assert (tmp_path / "config" / "arceus-agent" / "node-token").read_text().strip() == node_token
    child, address = _serving(cluster, "agent-printed-run", commands[2], env, tmp_path)
    try:
        _wait_until_registered(cluster, node["id"], address)
    finally:
        _leaves_cleanly(child)
