"""Kill a random replica at a random step, trial after trial: with 2 replicas per stage nothing rewinds; beside it,
the same job with 1 replica per stage killed the same way rewinds to its checkpoint.

    .venv/bin/python bench/swarm_churn.py [--trials 10] [--steps 30] [--checkpoint-interval 10] [--seed 0]
                                          [--shaped [--delay-ms 20] [--rate-mbit 100]] [--no-write]
                                          [--workdir DIR] [--shaped-replicas-only]
    .venv/bin/python bench/swarm_churn.py --large [--steps 7] [--n-layer 24] [--d-model 1024] [--no-write]

Static agents and the driver as the replica tests run them (no control plane): the digits MLP [64, 128, 64, 10]
in 3 stages, batch 32 in 4 micro-batches, SGD with momentum, a checkpoint every `--checkpoint-interval` steps.
Each trial trains a fresh job for `--steps` steps and SIGKILLs one agent 5 ms after a random step ends (in
whatever phase the next step then is); victims, stages and steps are drawn from `--seed` up front. `--shaped`
runs every trial a second time with the driver reaching every agent, and every agent its neighbours and
siblings, through its own `devtools.shaper` links (its gRPC port and its replicas' exchange listener each behind
one; 20 ms one way, 100 Mbit/s per direction by default).

- R=2: 3 stages × 2 replicas and one spare agent standing by for the victim's stage. The driver repairs the
  step around the lost replica; the spare is offered from the first step boundary after the kill, copies the
  stage's state from a live replica and takes micro-batches from then on. (With a control plane the spare is
  placed only once the node is missed: add its detection, 5-7 s in bench/fault_trials.py.)
- R=1: 3 stages × 1 replica. The kill fails the step (the stage's state is gone); as the control plane does, the
  job rewinds: three fresh agents load every stage's last checkpoint and training resumes after it. Starting
  those processes is part of the rewind here; a control plane would reuse running agents instead (bench/
  fault_trials.py: detection 5-7 s, recovery 7-10 s over REST).

Per trial: steps replayed, seconds from the kill until the step it interrupted completed, samples/s before
(the 5 steps before the kill), during (the kill until the stage is whole again: the spare's first step, or the
interrupted step done on the new agents) and after, the time until the replacement was there (the spare's first
step; the new agents started), the spare's copy of the stage (bytes, seconds), and the largest relative
difference of any step's loss from one process trained on the same batches.

`--large`: one R=2 trial of a GPT of ~200M parameters (16 blocks of bench/large_model.py's width, its batch: 8
windows of 128 tokens in 8 micro-batches; SGD with momentum) in 2 stages (5 agents of half the model: its 24
blocks, 300M, ran this 24 GiB machine out of memory, a surviving replica killed at 6.2 GB), one replica killed
half-way through a step, the spare joining from its peer; each process's peak resident memory (VmHWM), the
join's bytes and seconds, and the losses against one process, trained after the agents stopped.

`--workdir DIR` keeps every agent's log and the driver's (`driver.log`: INFO with times, each kill logged on the
same clock) in DIR, for a trial to be read afterwards. `--shaped-replicas-only` runs only the shaped R=2 trials (to
look for a slow repair in more trials for the time), prints them and writes nothing.

Prints a table, writes docs/BENCHMARKS.md, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.checkpoint import checkpoint_digest  # noqa: E402
from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.model.registry import fit_model_to_dataset  # noqa: E402
from arceus.training.driver import DriverError, train  # noqa: E402
from arceus.training.plan import ReplicaJoin, StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from arceus.training.recording import RecordingSink  # noqa: E402
from bench.large_model import BATCH, BLOCK, text_source  # noqa: E402
from bench.large_model import MICRO_BATCHES as LARGE_MICRO_BATCHES  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.launch import AgentProcess, spawn_static_agents_on_free_ports, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, replicated_pipeline_assignments  # noqa: E402
from devtools.reference import reference_run  # noqa: E402
from devtools.shaper import ShaperThread, add_link_arguments, link_shape  # noqa: E402
from devtools.supervisor import peak_rss  # noqa: E402

log = logging.getLogger("bench.swarm_churn")
BEFORE = 5  # steps whose rate is "before" (fewer where the kill comes earlier)
MIB = 2**20
Via = Callable[[str], str]  # an agent's address -> the address it is dialled at (itself, or its shaped link)


@dataclass(frozen=True)
class Setup:
    """The job every trial trains: model, data, optimizer, stage boundaries, micro-batches."""

    model: dict[str, Any]
    dataset: dict[str, Any]
    optimizer: dict[str, Any]
    bounds: tuple[int, ...]
    micro_batches: int
    seed: int
    rpc_timeout_s: float
    kill_mid_step: bool  # the kill lands half the last step's time after it ends (else 5 ms after)

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def assignments(self, job_id: str, addresses: list[list[str]], generation: int = 1) -> list[list[dict[str, Any]]]:
        return replicated_pipeline_assignments(
            job_id=job_id, model_config=self.model, boundaries=self.bounds, addresses=addresses,
            optimizer=self.optimizer, seed=self.seed, micro_batches=self.micro_batches,
            max_micro_batch_size=max_micro_batch_size(self.dataset, self.micro_batches), generation=generation,
        )

    def endpoint(self, stage: int, replica: int, address: str, via: Via, exchange: str = "") -> StageEndpoint:
        """`exchange`: the agent's exchange listener, dialled through `via` too (a shaped link of its own)."""
        return StageEndpoint(index=stage, address=via(address), node_id=f"{address}#{stage}.{replica}",
                             layer_start=self.bounds[stage], layer_end=self.bounds[stage + 1],
                             certificate=identity_for(address).certificate, replica=replica,
                             exchange_address=via(exchange) if exchange else "")

    def plan(self, job_id: str, replicas: list[StageEndpoint], generation: int = 1, start_step: int = 0,
             joins: Any = None, joined: Any = None, checkpoint_interval: int = 0) -> TrainPlan:
        return TrainPlan(
            job_id=job_id, generation=generation, credential=driver_token(job_id, generation),
            stages=tuple(min((e for e in replicas if e.index == i), key=lambda e: e.replica)
                         for i in range(self.stages)),
            replicas=tuple(replicas), dataset=self.dataset, epochs=2, learning_rate=self.optimizer["lr"],
            micro_batches=self.micro_batches, seed=self.seed, rpc_timeout_seconds=self.rpc_timeout_s,
            start_step=start_step, checkpoint_interval=checkpoint_interval, replica_joins=joins,
            replica_joined=joined,
        )

    def reference_losses(self, steps: int) -> list[float]:
        """One process's losses on the same batches: what every run, disturbed or not, must equal."""
        return reference_run(
            {"model_config": self.model, "dataset_config": self.dataset, "epochs": 2,
             "learning_rate": self.optimizer["lr"], "optimizer": self.optimizer["name"],
             "momentum": self.optimizer["momentum"], "weight_decay": self.optimizer["weight_decay"],
             "seed": self.seed},
            max_steps=steps,
        ).losses


