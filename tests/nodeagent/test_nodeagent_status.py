"""`arceus-agent status`: an agent started from its settings reports its registration, device, stages and
the owner's controls, as of its last heartbeat answer."""

from __future__ import annotations

import io
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from devtools.launch import spawn_agent, stop_agents
from nodeagent.cli import main
from tests.nodeagent.conftest import ASSIGNMENT

pytestmark = pytest.mark.slow


def test_status_before_the_agent_ever_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    config = tmp_path / "agent.toml"
    monkeypatch.setattr("sys.stdin", io.StringIO("tok\n"))
    assert main(["init", "--control-plane", "http://127.0.0.1:1", "--token-stdin", "--config", str(config)]) == 0
    capsys.readouterr()
    monkeypatch.delenv("ARCEUS_NODE_TOKEN", raising=False)
    assert main(["status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"node token:    in {tmp_path / 'node-token'} (mode 0600)" in out
    assert "registration:  none yet: the agent has not run with these settings" in out
    assert "earnings:      unknown (GET http://127.0.0.1:1/api/agent/earnings failed" in out


def test_an_agent_run_from_its_settings_shows_its_node_device_stage_and_controls(
    control_plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys  # noqa: ANN001 - fixtures
) -> None:
    control_plane.interval = 0.2
    control_plane.assignments = [ASSIGNMENT]
    control_plane.max_threads = 3
    today = datetime.now(UTC).date().isoformat()
    control_plane.earnings = {"credit_usd": "0.003400", "withheld_usd": "0.000000",
                              "per_day": [{"day": "2020-01-01", "credit_usd": "0.002200"},
                                          {"day": today, "credit_usd": "0.001200"}]}
    config = tmp_path / "agent.toml"
    monkeypatch.setattr("sys.stdin", io.StringIO(control_plane.token))
    assert main(["init", "--control-plane", control_plane.url, "--token-stdin", "--device", "cpu", "--threads", "1",
                 "--config", str(config)]) == 0
    env = {k: v for k, v in os.environ.items() if k != "ARCEUS_NODE_TOKEN"}
    agent = spawn_agent(["run", "--config", str(config)], log_path=tmp_path / "agent.log", env=env)
    try:
        assert control_plane.token not in " ".join(psutil.Process(agent.process.pid).cmdline())
        status_file = tmp_path / "status.json"
        deadline = time.monotonic() + 20
        while not (status_file.exists() and "ready" in status_file.read_text()):
            assert time.monotonic() < deadline, agent.log_text()
            time.sleep(0.05)
        capsys.readouterr()
        assert main(["status", "--config", str(config)]) == 0
        out = capsys.readouterr().out
    finally:
        control_plane.assignments = []  # nothing to hand over: it leaves at once
        assert stop_agents([agent]) == [0]
    assert f"control plane: {control_plane.url}" in out
    assert "registration:  node node-1, last heartbeat answer" in out
    assert f"(agent pid {agent.process.pid}, running)" in out
    assert f"device:        cpu, serving gRPC at {agent.grpc_address}" in out
    assert f"stages:        {ASSIGNMENT['stage_id']} generation {ASSIGNMENT['generation']}: ready" in out
    assert "controls:      at most 3 compute threads" in out
    assert "earnings:      $0.001200 today (UTC), $0.003400 in all\n" in out
    assert json.loads(status_file.read_text())["pid"] == agent.process.pid
    assert main(["status", "--config", str(config)]) == 0
    assert f"(agent pid {agent.process.pid}, not running)" in capsys.readouterr().out
