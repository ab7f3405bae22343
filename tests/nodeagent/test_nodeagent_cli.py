"""`python -m nodeagent` as a process: argument errors, control-plane mode, a rejected token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.launch import spawn_agent, stop_agents
from nodeagent.cli import main
from tests.nodeagent.conftest import ASSIGNMENT

pytestmark = pytest.mark.slow


def run_agent(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ARCEUS_NODE_TOKEN"}
    if token is not None:
        env["ARCEUS_NODE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--config", "/nonexistent/agent.toml"], "no settings at /nonexistent/agent.toml; run `arceus-agent init"),
        (["--control-plane", "http://127.0.0.1:1"], "no node token: set ARCEUS_NODE_TOKEN, or give --token-file"),
        (["--control-plane", "http://127.0.0.1:1", "--token", "t"], "--token is gone: a token on the command line"),
        (["--static-assignment", "x.json", "--control-plane", "http://h"], "drop --control-plane/--token-file"),
        (["--static-assignment", "x.json", "--listen", "localhost"], "is not HOST:PORT"),
        (["--static-assignment", "x.json", "--advertise-exchange", "203.0.113.7"],
         "argument --advertise-exchange: '203.0.113.7' is not HOST:PORT"),
        (["--static-assignment", "x.json", "--exchange-port", "70000"],
         "argument --exchange-port: must be a port in 0..65535"),
        (["--static-assignment", "x.json", "--advertise-exchange", "203.0.113.7:17000"],
         "--advertise-exchange 203.0.113.7:17000 needs --exchange-port PORT: a router forwards to a fixed port"),
        (["--static-assignment", "x.json", "--threads", "0"], "must be a positive integer"),
        (["--static-assignment", "x.json", "--threads", "3", "--solo-threads", "2"], "--solo-threads 2 is below the 3"),
        (["--static-assignment", "x.json", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["--static-assignment", "x.json", "--declare-flops", "fast"], "'fast' is not a number (e.g. 5e10)"),
        (["--static-assignment", "x.json", "--declare-flops", "0"], "must be a positive number, got 0"),
    ],
)
def test_usage_errors_exit_2(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ARCEUS_NODE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert fragment in err and out == ""


def test_invalid_static_assignment_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "static.json"
    path.write_text(json.dumps([{**ASSIGNMENT, "layer_end": 5}]))
    assert main(["--static-assignment", str(path)]) == 2
    err = capsys.readouterr().err
    assert "static_assignment[0].layer_end" in err and str(path) in err


def test_usage_error_from_the_real_entry_point() -> None:
    result = run_agent("--control-plane", "http://127.0.0.1:1")
    assert result.returncode == 2 and "no node token: set ARCEUS_NODE_TOKEN" in result.stderr


def test_rejected_token_exits_1_with_a_clear_message(control_plane) -> None:  # noqa: ANN001 - conftest fixture
    result = run_agent("--control-plane", control_plane.url, "--threads", "1", token="wrong")
    assert result.returncode == 1
    assert "rejected the node token (HTTP 401); check the token" in result.stderr
    assert "AGENT READY" not in result.stdout


def test_control_plane_mode_registers_reports_ready_and_stops_cleanly(control_plane, tmp_path: Path) -> None:  # noqa: ANN001
    control_plane.interval = 0.2
    control_plane.assignments = [ASSIGNMENT]
    agent = spawn_agent(
        ["--control-plane", control_plane.url, "--threads", "1", "--device", "cpu"],
        log_path=tmp_path / "agent.log",
        env={**os.environ, "ARCEUS_NODE_TOKEN": control_plane.token},
    )
    try:
        # The agent first times probes of its link to the control plane, then registers.
        registers = [r for r in control_plane.requests if r[0] == "/api/agent/register"]
        assert control_plane.requests[0][0] == "/api/agent/probe" and len(registers) == 1
        path, headers, body = registers[0]
        assert headers["Authorization"] == "Node good-token"
        assert body["grpc_address"] == agent.grpc_address  # the READY line's address is what it registered
        # The exchange listener's port, on that host: no --advertise-exchange, so no address of its own.
        assert f"{agent.grpc_address.rpartition(':')[0]}:{body['exchange_port']}" == agent.exchange_address
        assert "exchange_address" not in body
        assert body["capabilities"]["device_type"] == "cpu" and body["capabilities"]["flops_fp32"] > 0
        deadline = time.monotonic() + 20
        while not any(o["state"] == "ready" for hb in control_plane.heartbeats() for o in hb["observed"]):
            assert time.monotonic() < deadline, agent.log_text()
            time.sleep(0.05)
    finally:
        control_plane.assignments = []  # nothing to hand over: it leaves at once
        codes = stop_agents([agent])
    assert codes == [0]
    assert agent.log_text().count("AGENT READY") == 1


@pytest.mark.parametrize(
    ("environment", "spin"),
    [
        ({}, "10000"),
        ({"GOMP_SPINCOUNT": "250k"}, "250k"),
        ({"OMP_WAIT_POLICY": "passive"}, "as OMP_WAIT_POLICY=passive sets it"),
    ],
)
def test_the_entry_point_caps_the_openmp_spin_unless_told(
    tmp_path: Path, environment: dict[str, str], spin: str
) -> None:
    """Stages sharing a machine hand cores back and forth; libgomp's default spin (300k) would hold a
    returned core for milliseconds. An operator's own choice is kept. The agent says what it runs with."""
    path = tmp_path / "static.json"
    path.write_text(json.dumps([ASSIGNMENT]))
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | environment
    agent = spawn_agent(
        ["--static-assignment", str(path), "--threads", "1", "--solo-threads", "2"],
        log_path=tmp_path / "agent.log",
        env=env,
    )
    assert stop_agents([agent]) == [0]
    log = agent.log_text()
    assert f"with 1 torch threads (2 in solo actions), OpenMP spin count {spin}, freed blocks " in log
    if sys.platform.startswith("linux"):  # glibc's mallopt (nodeagent.heap)
        assert "freed blocks kept in the heap" in log


