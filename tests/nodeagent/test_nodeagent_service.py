"""`arceus-agent service install`: the systemd user unit it writes, and what it tells its owner."""

from __future__ import annotations

import io
import plistlib
import sys
from pathlib import Path

import pytest

from nodeagent.cli import main


def test_install_writes_a_user_unit_that_runs_the_settings_and_outlasts_a_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys  # noqa: ANN001
) -> None:
    config = tmp_path / "my 100% settings" / "agent.toml"  # a space and a systemd specifier, quoted
    monkeypatch.setattr("sys.stdin", io.StringIO("arceus_node_secret\n"))
    assert main(["init", "--control-plane", "http://127.0.0.1:1", "--token-stdin", "--config", str(config)]) == 0
    capsys.readouterr()
    units = tmp_path / "systemd-user"
    assert main(["service", "install", "--config", str(config), "--unit-dir", str(units)]) == 0
    unit = (units / "arceus-agent.service").read_text()
    config_word = f'"{tmp_path}/my 100%% settings/agent.toml"'
    assert f'ExecStart="{sys.executable}" "-m" "nodeagent" "run" "--config" {config_word}' in unit
    assert "TimeoutStopSec=150" in unit  # above the default --leave-timeout (120 s): a stop drains the node
    assert "Restart=on-failure" in unit and "WantedBy=default.target" in unit
    assert "arceus_node_secret" not in unit  # the token stays in its 0600 file
    out = capsys.readouterr().out
    assert "systemctl --user enable --now arceus-agent" in out
    assert f"remove it:  systemctl --user disable --now arceus-agent && rm {units / 'arceus-agent.service'}" in out


def test_install_refuses_without_settings(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    missing = tmp_path / "agent.toml"
    assert main(["service", "install", "--config", str(missing), "--unit-dir", str(tmp_path)]) == 2
    assert "run `arceus-agent init --control-plane URL --token-stdin` first" in capsys.readouterr().err
    assert not (tmp_path / "arceus-agent.service").exists()


def test_install_for_macos_writes_a_launchd_agent_that_outlasts_a_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys  # noqa: ANN001
) -> None:
    config = tmp_path / "agent.toml"
    monkeypatch.setattr("sys.stdin", io.StringIO("arceus_node_secret\n"))
    assert main(["init", "--control-plane", "http://127.0.0.1:1", "--token-stdin", "--config", str(config)]) == 0
    capsys.readouterr()
    agents = tmp_path / "LaunchAgents"
    assert main(["service", "install", "--platform", "macos", "--config", str(config), "--unit-dir", str(agents)]) == 0
    path = agents / "org.arceus.agent.plist"
    agent = plistlib.loads(path.read_bytes())
    assert agent["ProgramArguments"] == [sys.executable, "-m", "nodeagent", "run", "--config", str(config)]
    assert agent["ExitTimeOut"] == 150 and agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"]
    assert b"arceus_node_secret" not in path.read_bytes()
    out = capsys.readouterr().out
    assert f"launchctl bootstrap gui/$(id -u) {path}" in out
    assert f"remove it:  launchctl bootout gui/$(id -u) {path} && rm {path}" in out
