"""Kill a random replica at a random step, trial after trial: with 2 replicas per stage nothing rewinds; beside it,
the same job with 1 replica per stage killed the same way rewinds to its checkpoint.

    .venv/bin/python bench/swarm_churn.py [--trials 10] [--steps 30] [--checkpoint-interval 10] [--seed 0]
                                          [--no-write]

Static agents and the driver as the replica tests run them (no control plane): the digits MLP [64, 128, 64, 10]
in 3 stages, batch 32 in 4 micro-batches, SGD with momentum, a checkpoint every `--checkpoint-interval` steps.
Each trial trains a fresh job for `--steps` steps and SIGKILLs one agent 5 ms after a random step ends (in
whatever phase the next step then is); victims, stages and steps are drawn from `--seed` up front.

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
step; the new agents started), and the largest relative difference of any step's loss from one process trained
on the same batches. Prints a table, writes docs/BENCHMARKS.md, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.checkpoint import checkpoint_digest  # noqa: E402
from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.training.driver import DriverError, train  # noqa: E402
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from arceus.training.recording import RecordingSink  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.launch import AgentProcess, spawn_static_agents_on_free_ports, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, replicated_pipeline_assignments  # noqa: E402
from devtools.reference import reference_run  # noqa: E402

MLP = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
DIGITS = validate_dataset_config({"name": "digits", "batch_size": 32})
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
BOUNDS, MICRO_BATCHES, SEED, STAGES = [0, 1, 2, 3], 4, 7, 3
BEFORE = 5  # steps whose rate is "before"


@dataclass(frozen=True)
class Kill:
    stage: int
    replica: int  # 0 or 1 with 2 replicas; 0 with 1
    after_step: int  # the kill lands 5 ms after this step ends


class TrialSink(RecordingSink):
    """Steps and their end times; SIGKILLs `victim` 5 ms after step `kill_after` ends; stops after `limit`."""

    def __init__(self, limit: int, kill_after: int = 0, victim: int = 0) -> None:
        super().__init__()
        self.limit, self.kill_after, self.victim = limit, kill_after, victim
        self.times: list[float] = []
        self.killed_at = math.nan

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.times.append(time.perf_counter())
        if self.victim and p.step == self.kill_after:
            threading.Timer(0.005, self._kill).start()

    def _kill(self) -> None:
        self.killed_at = time.perf_counter()
        os.kill(self.victim, signal.SIGKILL)

    def should_stop(self) -> bool:
        return bool(self.steps) and self.steps[-1].step >= self.limit


def assignments(job_id: str, addresses: list[list[str]], generation: int = 1) -> list[list[dict[str, Any]]]:
    return replicated_pipeline_assignments(
        job_id=job_id, model_config=MLP, boundaries=BOUNDS, addresses=addresses, optimizer=SGD, seed=SEED,
        micro_batches=MICRO_BATCHES, max_micro_batch_size=max_micro_batch_size(DIGITS, MICRO_BATCHES),
        generation=generation,
    )


def endpoint(stage: int, replica: int, address: str) -> StageEndpoint:
    return StageEndpoint(index=stage, address=address, node_id=f"{address}#{stage}.{replica}",
                         layer_start=BOUNDS[stage], layer_end=BOUNDS[stage + 1],
                         certificate=identity_for(address).certificate, replica=replica)


def plan_of(job_id: str, replicas: list[StageEndpoint], generation: int = 1, start_step: int = 0,
            joins: Any = None, checkpoint_interval: int = 0) -> TrainPlan:
    return TrainPlan(
        job_id=job_id, generation=generation, credential=driver_token(job_id, generation),
        stages=tuple(min((e for e in replicas if e.index == i), key=lambda e: e.replica) for i in range(STAGES)),
        replicas=tuple(replicas), dataset=DIGITS, epochs=2, learning_rate=SGD["lr"], micro_batches=MICRO_BATCHES,
        seed=SEED, rpc_timeout_seconds=30.0, start_step=start_step, checkpoint_interval=checkpoint_interval,
        replica_joins=joins,
    )


@dataclass
class Trial:
    kill: Kill
    steps_replayed: int
    step_done_s: float  # the kill until the step it interrupted completed
    replacement_s: float  # the kill until the replacement was there
    before: float  # samples/s
    during: float
    after: float
    loss_deviation: float
    detection_s: float = math.nan  # R=1: the kill until the driver's error
    restart_s: float = math.nan  # R=1: starting the three agents from the checkpoint


def rates(steps: list[int], times: list[float], killed_at: float, whole_at: float) -> tuple[float, float, float]:
    """samples/s before the kill, from the kill until `whole_at`, and after; a step counts once (its last run)."""
    batch = DIGITS["batch_size"]
    last = max(i for i, t in enumerate(times) if t < killed_at)
    before = BEFORE * batch / (times[last] - times[last - BEFORE])
    high = steps[last]
    during_steps = {s for s, t in zip(steps, times, strict=True) if killed_at < t <= whole_at and s > high}
    during = len(during_steps) * batch / (whole_at - killed_at)
    after_steps = [t for t in times if t > whole_at]
    after = len(after_steps) * batch / (after_steps[-1] - whole_at) if after_steps else math.nan
    return before, during, after


def deviation(losses: dict[int, float], reference: list[float]) -> float:
    return max(abs(loss - reference[step - 1]) / reference[step - 1] for step, loss in losses.items())


def replicated_trials(kills: list[Kill], args: argparse.Namespace, reference: list[float],
                      workdir: Path) -> list[Trial]:
    """Every trial's agents start at once: a pool of 7 + (trials - 1); trial t runs on the first 7 still alive
    (6 replicas and the spare), and its victim is gone for the trials after it."""
    slots, alive = [], list(range(7 + len(kills) - 1))  # each trial's agents, as indices into the pool
    for kill in kills:
        members = [[alive[2 * i], alive[2 * i + 1]] for i in range(STAGES)]
        slots.append([m + ([alive[6]] if i == kill.stage else []) for i, m in enumerate(members)])
        alive.remove(members[kill.stage][kill.replica])

    def hosted(pool: list[str]) -> list[list[dict[str, Any]]]:
        per_agent: list[list[dict[str, Any]]] = [[] for _ in pool]
        for t, trial in enumerate(slots):
            for stage, agents_of_stage in zip(assignments(f"churn-r2-{t}", layout_of(pool, trial)), trial,
                                              strict=True):
                for assignment, agent in zip(stage, agents_of_stage, strict=True):
                    per_agent[agent].append(assignment)
        return per_agent

    def layout_of(pool: list[str], trial: list[list[int]]) -> list[list[str]]:
        return [[pool[a] for a in stage] for stage in trial]

    agents, pool = spawn_static_agents_on_free_ports(7 + len(kills) - 1, hosted, workdir / "r2", ready_timeout=300.0)
    layouts = [layout_of(pool, trial) for trial in slots]
    by_address = dict(zip(pool, agents, strict=True))
    results = []
    try:
        for t, (kill, layout) in enumerate(zip(kills, layouts, strict=True)):
            victim = by_address[layout[kill.stage][kill.replica]]
            sink = TrialSink(args.steps, kill.after_step, victim.process.pid)
            spare = endpoint(kill.stage, 2, layout[kill.stage][2])
            replicas = [endpoint(i, r, a) for i, stage in enumerate(layout) for r, a in enumerate(stage[:2])]

            def joins(sink: TrialSink = sink, spare: StageEndpoint = spare) -> list[StageEndpoint]:
                return [spare] if sink.steps and sink.steps[-1].step > sink.kill_after else []

            train(plan_of(f"churn-r2-{t}", replicas, joins=joins, checkpoint_interval=args.checkpoint_interval),
                  sink)
            if victim.process.wait(10) != -signal.SIGKILL:
                raise RuntimeError(f"trial {t}: the victim was not killed")
            steps = [p.step for p in sink.steps]
            if steps != list(range(1, args.steps + 1)):
                raise RuntimeError(f"trial {t}: steps went {steps}")
            joined = next(at for p, at in zip(sink.steps, sink.times, strict=True)
                          if any(c.node_id == spare.node_id and c.micro_batches for c in p.stages))
            done = sink.times[kill.after_step]  # the interrupted step's end (steps never repeat here)
            before, during, after = rates(steps, sink.times, sink.killed_at, joined)
            results.append(Trial(
                kill, steps_replayed=len(steps) - len(set(steps)), step_done_s=done - sink.killed_at,
                replacement_s=joined - sink.killed_at, before=before, during=during, after=after,
                loss_deviation=deviation({p.step: p.loss for p in sink.steps}, reference),
            ))
            print(f"R=2 trial {t}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        stop_agents([a for a in agents if a.process.poll() is None])
    return results


def unreplicated_trials(kills: list[Kill], args: argparse.Namespace, reference: list[float],
                        workdir: Path) -> list[Trial]:
    """Trial t's three agents also host trial t + 1's job; after the kill, three new ones start with trial t's
    checkpoint (generation 2) and trial t + 1's job, and the survivors stop."""

    def start(jobs: list[tuple[str, int, list[dict[str, Any]] | None]], directory: str) -> tuple[
            list[AgentProcess], list[str]]:
        def hosted(addresses: list[str]) -> list[list[dict[str, Any]]]:
            per_agent: list[list[dict[str, Any]]] = [[] for _ in range(STAGES)]
            for job_id, generation, checkpoints in jobs:
                for i, (assignment,) in enumerate(assignments(job_id, [[a] for a in addresses], generation)):
                    assignment["checkpoint"] = checkpoints[i] if checkpoints else None
                    per_agent[i].append(assignment)
            return per_agent

        return spawn_static_agents_on_free_ports(STAGES, hosted, workdir / directory, ready_timeout=300.0)

    agents, addresses = start([("churn-r1-0", 1, None)], "r1-0")
    results = []
    try:
        for t, kill in enumerate(kills):
            job_id = f"churn-r1-{t}"
            victim = agents[kill.stage]
            sink = TrialSink(args.steps, kill.after_step, victim.process.pid)
            replicas = [endpoint(i, 0, a) for i, a in enumerate(addresses)]
            try:
                train(plan_of(job_id, replicas, checkpoint_interval=args.checkpoint_interval), sink)
                raise RuntimeError(f"trial {t}: the job survived losing its only replica of stage {kill.stage}")
            except DriverError:
                detected = time.perf_counter()
            resume = max((s for s in sink.checkpoints if s <= kill.after_step), default=0)
            refs = None
            if resume:
                refs = [{"step": resume, "url": str(f.path), "sha256": checkpoint_digest(f.path.read_bytes())}
                        for f in sink.checkpoints[resume]]
            nxt = [(f"churn-r1-{t + 1}", 1, None)] if t + 1 < len(kills) else []
            new_agents, new_addresses = start([(job_id, 2, refs), *nxt], f"r1-{t + 1}")
            restarted = time.perf_counter()
            stop_agents([a for a in agents if a.process.poll() is None])
            agents, addresses = new_agents, new_addresses
            resumed = TrialSink(args.steps)
            train(plan_of(job_id, [endpoint(i, 0, a) for i, a in enumerate(addresses)], generation=2,
                          start_step=resume, checkpoint_interval=args.checkpoint_interval), resumed)
            steps = [p.step for p in sink.steps] + [p.step for p in resumed.steps]
            times = sink.times + resumed.times
            done = resumed.times[kill.after_step - resume]  # the interrupted step's end on the new agents
            before, during, after = rates(steps, times, sink.killed_at, done)
            losses = {p.step: p.loss for p in [*sink.steps, *resumed.steps]}
            results.append(Trial(
                kill, steps_replayed=len(steps) - len(set(steps)), step_done_s=done - sink.killed_at,
                replacement_s=restarted - sink.killed_at, before=before, during=during, after=after,
                loss_deviation=deviation(losses, reference), detection_s=detected - sink.killed_at,
                restart_s=restarted - detected,
            ))
            print(f"R=1 trial {t}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        stop_agents([a for a in agents if a.process.poll() is None])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="training steps per trial")
    parser.add_argument("--checkpoint-interval", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="seeds the victims and the steps")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.steps < 2 * BEFORE + 4:
        parser.error(f"--steps must be at least {2 * BEFORE + 4}: {BEFORE} steps before the kill and room after")

    rng = random.Random(args.seed)
    kills = [Kill(rng.randrange(STAGES), rng.randrange(2), rng.randint(BEFORE + 1, args.steps - BEFORE - 2))
             for _ in range(args.trials)]
    reference = reference_run(
        {"model_config": MLP, "dataset_config": DIGITS, "epochs": 2, "learning_rate": SGD["lr"], "optimizer": "sgd",
         "momentum": SGD["momentum"], "weight_decay": SGD["weight_decay"], "seed": SEED},
        max_steps=args.steps,
    ).losses
    load, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arceus-swarm-churn-") as workdir:
        replicated = replicated_trials(kills, args, reference, Path(workdir))
        # The same stage, step, and (the only) replica 0 of that stage.
        single = unreplicated_trials([Kill(k.stage, 0, k.after_step) for k in kills], args, reference,
                                     Path(workdir))
    load_after = os.getloadavg()

    rows = ""
    for t, (a, b) in enumerate(zip(replicated, single, strict=True)):
        rows += (f"| {t} | {a.kill.stage}.{a.kill.replica} | {a.kill.after_step + 1} | "
                 f"{a.steps_replayed} / {b.steps_replayed} | {a.step_done_s:.2f} / {b.step_done_s:.2f} | "
                 f"{a.before:.0f} / {b.before:.0f} | {a.during:.0f} / {b.during:.1f} | {a.after:.0f} / {b.after:.0f} | "
                 f"{a.replacement_s:.2f} / {b.replacement_s:.2f} | {a.loss_deviation:.1e} / {b.loss_deviation:.1e} |\n")

    def med(trials: list[Trial], attr: str) -> float:
        return statistics.median(getattr(x, attr) for x in trials)

    figures: dict[str, Any] = {"trials": args.trials, "steps": args.steps,
                               "checkpoint_interval": args.checkpoint_interval, "seed": args.seed}
    for name, trials in (("r2", replicated), ("r1", single)):
        figures[f"{name}_steps_replayed_total"] = sum(x.steps_replayed for x in trials)
        figures[f"{name}_trials_with_replay"] = sum(x.steps_replayed > 0 for x in trials)
        for attr in ("step_done_s", "replacement_s", "before", "during", "after"):
            figures[f"{name}_{attr}_median"] = round(med(trials, attr), 3)
        figures[f"{name}_step_done_s_max"] = round(max(x.step_done_s for x in trials), 3)
        figures[f"{name}_loss_deviation_max"] = float(f"{max(x.loss_deviation for x in trials):.3g}")
    figures["r1_detection_s_median"] = round(med(single, "detection_s"), 3)
    figures["r1_restart_s_median"] = round(med(single, "restart_s"), 3)
    figures["load_average_1m"] = [round(load[0], 2), round(load_after[0], 2)]
    figures["bench_seconds"] = round(time.perf_counter() - started)

    body = (
        f"The machine was shared with other sessions (load average {load[0]:.2f} before, {load_after[0]:.2f} "
        f"after; {os.cpu_count()} cores). Static agents and the driver, no control plane. Digits MLP "
        f"{MLP['layer_sizes']} in 3 stages, batch {DIGITS['batch_size']}, M={MICRO_BATCHES}, SGD (momentum 0.9), "
        f"a checkpoint every {args.checkpoint_interval} steps; {args.trials} trials (seed {args.seed}) of "
        f"{args.steps} steps, each a fresh job; one agent SIGKILLed 5 ms after a random step ends. "
        "R=2: 3 stages × 2 replicas, a spare offered from the first step boundary after the kill (it copies the "
        "stage from a live replica). R=1: the same stage and step; the job rewinds to its last checkpoint on "
        "three new agent processes (starting them is part of it here; a control plane would reuse running "
        "agents and add its detection, bench/fault_trials.py). Each cell: R=2 / R=1. Samples/s before: the 5 "
        "steps before the kill; during: the kill until the stage is whole again (the spare's first step; the "
        "interrupted step done after the rewind), counting each step once; after: the rest. Replacement: the "
        "spare's first step done; the new agents started. Loss deviation: the largest relative difference of "
        "any step's loss from one process trained on the same batches.\n\n"
        "| trial | stage.replica killed | in step | steps replayed | s until that step completed | "
        "samples/s before | during | after | s until the replacement | loss deviation |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows
        + f"\nR=2: **{figures['r2_steps_replayed_total']} steps replayed** in {args.trials} trials, the "
        f"interrupted step done {figures['r2_step_done_s_median']} s after the kill (median; max "
        f"{figures['r2_step_done_s_max']} s), the spare training {figures['r2_replacement_s_median']} s after it. "
        f"R=1: {figures['r1_steps_replayed_total']} steps replayed, the interrupted step done "
        f"{figures['r1_step_done_s_median']} s after the kill (the driver's error after "
        f"{figures['r1_detection_s_median']} s, the three agents started in {figures['r1_restart_s_median']} s). "
        "A killed agent refuses the driver's liveness probe at once (`agents_answering(refused_is_down=True)`); "
        "a silent one (SIGSTOP) would cost the probe's `LIVENESS_SECONDS` (3 s). "
        f"The bench took {figures['bench_seconds']} s.\n"
    )
    report("swarm_churn", "Killing a replica mid-training: 2 replicas per stage against 1 (`bench/swarm_churn.py`)",
           body, figures, write=not args.no_write)


if __name__ == "__main__":
    main()
