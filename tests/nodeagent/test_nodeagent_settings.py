"""`arceus-agent init`: the settings file and the node token, which never travels on the command line."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest

from nodeagent.cli import main
from nodeagent.node_token import TokenError, read_token_file, resolve_token
from nodeagent.settings import SettingsError, load_settings


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def _no_token_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARCEUS_NODE_TOKEN", raising=False)


def test_init_stores_the_token_from_stdin_in_a_0600_file_and_writes_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "conf" / "agent.toml"
    monkeypatch.setattr("sys.stdin", io.StringIO("node-secret-123\n"))
    argv = ["init", "--control-plane", "https://cp.example", "--token-stdin", "--device", "cpu", "--threads", "2"]
    assert main([*argv, "--config", str(config)]) == 0
    token_file = tmp_path / "conf" / "node-token"
    assert _mode(token_file) == 0o600 and _mode(config) == 0o600
    assert read_token_file(token_file) == "node-secret-123"
    settings = load_settings(config)
    assert (settings.control_plane, settings.token_file, settings.device, settings.threads) == (
        "https://cp.example", str(token_file), "cpu", 2
    )
    assert "node-secret-123" not in config.read_text()  # only the token file's path
    assert f"settings written to {config}" in capsys.readouterr().out


def test_init_takes_the_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCEUS_NODE_TOKEN", "from-env")
    config = tmp_path / "agent.toml"
    assert main(["init", "--control-plane", "http://127.0.0.1:8000", "--config", str(config)]) == 0
    assert read_token_file(tmp_path / "node-token") == "from-env"


def test_init_without_a_token_says_the_three_ways_to_give_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["init", "--control-plane", "http://h:1", "--config", str(tmp_path / "agent.toml")])
    assert info.value.code == 2
    assert "--token-stdin" in capsys.readouterr().err and not (tmp_path / "agent.toml").exists()


def test_init_refuses_a_token_file_others_can_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("abc\n")
    token_file.chmod(0o640)
    config = tmp_path / "agent.toml"
    argv = ["init", "--control-plane", "http://h:1", "--token-file", str(token_file), "--config", str(config)]
    assert main(argv) == 2
    assert f"run `chmod 600 {token_file}`" in capsys.readouterr().err and not config.exists()
    token_file.chmod(0o600)
    assert main(argv) == 0
    assert load_settings(config).token_file == str(token_file)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_group_or_world_readable_token_file_is_refused(tmp_path: Path, mode: int) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("abc")
    token_file.chmod(mode)
    with pytest.raises(TokenError, match=rf"readable by other users \(mode 0{mode:o}\); run `chmod 600 "):
        resolve_token(token_file, environ={})


def test_the_environment_variable_wins_over_the_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    token_file.chmod(0o600)
    assert resolve_token(token_file, environ={"ARCEUS_NODE_TOKEN": "from-env"}) == ("from-env", "ARCEUS_NODE_TOKEN")
    assert resolve_token(token_file, environ={}) == ("from-file", str(token_file))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('control_plane = "http://h:1"\ntoken_file = "/t"\nthreds = 4\n', "unknown setting 'threds'; the settings are"),
        ('control_plane = "h:1"\ntoken_file = "/t"\n', "control_plane must be the control plane's http:// or https://"),
        ('control_plane = "http://h:1"\ntoken_file = "/t"\nthreads = 0\n', "threads must be a positive integer, got 0"),
        ('control_plane = "http://h:1"\ntoken_file = "/t"\ndevice = "tpu"\n', "device must be one of cuda, mps, cpu"),
        ('control_plane = "http://h:1"\ntoken_file = "/t"\nlisten = "localhost"\n', "listen must be HOST:PORT"),
        ('control_plane = "http://h:1"\ntoken_file = "/t"\nexchange_port = 0\n',
         "exchange_port must be a port in 1..65535"),
        ('control_plane = "http://h:1"\ntoken_file = "/t"\nadvertise_exchange = "203.0.113.7"\n',
         "advertise_exchange must be HOST:PORT"),
        ('token_file = "/t"\n', "control_plane is missing; run `arceus-agent init`"),
        ('control_plane = "http://h:1\n', "is not valid TOML"),
    ],
)
def test_a_bad_settings_file_is_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        load_settings(config)
    assert str(config) in str(info.value)


def test_run_with_a_bad_settings_file_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('control_plane = "http://h:1"\ntoken_file = "/t"\nthreads = "four"\n')
    with pytest.raises(SystemExit) as info:
        main(["run", "--config", str(config)])
    assert info.value.code == 2
    assert f"{config}: threads must be a positive integer, got 'four'" in capsys.readouterr().err
