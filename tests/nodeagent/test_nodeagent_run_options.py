"""What `arceus-agent run` runs with: the settings file under the flags, checked before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nodeagent.cli import build_parser
from nodeagent.run_options import ControlPlaneLogin, UsageError, run_options


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("ARCEUS_NODE_TOKEN", raising=False)
    token_file = tmp_path / "node-token"
    token_file.write_text("node-secret\n")
    token_file.chmod(0o600)
    config = tmp_path / "agent.toml"
    config.write_text(f'control_plane = "http://cp.example:8000"\ntoken_file = "{token_file}"\ndevice = "cpu"\n'
                      'threads = 2\nlisten = "127.0.0.1:7001"\n')
    return config


def test_the_settings_file_gives_the_defaults_and_a_flag_given_wins(settings: Path) -> None:
    options = run_options(build_parser(), ["--config", str(settings), "--threads", "1"])
    assert options.control_plane == ControlPlaneLogin("http://cp.example:8000", "node-secret")
    assert "node-secret" not in repr(options)  # a logged options object shows no token
    assert (options.threads, options.listen, options.device) == (1, "127.0.0.1:7001", torch.device("cpu"))
    assert options.status_path == settings.with_name("status.json")  # reported for `arceus-agent status`
    assert options.static_assignments == []


def test_a_router_forwarding_the_exchange_listener_is_set_in_the_settings_file_or_by_flags(settings: Path) -> None:
    with settings.open("a") as file:
        file.write('exchange_port = 7002\nadvertise_exchange = "203.0.113.7:17002"\n')
    options = run_options(build_parser(), ["--config", str(settings)])
    assert (options.exchange_port, options.advertise_exchange) == (7002, "203.0.113.7:17002")
    options = run_options(build_parser(), ["--config", str(settings), "--exchange-port", "7003"])
    assert (options.exchange_port, options.advertise_exchange) == (7003, "203.0.113.7:17002")


def test_the_environment_token_and_a_given_control_plane_need_no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCEUS_NODE_TOKEN", "from-env")
    options = run_options(build_parser(), ["--control-plane", "http://127.0.0.1:1", "--device", "cpu"])
    assert options.control_plane == ControlPlaneLogin("http://127.0.0.1:1", "from-env")
    assert options.status_path is None and options.threads is None


def test_a_tls_key_without_its_certificate_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCEUS_NODE_TOKEN", "t")
    argv = ["--control-plane", "http://127.0.0.1:1", "--device", "cpu", "--tls-key-file", str(tmp_path / "key.pem")]
    with pytest.raises(UsageError, match="--tls-key-file and --tls-cert-file go together"):
        run_options(build_parser(), argv)