def _serving_a_stage(control_plane, tmp_path: Path, *args: str):  # noqa: ANN001, ANN202
    control_plane.interval = 0.2
    control_plane.assignments = [ASSIGNMENT]
    agent = spawn_agent(
        ["--control-plane", control_plane.url, "--threads", "1", "--device", "cpu", *args],
        log_path=tmp_path / "agent.log",
        env={**os.environ, "ARCEUS_NODE_TOKEN": control_plane.token},
    )
    _wait_for(lambda: any(o["state"] == "ready" for hb in control_plane.heartbeats() for o in hb["observed"]), agent)
    return agent


def _wait_for(condition, agent) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, agent.log_text()
        time.sleep(0.05)


def _requests_since_leave(control_plane) -> list:  # noqa: ANN001
    paths = [path for path, _, _ in control_plane.requests]
    return paths[paths.index("/api/agent/leave") + 1:] if "/api/agent/leave" in paths else []


def test_sigterm_says_it_leaves_and_serves_until_its_stage_has_moved(control_plane, tmp_path: Path) -> None:  # noqa: ANN001
    agent = _serving_a_stage(control_plane, tmp_path)
    try:
        agent.terminate()
        # Told, it keeps heartbeating with its stage (the driver checkpoints through it meanwhile).
        _wait_for(lambda: _requests_since_leave(control_plane).count("/api/agent/heartbeat") >= 2, agent)
        assert agent.process.poll() is None
        control_plane.assignments = []  # the control plane moved the stage
        assert agent.wait_stopped(20) == 0
    finally:
        agent.kill()
    assert "left: this node's stages moved elsewhere" in agent.log_text()


def test_a_second_signal_stops_at_once_and_a_stage_that_never_moves_times_out(control_plane, tmp_path: Path) -> None:  # noqa: ANN001
    agent = _serving_a_stage(control_plane, tmp_path)
    try:
        agent.process.send_signal(signal.SIGTERM)
        _wait_for(lambda: "/api/agent/heartbeat" in _requests_since_leave(control_plane), agent)
        agent.process.send_signal(signal.SIGINT)
        assert agent.wait_stopped(20) == 0  # not the 120 s the leave would wait by default
    finally:
        agent.kill()
    assert "left:" not in agent.log_text()

    control_plane.requests.clear()
    agent = _serving_a_stage(control_plane, tmp_path, "--leave-timeout", "0.5")
    try:
        agent.terminate()
        assert agent.wait_stopped(20) == 0
    finally:
        agent.kill()
    assert "leaving timed out after 0.5s with a stage still assigned; stopping anyway" in agent.log_text()


def test_a_stopped_agent_exits_without_waiting_for_the_interpreters_teardown(tmp_path: Path) -> None:
    """Once stopped, the agent ends its process: a teardown that would outlast the supervisor's wait (here an
    exit handler that sleeps, as a busy machine's collections over torch's objects did) is skipped."""
    path = tmp_path / "static.json"
    path.write_text(json.dumps([ASSIGNMENT]))
    slow = tmp_path / "slow_teardown"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import atexit, time\natexit.register(time.sleep, 60)\n")
    python_path = os.pathsep.join(p for p in (str(slow), os.environ.get("PYTHONPATH", "")) if p)
    agent = spawn_agent(["--static-assignment", str(path), "--threads", "1"], log_path=tmp_path / "agent.log",
                        env={**os.environ, "PYTHONPATH": python_path})
    started = time.monotonic()
    assert stop_agents([agent], timeout=10.0) == [0]
    assert time.monotonic() - started < 10.0
    assert agent.log_text().rstrip().endswith("INFO nodeagent: stopped")
