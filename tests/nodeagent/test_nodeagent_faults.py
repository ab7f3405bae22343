"""The fault-injection test hook (nodeagent/faults.py): armed only with its devtools key, it signals its own process
(or fails the step) once, at the phase it names of the first step at or past the one it names; several fire in turn;
a malformed or unkeyed fault stops the agent from starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from nodeagent import faults
from nodeagent.rpc import RpcFailure

REPO_ROOT = Path(__file__).resolve().parents[2]
# A process that arms the hook from its environment and walks through phases, saying where it is.
WALKER = """
import os, sys
from nodeagent import faults
faults.arm(os.environ)
for step in (1, 2, 3):
    for phase in faults.PHASES:
        faults.reached(phase, step, stage=0, replica=1)  # another replica than a fault for one names
        faults.reached(phase, step, stage=1, replica=0)
        if step >= 2:  # a replica it hosts from step 2 on, as a spare that joined
            faults.reached(phase, step, stage=1, replica=2)
        print(phase, step, flush=True)
faults.reached("exchange", 2, stage=1, replica=0)  # the fault fired once: reaching it again does nothing
print("done", flush=True)
"""


def walker(spec: str | None, *, enabled: bool = True) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (faults.FAULT_ENV, faults.ENABLE_ENV)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if spec is not None:
        env[faults.FAULT_ENV] = spec
    if enabled:
        env[faults.ENABLE_ENV] = "1"
    return subprocess.Popen([sys.executable, "-c", WALKER], env=env, cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_fault_parses_from_signal_phase_and_step() -> None:
    assert faults.parse_fault("kill:forward:12") == faults.Fault("kill", "forward", 12)
    assert faults.parse_fault("stop:exchange:1").spec == "stop:exchange:1"
    assert faults.parse_fault("stop:exchange:4:1:0") == faults.Fault("stop", "exchange", 4, stage=1, replica=0)
    assert faults.parse_fault("stop:exchange:4:1:0").spec == "stop:exchange:4:1:0"
    assert faults.parse_faults("fail:exchange:6:1:2,kill:forward:3") == (
        faults.Fault("fail", "exchange", 6, stage=1, replica=2), faults.Fault("kill", "forward", 3))
    for bad, words in [("kill:forward", "SIGNAL:PHASE:STEP"), ("term:forward:3", "signal"),
                       ("kill:backward:3", "phase"), ("kill:forward:0", "step"), ("kill:forward:x", "step"),
                       ("kill:forward:3:1", "SIGNAL:PHASE:STEP"), ("kill:forward:3:1:-1", "stage and replica")]:
        with pytest.raises(faults.FaultSpecError, match=words):
            faults.parse_fault(bad)


def test_a_fault_is_due_at_its_phase_from_its_step_on_where_it_names() -> None:
    fault = faults.Fault("kill", "exchange", 5, stage=1, replica=2)
    assert fault.due("exchange", 5, stage=1, replica=2) and fault.due("exchange", 9, stage=1, replica=2)
    assert not fault.due("exchange", 4, stage=1, replica=2)  # not before its step
    assert not fault.due("forward", 5, stage=1, replica=2)
    assert not fault.due("exchange", 5, stage=1, replica=0) and not fault.due("exchange", 5, stage=0, replica=2)
    assert faults.Fault("stop", "forward", 2).due("forward", 7, stage=3, replica=1)  # anywhere when none named


def test_a_fault_is_honoured_only_with_the_devtools_key() -> None:
    assert faults.faults_from_environ({}) == ()
    assert faults.faults_from_environ({faults.FAULT_ENV: ""}) == ()
    with pytest.raises(faults.FaultSpecError, match=f"{faults.ENABLE_ENV} is not 1"):
        faults.faults_from_environ({faults.FAULT_ENV: "kill:forward:3"})
    with pytest.raises(faults.FaultSpecError, match=f"{faults.ENABLE_ENV} is not 1"):
        faults.faults_from_environ({faults.FAULT_ENV: "kill:forward:3", faults.ENABLE_ENV: "yes"})
    armed = {faults.FAULT_ENV: "kill:forward:3", faults.ENABLE_ENV: "1"}
    assert faults.faults_from_environ(armed) == (faults.Fault("kill", "forward", 3),)


def test_without_a_fault_every_phase_passes() -> None:
    out, err = walker(None, enabled=False).communicate(timeout=60)
    assert out.splitlines()[-1] == "done" and len(out.splitlines()) == 10, (out, err)


def test_kill_ends_the_process_at_the_named_phase_and_step() -> None:
    process = walker("kill:gradient-sent:2")
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert out.splitlines() == ["forward 1", "gradient-sent 1", "exchange 1", "forward 2"], err
    assert "TEST HOOK ARMED" in err and "TEST HOOK FIRES: SIGKILL at phase 'gradient-sent' of step 2 (stage 0" in err


def test_fail_fails_the_step_there_and_the_process_goes_on_each_fault_once_in_turn() -> None:
    """No signal: `reached` raises where a `fail` fault is due (so it runs in this process, disarmed after)."""
    faults.arm({faults.FAULT_ENV: "fail:exchange:2:1:2,fail:exchange:2:1:2,fail:forward:3", faults.ENABLE_ENV: "1"})
    failed = []
    try:
        for step in (1, 2, 3):
            for phase in faults.PHASES:
                for stage, replica in ((0, 1), (1, 2)):
                    try:
                        faults.reached(phase, step, stage=stage, replica=replica)
                    except RpcFailure as exc:
                        assert exc.code == grpc.StatusCode.UNAVAILABLE
                        failed.append((phase, step, stage, replica))
    finally:
        faults.arm({})
    # The first exchange fault at stage 1 replica 2's step 2, the second at its next (step 3), after the forward one.
    assert failed == [("exchange", 2, 1, 2), ("forward", 3, 0, 1), ("exchange", 3, 1, 2)]


def wake_once_stopped(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Wait until `process` stopped itself, check that it stays stopped, SIGCONT it; its stdout and stderr once it
    ended."""
    try:
        watched = psutil.Process(process.pid)
        deadline = time.monotonic() + 60
        while watched.status() != psutil.STATUS_STOPPED:
            assert process.poll() is None and time.monotonic() < deadline, "the process never stopped itself"
            time.sleep(0.05)
        time.sleep(0.3)
        assert watched.status() == psutil.STATUS_STOPPED  # it stays silent: nothing else wakes it
        os.kill(process.pid, signal.SIGCONT)
        return process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_stop_freezes_the_process_until_it_is_continued_and_fires_once() -> None:
    process = walker("stop:exchange:2:1:0")
    out, err = wake_once_stopped(process)
    assert process.returncode == 0, err
    lines = out.splitlines()
    assert lines[lines.index("gradient-sent 2") + 1] == "exchange 2" and lines[-1] == "done"
    assert len(lines) == 10  # every phase passed once, and "exchange 2" again without stopping
    assert "continued after SIGSTOP at phase 'exchange' of step 2" in err


def test_a_replica_hosted_from_a_later_step_on_fires_at_its_first_step_due() -> None:
    process = walker("kill:forward:1:1:2")  # due from step 1, but the walker hosts stage 1's replica 2 from step 2 on
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert out.splitlines() == ["forward 1", "gradient-sent 1", "exchange 1"], err
    assert "TEST HOOK FIRES: SIGKILL at phase 'forward' of step 2 (stage 1 replica 2)" in err


def test_an_agent_with_an_unkeyed_fault_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != faults.ENABLE_ENV}
    env.update({faults.FAULT_ENV: "kill:forward:3", "ARCEUS_NODE_TOKEN": "t" * 32, "PYTHONPATH": str(REPO_ROOT),
                "XDG_CONFIG_HOME": str(tmp_path)})
    result = subprocess.run([sys.executable, "-m", "nodeagent", "--control-plane", "http://127.0.0.1:9",
                             "--device", "cpu"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{faults.ENABLE_ENV} is not 1" in result.stderr