SMALL = Setup(
    model={"type": "mlp", "layer_sizes": [64, 128, 64, 10]},
    dataset=validate_dataset_config({"name": "digits", "batch_size": 32}),
    optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
    bounds=(0, 1, 2, 3), micro_batches=4, seed=7, rpc_timeout_s=30.0, kill_mid_step=False,
)


def large_setup(args: argparse.Namespace, directory: Path) -> Setup:
    """bench/large_model.py's GPT and batch in 2 stages of equal blocks, on the bundled text cut to a few steps."""
    dataset = {"name": "text", "source": str(text_source(directory, args.steps + 1)), "batch_size": BATCH,
               "val_batch_size": BATCH}
    model = {"type": "transformer", "n_layer": args.n_layer, "n_head": 16, "d_model": args.d_model,
             "block_size": BLOCK}
    _, model, dataset = fit_model_to_dataset(model, validate_dataset_config(dataset))
    layers = args.n_layer + 2  # the embedding, the blocks, the head
    return Setup(model=model, dataset=dataset, optimizer={"name": "sgd", "lr": 1e-3, "momentum": 0.9,
                                                          "weight_decay": 0.0},
                 bounds=(0, layers // 2, layers), micro_batches=LARGE_MICRO_BATCHES, seed=0, rpc_timeout_s=600.0,
                 kill_mid_step=True)


@dataclass(frozen=True)
class Kill:
    stage: int
    replica: int  # 0 or 1 with 2 replicas; 0 with 1
    after_step: int  # the kill lands after this step ends


class TrialSink(RecordingSink):
    """Steps and their end times; SIGKILLs `victim` after step `kill_after` ends (5 ms after, or half that step's
    time with `mid_step`), reading its peak memory first; stops after `limit`."""

    def __init__(self, limit: int, kill_after: int = 0, victim: int = 0, mid_step: bool = False) -> None:
        super().__init__()
        self.limit, self.kill_after, self.victim, self.mid_step = limit, kill_after, victim, mid_step
        self.times: list[float] = []
        self.killed_at = math.nan
        self.victim_peak = 0  # bytes, read just before the kill (a killed process's /proc has no VmHWM)

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.times.append(time.perf_counter())
        log.info("step %d done (loss %.6f)", p.step, p.loss)
        if self.victim and p.step == self.kill_after:
            threading.Timer(p.seconds / 2 if self.mid_step else 0.005, self._kill).start()

    def _kill(self) -> None:
        self.victim_peak = peak_rss(self.victim)
        self.killed_at = time.perf_counter()
        os.kill(self.victim, signal.SIGKILL)
        log.info("SIGKILLed agent pid %d after step %d", self.victim, self.kill_after)

    def should_stop(self) -> bool:
        return bool(self.steps) and self.steps[-1].step >= self.limit


@dataclass
class Trial:
    kill: Kill
    steps_replayed: int
    step_done_s: float  # the kill until the step it interrupted completed
    replacement_s: float  # the kill until the replacement was there
    before: float  # samples/s
    during: float
    after: float
    losses: dict[int, float] = field(repr=False)  # by step, each step's last run
    join_bytes: int = 0  # R=2: the state the spare copied from its peer
    join_s: float = math.nan  # R=2: its copy, from the driver asking until it held the state
    detection_s: float = math.nan  # R=1: the kill until the driver's error
    restart_s: float = math.nan  # R=1: starting the three agents from the checkpoint
    peaks: dict[str, int] = field(default_factory=dict)  # R=2: each agent's VmHWM, bytes, by its part in the trial


def rates(batch: int, steps: list[int], times: list[float], killed_at: float,
          whole_at: float) -> tuple[float, float, float]:
    """samples/s before the kill, from the kill until `whole_at`, and after; a step counts once (its last run)."""
    last = max(i for i, t in enumerate(times) if t < killed_at)
    before_steps = min(BEFORE, last)
    before = before_steps * batch / (times[last] - times[last - before_steps])
    high = steps[last]
    during_steps = {s for s, t in zip(steps, times, strict=True) if killed_at < t <= whole_at and s > high}
    during = len(during_steps) * batch / (whole_at - killed_at)
    after_steps = [t for t in times if t > whole_at]
    after = len(after_steps) * batch / (after_steps[-1] - whole_at) if after_steps else math.nan
    return before, during, after


def deviation(losses: dict[int, float], reference: list[float]) -> float:
    return max(abs(loss - reference[step - 1]) / reference[step - 1] for step, loss in losses.items())


def replicated_trials(setup: Setup, kills: list[Kill], args: argparse.Namespace, workdir: Path, via: Via,
                      name: str) -> list[Trial]:
    """Every trial's agents start at once: a pool of 2n + 1 + (trials - 1) for n stages; trial t runs on the first
    2n + 1 still alive (the replicas and the spare), and its victim is gone for the trials after it."""
    n = setup.stages
    slots, alive = [], list(range(2 * n + len(kills)))  # each trial's agents, as indices into the pool
    for kill in kills:
        members = [[alive[2 * i], alive[2 * i + 1]] for i in range(n)]
        slots.append([m + ([alive[2 * n]] if i == kill.stage else []) for i, m in enumerate(members)])
        alive.remove(members[kill.stage][kill.replica])

    def hosted(pool: list[str]) -> list[list[dict[str, Any]]]:
        per_agent: list[list[dict[str, Any]]] = [[] for _ in pool]
        for t, trial in enumerate(slots):
            for stage, agents_of_stage in zip(setup.assignments(f"{name}-r2-{t}", layout_of(pool, trial)), trial,
                                              strict=True):
                for assignment, agent in zip(stage, agents_of_stage, strict=True):
                    per_agent[agent].append(assignment)
        return per_agent

    def layout_of(pool: list[str], trial: list[list[int]]) -> list[list[str]]:
        return [[pool[a] for a in stage] for stage in trial]

    agents, pool = spawn_static_agents_on_free_ports(2 * n + len(kills), hosted, workdir / f"{name}-r2",
                                                     ready_timeout=300.0)
    layouts = [layout_of(pool, trial) for trial in slots]
    by_address = dict(zip(pool, agents, strict=True))
    results = []
    try:
        for t, (kill, layout) in enumerate(zip(kills, layouts, strict=True)):
            victim = by_address[layout[kill.stage][kill.replica]]
            log.info("%s R=2 trial %d: stage %d replica %d (%s, pid %d, log %s) to be killed after step %d", name, t,
                     kill.stage, kill.replica, victim.grpc_address, victim.process.pid, victim.log_path,
                     kill.after_step)
            sink = TrialSink(args.steps, kill.after_step, victim.process.pid, setup.kill_mid_step)
            spare_address = layout[kill.stage][2]
            spare = setup.endpoint(kill.stage, 2, spare_address, via, by_address[spare_address].exchange_address)
            replicas = [setup.endpoint(i, r, a, via, by_address[a].exchange_address)
                        for i, stage in enumerate(layout) for r, a in enumerate(stage[:2])]
            copies: list[tuple[float, float, ReplicaJoin]] = []  # (asked, held, what)
            asked: list[float] = []

            def joins(sink: TrialSink = sink, spare: StageEndpoint = spare,
                      asked: list[float] = asked) -> list[StageEndpoint]:
                if sink.steps and sink.steps[-1].step > sink.kill_after:
                    asked.append(time.perf_counter())
                    return [spare]
                return []

            def joined(join: ReplicaJoin, asked: list[float] = asked,
                       copies: list[tuple[float, float, ReplicaJoin]] = copies) -> None:
                copies.append((asked[-1], time.perf_counter(), join))

            train(setup.plan(f"{name}-r2-{t}", replicas, joins=joins, joined=joined,
                             checkpoint_interval=args.checkpoint_interval), sink)
            if victim.process.wait(10) != -signal.SIGKILL:
                raise RuntimeError(f"trial {t}: the victim was not killed")
            steps = [p.step for p in sink.steps]
            if steps != list(range(1, args.steps + 1)):
                raise RuntimeError(f"trial {t}: steps went {steps}")
            if len(copies) != 1:
                raise RuntimeError(f"trial {t}: the spare joined {len(copies)} times")
            joined_at = next(at for p, at in zip(sink.steps, sink.times, strict=True)
                             if any(c.node_id == spare.node_id and c.micro_batches for c in p.stages))
            dead = [f"{i}.{r}" for i, stage in enumerate(layout) for r, a in enumerate(stage)
                    if (i, r) != (kill.stage, kill.replica) and by_address[a].process.poll() is not None]
            if dead:  # the job may survive it (the stage's other replica repairs again), the trial does not count
                raise RuntimeError(f"trial {t}: agents of replicas {dead} died beside the victim (out of memory?)")
            done = sink.times[kill.after_step]  # the interrupted step's end (steps never repeat here)
            before, during, after = rates(setup.dataset["batch_size"], steps, sink.times, sink.killed_at, joined_at)
            peaks = {f"stage {i} replica {r}" + (" (killed; read before the kill)" if (i, r) == (kill.stage,
                     kill.replica) else " (the spare: joined from its peer)" if r == 2 else ""):
                     sink.victim_peak if (i, r) == (kill.stage, kill.replica) else peak_rss(by_address[a].process.pid)
                     for i, stage in enumerate(layout) for r, a in enumerate(stage)}
            ask, held, copy = copies[0]
            results.append(Trial(
                kill, steps_replayed=len(steps) - len(set(steps)), step_done_s=done - sink.killed_at,
                replacement_s=joined_at - sink.killed_at, before=before, during=during, after=after,
                losses={p.step: p.loss for p in sink.steps}, join_bytes=copy.size_bytes, join_s=held - ask,
                peaks=peaks,
            ))
            print(f"{name} R=2 trial {t}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        stop_agents([a for a in agents if a.process.poll() is None])
    return results


def unreplicated_trials(setup: Setup, kills: list[Kill], args: argparse.Namespace, workdir: Path, via: Via,
                        name: str) -> list[Trial]:
    """Trial t's agents also host trial t + 1's job; after the kill, new ones start with trial t's checkpoint
    (generation 2) and trial t + 1's job, and the survivors stop."""
    n = setup.stages

    def start(jobs: list[tuple[str, int, list[dict[str, Any]] | None]], directory: str) -> tuple[
            list[AgentProcess], list[str]]:
        def hosted(addresses: list[str]) -> list[list[dict[str, Any]]]:
            per_agent: list[list[dict[str, Any]]] = [[] for _ in range(n)]
            for job_id, generation, checkpoints in jobs:
                for i, (assignment,) in enumerate(setup.assignments(job_id, [[a] for a in addresses], generation)):
                    assignment["checkpoint"] = checkpoints[i] if checkpoints else None
                    per_agent[i].append(assignment)
            return per_agent

        return spawn_static_agents_on_free_ports(n, hosted, workdir / directory, ready_timeout=300.0)

    agents, addresses = start([(f"{name}-r1-0", 1, None)], f"{name}-r1-0")
    results = []
    try:
        for t, kill in enumerate(kills):
            job_id = f"{name}-r1-{t}"
            victim = agents[kill.stage]
            sink = TrialSink(args.steps, kill.after_step, victim.process.pid, setup.kill_mid_step)
            replicas = [setup.endpoint(i, 0, a, via) for i, a in enumerate(addresses)]
            try:
                train(setup.plan(job_id, replicas, checkpoint_interval=args.checkpoint_interval), sink)
                raise RuntimeError(f"trial {t}: the job survived losing its only replica of stage {kill.stage}")
            except DriverError:
                detected = time.perf_counter()
            resume = max((s for s in sink.checkpoints if s <= kill.after_step), default=0)
            refs = None
            if resume:
                refs = [{"step": resume, "url": str(f.path), "sha256": checkpoint_digest(f.path.read_bytes())}
                        for f in sink.checkpoints[resume]]
            nxt = [(f"{name}-r1-{t + 1}", 1, None)] if t + 1 < len(kills) else []
            new_agents, new_addresses = start([(job_id, 2, refs), *nxt], f"{name}-r1-{t + 1}")
            restarted = time.perf_counter()
            stop_agents([a for a in agents if a.process.poll() is None])
            agents, addresses = new_agents, new_addresses
            resumed = TrialSink(args.steps)
            train(setup.plan(job_id, [setup.endpoint(i, 0, a, via) for i, a in enumerate(addresses)], generation=2,
                             start_step=resume, checkpoint_interval=args.checkpoint_interval), resumed)
            steps = [p.step for p in sink.steps] + [p.step for p in resumed.steps]
            times = sink.times + resumed.times
            done = resumed.times[kill.after_step - resume]  # the interrupted step's end on the new agents
            before, during, after = rates(setup.dataset["batch_size"], steps, times, sink.killed_at, done)
            results.append(Trial(
                kill, steps_replayed=len(steps) - len(set(steps)), step_done_s=done - sink.killed_at,
                replacement_s=restarted - sink.killed_at, before=before, during=during, after=after,
                losses={p.step: p.loss for p in [*sink.steps, *resumed.steps]}, detection_s=detected - sink.killed_at,
                restart_s=restarted - detected,
            ))
            print(f"{name} R=1 trial {t}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        stop_agents([a for a in agents if a.process.poll() is None])
    return results


def churn_figures(prefix: str, replicated: list[Trial], single: list[Trial], reference: list[float]) -> dict[str, Any]:
    def med(trials: list[Trial], attr: str) -> float:
        return statistics.median(getattr(x, attr) for x in trials)

    figures: dict[str, Any] = {}
    for name, trials in (("r2", replicated), ("r1", single)):
        figures[f"{prefix}{name}_steps_replayed_total"] = sum(x.steps_replayed for x in trials)
        figures[f"{prefix}{name}_trials_with_replay"] = sum(x.steps_replayed > 0 for x in trials)
        for attr in ("step_done_s", "replacement_s", "before", "during", "after"):
            figures[f"{prefix}{name}_{attr}_median"] = round(med(trials, attr), 3)
        figures[f"{prefix}{name}_step_done_s_max"] = round(max(x.step_done_s for x in trials), 3)
        figures[f"{prefix}{name}_loss_deviation_max"] = float(
            f"{max(deviation(x.losses, reference) for x in trials):.3g}")
    figures[f"{prefix}r2_join_s_median"] = round(med(replicated, "join_s"), 3)
    figures[f"{prefix}r2_join_bytes"] = max(x.join_bytes for x in replicated)
    figures[f"{prefix}r1_detection_s_median"] = round(med(single, "detection_s"), 3)
    figures[f"{prefix}r1_restart_s_median"] = round(med(single, "restart_s"), 3)
    return figures


def churn_table(replicated: list[Trial], single: list[Trial], reference: list[float]) -> str:
    rows = ""
    for t, (a, b) in enumerate(zip(replicated, single, strict=True)):
        rows += (f"| {t} | {a.kill.stage}.{a.kill.replica} | {a.kill.after_step + 1} | "
                 f"{a.steps_replayed} / {b.steps_replayed} | {a.step_done_s:.2f} / {b.step_done_s:.2f} | "
                 f"{a.before:.0f} / {b.before:.0f} | {a.during:.0f} / {b.during:.1f} | {a.after:.0f} / {b.after:.0f} | "
                 f"{a.replacement_s:.2f} / {b.replacement_s:.2f} | {a.join_s:.3f} | "
                 f"{deviation(a.losses, reference):.1e} / {deviation(b.losses, reference):.1e} |\n")
    return ("| trial | stage.replica killed | in step | steps replayed | s until that step completed | "
            "samples/s before | during | after | s until the replacement | R=2: the spare's copy, s | "
            "loss deviation |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows)


def churn_summary(f: dict[str, Any], prefix: str, trials: int) -> str:
    return (f"R=2: **{f[prefix + 'r2_steps_replayed_total']} steps replayed** in {trials} trials, the interrupted "
            f"step done {f[prefix + 'r2_step_done_s_median']} s after the kill (median; max "
            f"{f[prefix + 'r2_step_done_s_max']} s), the spare training {f[prefix + 'r2_replacement_s_median']} s "
            f"after it (its copy of the stage, {f[prefix + 'r2_join_bytes']} bytes: "
            f"{f[prefix + 'r2_join_s_median']} s); largest loss deviation "
            f"{f[prefix + 'r2_loss_deviation_max']:.1e}. R=1: {f[prefix + 'r1_steps_replayed_total']} steps "
            f"replayed, the interrupted step done {f[prefix + 'r1_step_done_s_median']} s after the kill (the "
            f"driver's error after {f[prefix + 'r1_detection_s_median']} s, the three agents started in "
            f"{f[prefix + 'r1_restart_s_median']} s).")


def churn(args: argparse.Namespace) -> None:
    if args.steps < 2 * BEFORE + 4:
        raise SystemExit(f"--steps must be at least {2 * BEFORE + 4}: {BEFORE} steps before the kill and room after")
    rng = random.Random(args.seed)
    kills = [Kill(rng.randrange(SMALL.stages), rng.randrange(2), rng.randint(BEFORE + 1, args.steps - BEFORE - 2))
             for _ in range(args.trials)]
    single_kills = [Kill(k.stage, 0, k.after_step) for k in kills]  # the same stage and step; its only replica
    reference = SMALL.reference_losses(args.steps)
    shape = link_shape(args)
    load, started = os.getloadavg(), time.perf_counter()
    runs: dict[str, tuple[list[Trial], list[Trial]]] = {}
    with _workdir(args) as workdir, ShaperThread() as shaper:
        if args.shaped_replicas_only:
            trials = replicated_trials(SMALL, kills, args, Path(workdir), lambda a: shaper.address(a, **shape),
                                       "shaped")
            print(json.dumps({"shaped_r2_step_done_s": [round(x.step_done_s, 3) for x in trials],
                              "kills": [f"{x.kill.stage}.{x.kill.replica}@{x.kill.after_step + 1}" for x in trials],
                              "load_average_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)],
                              "bench_seconds": round(time.perf_counter() - started)}))
            return
        links: dict[str, Via] = {"loopback": lambda a: a}
        if args.shaped:
            links["shaped"] = lambda a: shaper.address(a, **shape)
        for name, via in links.items():
            runs[name] = (replicated_trials(SMALL, kills, args, Path(workdir), via, name),
                          unreplicated_trials(SMALL, single_kills, args, Path(workdir), via, name))
    load_after = os.getloadavg()

    figures: dict[str, Any] = {"trials": args.trials, "steps": args.steps,
                               "checkpoint_interval": args.checkpoint_interval, "seed": args.seed}
    tables = ""
    for name, (replicated, single) in runs.items():
        prefix = "" if name == "loopback" else f"{name}_"
        figures.update(churn_figures(prefix, replicated, single, reference))
        heading = ("Loopback:" if name == "loopback" else
                   f"Shaped: every agent behind its own `devtools.shaper` link, {args.delay_ms:g} ms one way, "
                   f"{args.rate_mbit:g} Mbit/s per direction (the driver's calls, the boundary tensors, the "
                   "exchange and the spare's copy all cross it):")
        tables += (f"{heading}\n\n{churn_table(replicated, single, reference)}\n"
                   f"{churn_summary(figures, prefix, args.trials)}\n\n")
    figures["load_average_1m"] = [round(load[0], 2), round(load_after[0], 2)]
    figures["bench_seconds"] = round(time.perf_counter() - started)

    command = "python bench/swarm_churn.py" + (" --shaped" if args.shaped else "")
    body = (
        f"`{command}`. The machine was shared with other sessions (load average {load[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {os.cpu_count()} cores). Static agents and the driver, no control plane. "
        f"Digits MLP {SMALL.model['layer_sizes']} in 3 stages, batch {SMALL.dataset['batch_size']}, "
        f"M={SMALL.micro_batches}, SGD (momentum 0.9), a checkpoint every {args.checkpoint_interval} steps; "
        f"{args.trials} trials (seed {args.seed}) of {args.steps} steps, each a fresh job; one agent SIGKILLed "
        "5 ms after a random step ends. R=2: 3 stages × 2 replicas, a spare offered from the first step boundary "
        "after the kill (it copies the stage from a live replica). R=1: the same stage and step; the job rewinds "
        "to its last checkpoint on three new agent processes (starting them is part of it here; a control plane "
        "would reuse running agents and add its detection, bench/fault_trials.py). Each cell: R=2 / R=1. "
        "Samples/s before: the 5 steps before the kill; during: the kill until the stage is whole again (the "
        "spare's first step; the interrupted step done after the rewind), counting each step once; after: the "
        "rest. Replacement: the spare's first step done; the new agents started. The spare's copy: from the "
        "driver offering it until it held its peer's state. Loss deviation: the largest relative difference of "
        "any step's loss from one process trained on the same batches.\n\n" + tables
        + "A killed agent refuses the driver's liveness probe at once (`agents_answering(refused_is_down=True)`), "
        "also through the shaper, which closes the connection when its target refuses; a silent one (SIGSTOP) "
        f"would cost the probe's `LIVENESS_SECONDS` (3 s). The bench took {figures['bench_seconds']} s.\n"
    )
    report("swarm_churn", "Killing a replica mid-training: 2 replicas per stage against 1 (`bench/swarm_churn.py`)",
           body, figures, write=not args.no_write)


def _workdir(args: argparse.Namespace) -> contextlib.AbstractContextManager[str]:
    """Where the agents run: `--workdir`, kept with the driver's log beside their logs; else a temporary one."""
    if args.workdir is None:
        return tempfile.TemporaryDirectory(prefix="arceus-swarm-churn-")
    args.workdir.mkdir(parents=True, exist_ok=False)  # a fresh one: no earlier run's logs mixed in
    handler = logging.FileHandler(args.workdir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    return contextlib.nullcontext(str(args.workdir))


def large(args: argparse.Namespace) -> None:
    """One R=2 trial of the large GPT: the victim, its stage and the step drawn from --seed."""
    if args.steps < 5:
        raise SystemExit("--steps must be at least 5 with --large: steps before the kill, its, the join's, after")
    load, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arceus-swarm-churn-large-") as workdir:
        setup = large_setup(args, Path(workdir))
        params = sum(_params(setup))  # while its text file is there
        rng = random.Random(args.seed)
        kill = Kill(rng.randrange(setup.stages), rng.randrange(2), rng.randint(2, args.steps - 3))
        args.checkpoint_interval = 0  # nothing rewinds: no checkpoint is needed (a 300M one costs minutes here)
        (trial,) = replicated_trials(setup, [kill], args, Path(workdir), lambda a: a, "large")
        driver_peak = peak_rss(os.getpid())
        trained_at = time.perf_counter()
        reference = setup.reference_losses(args.steps)  # after the agents stopped: its memory on top of none of theirs
        reference_s = time.perf_counter() - trained_at
        reference_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_after = os.getloadavg()
    rows = "".join(f"| {part} | {peak / MIB:.0f} |\n" for part, peak in trial.peaks.items())
    losses = " / ".join(f"{trial.losses[s]:.6f}" for s in sorted(trial.losses))
    reference_losses = " / ".join(f"{x:.6f}" for x in reference)
    figures = {
        "params": params, "steps": args.steps, "killed": f"{kill.stage}.{kill.replica}", "in_step": kill.after_step + 1,
        "steps_replayed": trial.steps_replayed, "step_done_s": round(trial.step_done_s, 2),
        "replacement_s": round(trial.replacement_s, 2), "join_bytes": trial.join_bytes,
        "join_s": round(trial.join_s, 2), "join_mb_per_s": round(trial.join_bytes / trial.join_s / 1e6, 1),
        "loss_deviation_max": float(f"{deviation(trial.losses, reference):.3g}"),
        "samples_per_s": [round(trial.before, 3), round(trial.during, 3), round(trial.after, 3)],
        "peak_rss_mib": {part: round(peak / MIB) for part, peak in trial.peaks.items()},
        "driver_peak_rss_mib": round(driver_peak / MIB),
        "load_average_1m": [round(load[0], 2), round(load_after[0], 2)],
        "bench_seconds": round(time.perf_counter() - started),
    }
    body = (
        f"`python bench/swarm_churn.py --large --steps {args.steps} --n-layer {args.n_layer} --d-model "
        f"{args.d_model}`. The machine was shared with other sessions (load average {load[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {os.cpu_count()} cores). GPT of {params / 1e6:.0f}M parameters (n_layer "
        f"{args.n_layer}, d_model {args.d_model}, block {BLOCK}; bench/large_model.py's) in 2 stages (layers "
        f"{list(setup.bounds)}) × 2 replicas, static agents of one torch thread each and a spare; batch {BATCH} in "
        f"{setup.micro_batches} micro-batches, GPipe, SGD (momentum 0.9: Adam's two moments would not fit 5 agents "
        f"of half the model beside the other sessions' tests in this machine's 24 GiB, nor did 24 blocks with SGD: "
        f"an agent was killed out of memory); {args.steps} steps, no "
        f"checkpoint. Stage {kill.stage}'s replica {kill.replica} SIGKILLed half a step's time into step "
        f"{kill.after_step + 1}; the spare offered from the next step boundary copied the stage (weights and "
        f"momentum) from the live replica and trained from the step after.\n\n"
        f"Steps replayed: **{trial.steps_replayed}**; step {kill.after_step + 1} done {trial.step_done_s:.1f} s "
        f"after the kill; the spare's copy of the stage: **{trial.join_bytes / 1e9:.2f} GB in {trial.join_s:.1f} s** "
        f"({figures['join_mb_per_s']} MB/s, over TLS on loopback); the spare training "
        f"{trial.replacement_s:.1f} s after the kill. Samples/s before / during / after: {trial.before:.2f} / "
        f"{trial.during:.2f} / {trial.after:.2f}. Losses, steps 1-{args.steps}: {losses}; one process on the same "
        f"batches (trained after the agents stopped, {reference_s:.0f} s): {reference_losses}; largest relative "
        f"difference {figures['loss_deviation_max']:.1e}.\n\n"
        "| process | peak RSS, VmHWM (MiB) |\n| --- | ---: |\n" + rows
        + f"| the driver (this process, before the one-process run) | {driver_peak / MIB:.0f} |\n"
        f"| this process after the one-process run | {reference_peak / MIB:.0f} |\n\n"
        f"The bench took {figures['bench_seconds']} s.\n"
    )
    report("swarm_churn_large", f"A {params / 1e6:.0f}M GPT losing a replica (`bench/swarm_churn.py --large`)", body,
           figures, write=not args.no_write)


def _params(setup: Setup) -> list[int]:
    spec, _, _ = fit_model_to_dataset(setup.model, setup.dataset)
    return list(spec.layer_params())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, help="training steps per trial (default 30; 7 with --large)")
    parser.add_argument("--checkpoint-interval", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="seeds the victims and the steps")
    parser.add_argument("--shaped", action="store_true", help="run every trial also over shaped links")
    add_link_arguments(parser)
    parser.add_argument("--large", action="store_true", help="one trial of a ~300M GPT instead (see above)")
    parser.add_argument("--n-layer", type=int, default=16, help="--large: the GPT's blocks")
    parser.add_argument("--d-model", type=int, default=1024, help="--large: the GPT's width")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    parser.add_argument("--workdir", type=Path, help="run the agents here (a new directory) and keep their logs and "
                        "the driver's (driver.log)")
    parser.add_argument("--shaped-replicas-only", action="store_true",
                        help="only the shaped R=2 trials: printed, nothing written")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.steps is None:
        args.steps = 7 if args.large else 30
    (large if args.large else churn)(args)


if __name__ == "__main__":
    main()
