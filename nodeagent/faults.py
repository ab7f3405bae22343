"""A fault-injection hook for the churn tests: this agent SIGKILLs or SIGSTOPs itself, or fails its step, when one of
its stages reaches a named phase of a named step, so a test loses a replica (or breaks a step between live ones) at a
point of the step it chose, not at a moment it guessed.

It is armed by two environment variables, read once when the agent starts (`arm`, from nodeagent.runner):
- `ARCEUS_AGENT_FAULT=SIGNAL:PHASE:STEP[:STAGE:REPLICA][,...]`, e.g. `kill:forward:12` or `stop:exchange:5:1:0`.
  SIGNAL is `kill` (SIGKILL: the agent vanishes), `stop` (SIGSTOP: it falls silent, keeping its state, until
  someone sends SIGCONT) or `fail` (the agent stays up and answers, but its step fails there: UNAVAILABLE, its
  exchange streams closed, so its siblings' exchange fails too). PHASE is one of `PHASES`: `forward` (a train
  micro-batch's forward computed, its output not yet sent on), `gradient-sent` (every activation and gradient of
  the step delivered to the neighbours, before the replicas' gradient exchange and the optimizer step), `exchange`
  (a replica's gradient exchange: its own shards pushed to its siblings, their reduced sums not yet received). It
  fires at the first step numbered STEP or later at which the agent reaches PHASE; a step is the RunStep's step (the
  driver's call id: the job's training step while no evaluation or step run again came before it; a repaired step
  keeps its number). STAGE and REPLICA (optional, together): only where the agent hosts that replica of that stage
  (replica 0 for a stage that is not replicated), so every agent of a test may be armed alike before the control
  plane places them, and only the one placed there fires. An agent that starts hosting late (a spare that joins a
  running job) fires at the first such step it takes part in. Several faults, comma-separated, each fire once, the
  first due first (`fail:exchange:6,fail:exchange:6`: a step's exchange and the driver's retry of it both fail).
- `ARCEUS_DEVTOOLS_FAULTS=1`: the second key, which only devtools (devtools.cluster.LocalCluster.start_agents with
  `fault=`) sets. A fault without it is refused: the agent does not start.

An armed agent logs a CRITICAL line at start and another each time a fault fires. Nothing else in the agent
changes. The call sites are one line each (`reached(phase, step, stage=, replica=)`), in nodeagent.step
and nodeagent.replicas.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from nodeagent.rpc import RpcFailure

log = logging.getLogger(__name__)

FAULT_ENV = "ARCEUS_AGENT_FAULT"
ENABLE_ENV = "ARCEUS_DEVTOOLS_FAULTS"
PHASES = ("forward", "gradient-sent", "exchange")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
FAIL = "fail"  # no signal: the step fails where the fault fires


class FaultSpecError(ValueError):
    """ARCEUS_AGENT_FAULT is malformed, or set without ARCEUS_DEVTOOLS_FAULTS=1."""


@dataclass(frozen=True)
class Fault:
    signal_name: str  # a key of SIGNALS
    phase: str  # one of PHASES
    step: int  # the first step it may fire at
    stage: int | None = None  # with `replica`: only there
    replica: int | None = None

    @property
    def spec(self) -> str:
        where = "" if self.stage is None else f":{self.stage}:{self.replica}"
        return f"{self.signal_name}:{self.phase}:{self.step}{where}"

    def due(self, phase: str, step: int, *, stage: int, replica: int) -> bool:
        """Whether it fires where replica `replica` of stage `stage` reaches `phase` of `step`."""
        here = self.stage is None or (self.stage, self.replica) == (stage, replica)
        return here and self.phase == phase and step >= self.step


def parse_fault(spec: str) -> Fault:
    """`SIGNAL:PHASE:STEP[:STAGE:REPLICA]` as a Fault; FaultSpecError naming what is wrong."""
    parts = spec.strip().split(":")
    if len(parts) not in (3, 5):
        raise FaultSpecError(
            f"{FAULT_ENV} must be SIGNAL:PHASE:STEP[:STAGE:REPLICA] (e.g. kill:forward:12:1:0), got {spec!r}"
        )
    name, phase, step = parts[:3]
    if name not in (*SIGNALS, FAIL):
        raise FaultSpecError(f"{FAULT_ENV}: the signal must be one of {', '.join((*SIGNALS, FAIL))}, got {name!r}")
    if phase not in PHASES:
        raise FaultSpecError(f"{FAULT_ENV}: the phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if not step.isdigit() or int(step) < 1:
        raise FaultSpecError(f"{FAULT_ENV}: the step must be a positive integer, got {step!r}")
    if len(parts) == 3:
        return Fault(name, phase, int(step))
    stage, replica = parts[3:]
    if not (stage.isdigit() and replica.isdigit()):
        raise FaultSpecError(f"{FAULT_ENV}: the stage and replica must be integers >= 0, got {stage!r}, {replica!r}")
    return Fault(name, phase, int(step), int(stage), int(replica))


def parse_faults(specs: str) -> tuple[Fault, ...]:
    """Comma-separated faults (`parse_fault` each), in order."""
    return tuple(parse_fault(spec) for spec in specs.split(","))


def faults_from_environ(environ: Mapping[str, str]) -> tuple[Fault, ...]:
    """The faults `environ` arms (none when ARCEUS_AGENT_FAULT is unset or empty); FaultSpecError when one is
    malformed or ARCEUS_DEVTOOLS_FAULTS=1 is lacking."""
    spec = environ.get(FAULT_ENV, "")
    if not spec:
        return ()
    if environ.get(ENABLE_ENV) != "1":
        raise FaultSpecError(
            f"{FAULT_ENV} is set ({spec!r}) but {ENABLE_ENV} is not 1: it makes this agent kill or stop itself "
            f"mid-step, a test hook only devtools arms; unset {FAULT_ENV} to run the agent"
        )
    return parse_faults(spec)


class _Armed:
    """The process's armed faults; each taken off as it fires, so it fires once (steps' threads reach phases
    concurrently: the lock lets one of them take it)."""

    faults: list[Fault] = []
    lock = threading.Lock()


def arm(environ: Mapping[str, str]) -> tuple[Fault, ...]:
    """Read the faults from `environ` once, at the agent's start, and arm them (logged at CRITICAL)."""
    armed = faults_from_environ(environ)
    _Armed.faults = list(armed)
    for fault in armed:
        log.critical(
            "TEST HOOK ARMED (%s=%s): this agent will %s at phase %r of its first step >= %d%s; never set it "
            "outside tests",
            FAULT_ENV,
            fault.spec,
            f"{SIGNALS[fault.signal_name].name} itself" if fault.signal_name in SIGNALS else "fail its step",
            fault.phase,
            fault.step,
            "" if fault.stage is None else f" as stage {fault.stage} replica {fault.replica}",
        )
    return armed


def reached(phase: str, step: int, *, stage: int, replica: int) -> None:
    """Replica `replica` of stage `stage` (0: not replicated) on this agent is at `phase` of `step`: if an armed
    fault is due there, disarm it and signal this process (a SIGSTOP returns once someone sends SIGCONT), or fail the
    step (an RpcFailure, UNAVAILABLE). Nothing otherwise."""
    if not _Armed.faults:
        return
    with _Armed.lock:
        fault = next((f for f in _Armed.faults if f.due(phase, step, stage=stage, replica=replica)), None)
        if fault is None:
            return
        _Armed.faults.remove(fault)
    if fault.signal_name == FAIL:
        log.critical("TEST HOOK FIRES: failing step %d at phase %r (stage %d replica %d)", step, phase, stage, replica)
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"a test hook failed step {step} at phase {phase!r} here")
    sig = SIGNALS[fault.signal_name]
    log.critical(
        "TEST HOOK FIRES: %s at phase %r of step %d (stage %d replica %d)", sig.name, phase, step, stage, replica
    )
    for handler in logging.getLogger().handlers:  # the line must reach the log before the process is gone
        handler.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)
    log.critical("TEST HOOK: continued after %s at phase %r of step %d", sig.name, phase, step)
