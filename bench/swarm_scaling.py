"""Replicated stages on this machine (1, 2, 3 replicas per stage), on loopback and on shaped links, beside the
step model's predictions; then the model at scale: a 1B-parameter model in 8 stages over 100 devices under churn.

    .venv/bin/python bench/swarm_scaling.py [--replicas 1 2 3] [--steps 14] [--warmup 2] [--batch-size 24]
                                            [--links loopback shaped] [--delay-ms 20] [--rate-mbit 100]
                                            [--hours 24] [--rounds 1] [--section swarm_scaling] [--no-write]

Measured: the GPT of bench/pipeline_vs_torch.py in 3 stages (layer boundaries [0, 3, 5, 8]), batch 24 × 128 tokens
in 6 micro-batches, Adam, GPipe, every stage with R replicas (static agents, one process and one torch thread each,
all started with the same job twice: once reached directly, once with every agent behind its own `devtools.shaper`
links, one in front of its gRPC port and one in front of its replicas' exchange listener). Per run, medians over the
steps after warm-up: samples/s (the batch over a step's wall time), the agents' CPU seconds per sample (utime +
stime from /proc/PID/stat, every agent, over each step), this process's CPU per step (the driver, and on shaped runs
the shaper); and each agent's peak resident memory (VmHWM, over both of its runs). With --rounds N the R values run
interleaved N times (1, 2, 3, 1, 2, 3, ...), each on fresh agents: a figure is the median over the rounds, and the
CPU ratio to R=1 is each round's (R against that round's R=1), its median and range over the rounds, so that no single
R=1 run sets it.

Predicted: arceus.swarm.model with every replica a process sharing this host's cores (`SharedHost`, processor
sharing), calibrated on the R=1 runs and on this machine only: each stage's compute per sample (its agent's CPU,
less its optimizer step), one optimizer step's CPU (timed here), the exchange's CPU per byte (bench/exchange_cost.py,
timed here), this process's CPU per step (and, shaped, per byte sent), the links by the shaper's rule. R=2 and R=3
are the model's predictions from those.

At scale: `arceus.swarm.churn.simulate_churn` over the step model; the devices and the 1B model are stated
below (assumptions, not measurements); the repair, rewind and join times are the issue's and the benches' measured
orders. Prints both tables, writes docs/BENCHMARKS.md, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.model.optimizers import make_optimizer  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.swarm.churn import Churn, simulate_churn  # noqa: E402
from arceus.swarm.model import (  # noqa: E402
    Link,
    Replica,
    SharedHost,
    Workload,
    cpu_seconds_per_step,
    exchange_bytes_per_replica,
    shared_host_samples_per_second,
)
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.exchange_cost import agent_exchange_cpu_per_byte  # noqa: E402
from bench.pipeline_vs_torch import LR, MODEL, SEED  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.launch import AgentProcess, spawn_static_agents_on_free_ports, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, replicated_pipeline_assignments  # noqa: E402
from devtools.shaper import ShaperThread, add_link_arguments, link_shape  # noqa: E402

DATASET = {"name": "text", "batch_size": 24, "val_batch_size": 64, "block_size": 128}  # --batch-size sets the batch
MICRO_BATCHES, WARMUP, BOUNDS = 6, 2, [0, 3, 5, 8]  # --warmup sets the warm-up steps
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def host_busy_seconds() -> float:
    """CPU seconds this host's cores were busy so far, by every process, and taken by the hypervisor (steal): the
    first line of /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in Path("/proc/stat").read_text().split(
        "\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICK


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def peak_rss_mib(pid: int) -> float:
    """A process's peak resident memory (VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


class Meter(Clock):
    """Step end times and progress; the CPU seconds so far of the agents, of this process and of the whole host at
    the end of the last warm-up step and of every step after; then it stops the run (no validation, no final
    checkpoint)."""

    def __init__(self, pids: list[int], steps: int, warmup: int) -> None:
        super().__init__()
        self.pids, self.limit, self.warmup = pids, steps, warmup
        self.steps: list[StepProgress] = []
        self.cpu: list[tuple[list[float], float]] = []
        self.host_busy: list[float] = []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.steps.append(p)
        if len(self.steps) >= self.warmup:
            self.cpu.append(([cpu_seconds(pid) for pid in self.pids], time.process_time()))
            self.host_busy.append(host_busy_seconds())

    def should_stop(self) -> bool:
        return len(self.steps) >= self.limit


@dataclass
class Run:
    replicas: int
    shaped: bool
    samples_per_s: float
    agent_cpu_per_sample: float
    agent_cpu_per_step: list[float]  # per agent
    own_cpu_per_step: float  # this process: the driver, and the shaper on shaped runs
    stage_cpu_per_sample: list[float]  # per stage, its replicas' CPU seconds over the samples
    bytes_sent_per_step: float  # every replica's
    loss: float
    free_cores: float  # the cores less what other processes used over the measured steps
    peak_rss_mib: list[float] = field(default_factory=list)  # per agent, over both runs of its R


def run(job_id: str, replicas: int, endpoints: list[StageEndpoint], agents: list[AgentProcess], steps: int,
        shaped: bool, dataset: dict[str, Any], warmup: int = WARMUP) -> Run:
    plan = TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1),
        stages=tuple(e for e in endpoints if e.replica == 0), replicas=tuple(endpoints), dataset=dataset, epochs=1,
        learning_rate=LR, micro_batches=MICRO_BATCHES, seed=SEED, schedule="gpipe",
        rpc_timeout_seconds=120.0,
    )
    pids = [a.process.pid for a in agents]
    meter = Meter(pids, steps, warmup)
    train(plan, meter)
    measured = len(meter.steps) - warmup
    batch = dataset["batch_size"]
    first, last = meter.steps[warmup - 1], meter.steps[-1]
    sent = sum(c.bytes_sent for c in last.stages) - sum(c.bytes_sent for c in first.stages)
    # Per measured step: its wall time, every agent's CPU, this process's; the run's figures are their medians.
    walls = [b - a for a, b in zip(meter.times[warmup - 1:], meter.times[warmup:], strict=False)]
    agents = [[b - a for a, b in zip(before, after, strict=True)]
              for (before, _), (after, _) in zip(meter.cpu, meter.cpu[1:], strict=False)]
    own = [b - a for (_, a), (_, b) in zip(meter.cpu, meter.cpu[1:], strict=False)]
    # What other processes (other sessions) and the hypervisor took of the cores over the very steps measured: the
    # host's busy CPU less the agents' and this process's.
    (agents_first, own_first), (agents_last, own_last) = meter.cpu[0], meter.cpu[-1]
    others = (meter.host_busy[-1] - meter.host_busy[0] - (sum(agents_last) - sum(agents_first))
              - (own_last - own_first))
    host_cores = os.cpu_count() or 1
    cores = min(host_cores, max(0.05 * host_cores, host_cores - others / (meter.times[-1] - meter.times[warmup - 1])))
    n = len(BOUNDS) - 1
    return Run(
        replicas=replicas, shaped=shaped,
        samples_per_s=batch / statistics.median(walls),
        agent_cpu_per_sample=statistics.median(sum(step) for step in agents) / batch,
        agent_cpu_per_step=[statistics.median(step[j] for step in agents) for j in range(len(pids))],
        own_cpu_per_step=statistics.median(own),
        stage_cpu_per_sample=[statistics.median(sum(step[i * replicas:(i + 1) * replicas]) for step in agents) / batch
                              for i in range(n)],  # agents by stage
        bytes_sent_per_step=sent / measured,
        loss=last.loss,
        free_cores=cores,
    )


def measure(replicas: int, steps: int, shape: dict[str, float], workdir: Path, dataset: dict[str, Any],
            links: list[str], warmup: int = WARMUP) -> list[Run]:
    """The runs (loopback, shaped, as `links` names them) of R replicas per stage, on 3R fresh agents hosting
    every job."""
    n = len(BOUNDS) - 1
    jobs = {shaped: f"scaling-r{replicas}{'-shaped' if shaped else ''}"
            for shaped in (False, True) if ("shaped" if shaped else "loopback") in links}

    def hosted(flat: list[str]) -> list[list[dict[str, Any]]]:
        per_agent: list[list[dict[str, Any]]] = [[] for _ in flat]
        for job_id in jobs.values():
            stages = replicated_pipeline_assignments(
                job_id=job_id, model_config=MODEL, boundaries=BOUNDS, addresses=layout(flat),
                optimizer={"name": "adam", "lr": LR}, seed=SEED, micro_batches=MICRO_BATCHES,
                max_micro_batch_size=max_micro_batch_size(dataset, MICRO_BATCHES),
            )
            for i, stage in enumerate(stages):
                for r, assignment in enumerate(stage):
                    per_agent[i * replicas + r].append(assignment)
        return per_agent

    def layout(flat: list[str]) -> list[list[str]]:
        return [flat[i * replicas:(i + 1) * replicas] for i in range(n)]

    agents, flat = spawn_static_agents_on_free_ports(n * replicas, hosted, workdir / f"r{replicas}",
                                                     ready_timeout=240.0)
    addresses = layout(flat)
    exchange_of = {a: agent.exchange_address for a, agent in zip(flat, agents, strict=True)}
    runs = []
    try:
        with ShaperThread() as shaper:
            for shaped, job_id in jobs.items():
                endpoints = [
                    StageEndpoint(
                        index=i, address=shaper.address(a, **shape) if shaped else a,
                        node_id=f"agent-{i}-{r}", layer_start=BOUNDS[i], layer_end=BOUNDS[i + 1],
                        certificate=identity_for(a).certificate, replica=r,
                        # The exchange streams go to the agent's exchange listener: shaped by a link of their own.
                        exchange_address=shaper.address(exchange_of[a], **shape) if shaped else "",
                    )
                    for i, stage in enumerate(addresses) for r, a in enumerate(stage)
                ]
                runs.append(run(job_id, replicas, endpoints, agents, steps, shaped, dataset, warmup))
                print(f"R={replicas} {'shaped' if shaped else 'loopback'}: {runs[-1]}", file=sys.stderr, flush=True)
        peaks = [peak_rss_mib(a.process.pid) for a in agents]
    finally:
        stop_agents(agents)
    for r in runs:
        r.peak_rss_mib = peaks
    return runs


# --- the model ---------------------------------------------------------------------------------------------
def bench_workload(batch_size: int) -> Workload:
    spec = model_spec_from_config(MODEL)
    params = spec.layer_params()
    boundary = DATASET["block_size"] * MODEL["d_model"] * 4  # fp32 activations (and their gradients) per sample
    return Workload(
        MICRO_BATCHES, batch_size, (boundary,) * (len(BOUNDS) - 2),
        tuple(4.0 * sum(params[a:b]) for a, b in zip(BOUNDS, BOUNDS[1:], strict=False)), schedule="gpipe",
    )


def optimizer_step_cpu(params: int, repeats: int = 5) -> float:
    """CPU seconds of one Adam step (the agents' fused one, `arceus.model.optimizers`) over `params` parameters:
    what every replica of a stage runs in full."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each agent
    try:
        return _optimizer_step_cpu(params, repeats)
    finally:
        torch.set_num_threads(threads)


def _optimizer_step_cpu(params: int, repeats: int) -> float:
    weights = torch.nn.Parameter(torch.zeros(params))
    weights.grad = torch.randn(params, generator=torch.Generator().manual_seed(0))
    optimizer = make_optimizer([weights], "adam", LR)
    optimizer.step()  # its state
    before = time.process_time()
    for _ in range(repeats):
        optimizer.step()
    return (time.process_time() - before) / repeats


@dataclass(frozen=True)
class Calibration:
    """From the R=1 runs and this machine: each stage's compute CPU seconds per sample (its agent's CPU over the
    samples, less its optimizer step), each replica's CPU per step beyond that (its optimizer step, measured here
    on the stage's mean size: every replica runs it), the exchange's CPU per byte sent or received
    (bench/exchange_cost.py: real exchanges over TLS on loopback, here), this process's CPU per step on loopback,
    and the shaper's CPU per byte it carried. (The agents' own compute counters are wall time, stretched where
    processes outnumber cores.)"""

    batch_size: int
    compute: list[float]
    replica_overhead_s: float
    exchange_cpu_per_byte: float
    driver_cpu_s: float
    shaper_cpu_per_byte: float

    @classmethod
    def of(cls, batch: int, loopback: Run, shaped: Run | None, overhead: float,
           exchange_cpu_per_byte: float) -> Calibration:
        # Every byte a replica sends crosses the shaper once; the driver's own pushes and replies are few.
        shaper = (0.0 if shaped is None else
                  max(0.0, shaped.own_cpu_per_step - loopback.own_cpu_per_step) / shaped.bytes_sent_per_step)
        compute = [max(c - overhead / batch, 1e-6) for c in loopback.stage_cpu_per_sample]
        return cls(batch, compute, overhead, exchange_cpu_per_byte, loopback.own_cpu_per_step, shaper)

    def predict(self, replicas: int, shaped: bool, shape: dict[str, float], cores: float) -> tuple[float, float]:
        """(samples/s, agent CPU seconds per sample) the model predicts for R replicas on `cores` free cores."""
        w = bench_workload(self.batch_size)
        # The shaper shapes each connection on its own: each peer a replica sends to is a link of its own.
        link = Link(shape["delay_s"], shape["rate_bps"], per_peer=True) if shaped else Link(0.0, 1e18)
        stages = [[Replica(c, link)] * replicas for c in self.compute]
        boundary_bytes = 2 * sum(w.boundary_bytes_per_sample) * w.batch_size
        exchange_bytes = replicas * sum(exchange_bytes_per_replica(stages, w))  # every replica's, shaped once
        shaper = self.shaper_cpu_per_byte * (boundary_bytes + exchange_bytes) if shaped else 0.0
        agents = SharedHost(cores, self.replica_overhead_s, exchange_cpu_per_byte=self.exchange_cpu_per_byte)
        host = replace(agents, other_cpu_s=self.driver_cpu_s + shaper)
        return (shared_host_samples_per_second(stages, w, host),
                cpu_seconds_per_step(stages, w, agents) / w.batch_size)


def median_run(runs: list[Run]) -> Run:
    """One R's runs over the rounds as one: each figure the median of the rounds' (per agent or stage: each its own)."""
    def med(values: list[Any]) -> Any:
        if isinstance(values[0], list):
            return [statistics.median(v) for v in zip(*values, strict=True)]
        return statistics.median(values)
    return Run(**{f.name: (getattr(runs[0], f.name) if f.name in ("replicas", "shaped")
                           else med([getattr(r, f.name) for r in runs])) for f in fields(Run)})


def cpu_ratios(rounds: dict[tuple[int, bool], list[Run]]) -> dict[tuple[int, bool], list[float]]:
    """Each R's agent CPU per sample over R=1's of the same round and links, round by round."""
    return {key: [r.agent_cpu_per_sample / one.agent_cpu_per_sample
                  for r, one in zip(runs, rounds[(1, key[1])], strict=True)] for key, runs in rounds.items()}


def ratio_text(ratios: list[float]) -> str:
    """The median ratio, and with several rounds its range over them (none for R=1's own, always 1)."""
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 and min(ratios) != max(ratios) else ""
    return f"{statistics.median(ratios):.2f}×{spread}"


def overhead_note(runs: dict[tuple[int, bool], Run], ratios: dict[tuple[int, bool], list[float]],
                  c: Calibration) -> str:
    """The CPU/sample goal (R > 1 within 1.1x of R=1), met or not, and what the calibrated costs put the extra
    at: the exchange's bytes (sent and received, every replica) and the optimizer steps of the replicas beyond one."""
    w = bench_workload(c.batch_size)
    parts = []
    for (replicas, shaped), r in sorted(runs.items()):
        if replicas == 1:
            continue
        ratio = statistics.median(ratios[(replicas, shaped)])
        stages = [[Replica(x, Link(0.0, 1e18))] * replicas for x in c.compute]
        handled = 2 * replicas * sum(exchange_bytes_per_replica(stages, w))  # sent and received, every replica
        exchange = c.exchange_cpu_per_byte * handled / w.batch_size
        optimizer = c.replica_overhead_s * (replicas - 1) * len(w.gradient_bytes) / w.batch_size
        extra = r.agent_cpu_per_sample - runs[(1, shaped)].agent_cpu_per_sample
        parts.append(
            f"R={replicas} {'shaped' if shaped else 'loopback'} {ratio_text(ratios[(replicas, shaped)])} "
            f"({'met' if ratio <= 1.1 else 'not met'}: "
            f"{extra * 1000:+.1f} ms/sample, of which the exchange {exchange * 1000:.1f} and the extra optimizer "
            f"steps {optimizer * 1000:.1f} by the calibration)"
        )
    return "CPU/sample against R=1 (goal: within 1.1×): " + "; ".join(parts) + "."


# --- at scale ----------------------------------------------------------------------------------------------
SCALE_PARAMS, SCALE_STAGES, SCALE_DEVICES = 1.0e9, 8, 100
SCALE_TOKENS, SCALE_D_MODEL = 512, 2048  # a sample's tokens; the width of the boundary activations
SCALE_BATCH, SCALE_MICRO = 1024, 64  # samples per step (0.5M tokens), micro-batches
SCALE_FLOPS = (4e12, 40e12)  # devices' achieved FLOP/s, log-uniform (a T4 to a 4090 at a realistic utilisation)
BYTES_PER_VALUE = {"fp32": 4.0, "int8": 1.06}  # the job's transfer compression, as sent (bench/shaped_pipeline.py)
STATE_VALUES_PER_PARAM = 3  # Adam: weights and two moments, what a joiner copies and a rewind loads


def scale_devices(link: Link, seed: int) -> list[Replica]:
    rng = random.Random(f"devices-{seed}")  # not the churn's stream (Random(seed)): fast devices would leave late
    flops_per_sample = 6 * SCALE_PARAMS / SCALE_STAGES * SCALE_TOKENS
    low, high = (math.log(f) for f in SCALE_FLOPS)
    return [Replica(flops_per_sample / math.exp(rng.uniform(low, high)), link) for _ in range(SCALE_DEVICES)]


def scale_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    link = Link(args.delay_ms / 1000, args.rate_mbit * 1e6)
    devices = scale_devices(link, args.seed)
    state_bytes = STATE_VALUES_PER_PARAM * 4 * SCALE_PARAMS / SCALE_STAGES
    copy_s = state_bytes * 8 / link.bandwidth_bps  # a joiner's copy from a peer, a rewind's checkpoint load
    rows = []
    for transfer, per_value in BYTES_PER_VALUE.items():
        w = Workload(SCALE_MICRO, SCALE_BATCH, (SCALE_TOKENS * SCALE_D_MODEL * per_value,) * (SCALE_STAGES - 1),
                     (per_value * SCALE_PARAMS / SCALE_STAGES,) * SCALE_STAGES, schedule="1f1b")
        calm_r1 = simulate_churn(devices, SCALE_STAGES, 1, w, churn(args, copy_s, 1, hours=1, leaving=0.0))
        interval = max(1, round(1800 * calm_r1.samples_per_second / SCALE_BATCH))  # every ~30 minutes at R=1
        for replicas in range(1, SCALE_DEVICES // SCALE_STAGES + 1):
            calm = simulate_churn(devices, SCALE_STAGES, replicas, w, churn(args, copy_s, interval, args.hours, 0.0))
            churned = simulate_churn(devices, SCALE_STAGES, replicas, w, churn(args, copy_s, interval, args.hours,
                                                                             args.leaves_per_hour))
            rows.append({"transfer": transfer, "replicas": replicas, "devices": replicas * SCALE_STAGES,
                         "calm": calm.samples_per_second, "churn": churned.samples_per_second,
                         "rewinds": churned.rewinds, "repairs": churned.repairs, "replayed": churned.steps_replayed,
                         "interval": interval})
    return rows


def churn(args: argparse.Namespace, copy_s: float, interval: int, hours: float, leaving: float) -> Churn:
    return Churn(leaves_per_hour=leaving, detection_s=args.repair_s, recovery_s=0.0,
                 rewind_s=args.rewind_s + copy_s, join_s=copy_s, checkpoint_interval_steps=interval, hours=hours,
                 seed=args.seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="R values to measure (1 first)")
    parser.add_argument("--steps", type=int, default=14, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="of those, the first not measured (an agent's heap still grows over its first steps "
                             "of a replicated stage: docs/BENCHMARKS.md, swarm_scaling_loopback)")
    parser.add_argument("--batch-size", type=int, default=DATASET["batch_size"],
                        help="sequences per step (the exchange's bytes per step do not grow with it)")
    parser.add_argument("--links", nargs="+", choices=["loopback", "shaped"], default=["loopback", "shaped"],
                        help="which runs of each R (loopback first: it calibrates the model)")
    parser.add_argument("--section", default="swarm_scaling",
                        help="the docs/BENCHMARKS.md section written (another keeps the default run's figures)")
    add_link_arguments(parser)
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours at scale")
    parser.add_argument("--leaves-per-hour", type=float, default=0.1, help="each device's departure rate at scale")
    parser.add_argument("--repair-s", type=float, default=3.1,
                        help="at scale: a lost replica's loss until its step runs again; a home device that vanishes "
                             "sends no refusal, so the driver's 3 s liveness probe runs out (bench/swarm_churn.py: "
                             "3.1 s so at a2c6b56; 0.1 s for a killed agent that refuses)")
    parser.add_argument("--rewind-s", type=float, default=7.0,
                        help="at scale: a rewind's re-placement after that, before its checkpoint loads "
                             "(bench/fault_trials.py: recovery 7-10 s from the kill)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the R values interleaved this many times (1, 2, 3, 1, 2, 3, ...): figures are the "
                             "medians over the rounds, the CPU ratio to R=1 each round's against its own R=1")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.warmup < 1 or args.steps <= args.warmup + 1:
        parser.error(f"--warmup must be at least 1 and --steps exceed it by 2 or more (--steps {args.steps}, "
                     f"--warmup {args.warmup})")
    if args.replicas[0] != 1 or any(not 1 <= r <= MICRO_BATCHES for r in args.replicas):
        parser.error(f"--replicas must start with 1 (the calibration) and stay within 1..{MICRO_BATCHES}")
    if "loopback" not in args.links:
        parser.error("--links must include loopback: the R=1 loopback run calibrates the model")
    shape = link_shape(args)
    try:
        dataset = validate_dataset_config({**DATASET, "batch_size": args.batch_size})
    except ValueError as exc:
        parser.error(f"--batch-size {args.batch_size}: {exc}")

    load, started = os.getloadavg(), time.perf_counter()
    rounds: dict[tuple[int, bool], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="arceus-swarm-scaling-") as workdir:
        for k in range(args.rounds):
            for replicas in args.replicas:
                for r in measure(replicas, args.steps, shape, Path(workdir) / f"round{k}", dataset, args.links,
                                 args.warmup):
                    rounds.setdefault((r.replicas, r.shaped), []).append(r)
    load_after = os.getloadavg()
    runs = {key: median_run(rs) for key, rs in rounds.items()}
    ratios = cpu_ratios(rounds)
    stage_params = [sum(model_spec_from_config(MODEL).layer_params()[a:b]) for a, b in zip(BOUNDS, BOUNDS[1:],
                                                                                            strict=False)]
    mean_params = round(sum(stage_params) / len(stage_params))
    overhead = optimizer_step_cpu(mean_params)
    per_byte = agent_exchange_cpu_per_byte(mean_params, replicas=2)
    calibration = Calibration.of(args.batch_size, runs[(1, False)], runs.get((1, True)), overhead, per_byte)

    rows, figures = "", {}
    for (replicas, shaped), r in runs.items():
        rate, cpu = calibration.predict(replicas, shaped, shape, r.free_cores)
        ratio = statistics.median(ratios[(replicas, shaped)])
        rows += (f"| {replicas} | {'shaped' if shaped else 'loopback'} | {r.samples_per_s:.2f} | {rate:.2f} | "
                 f"{r.samples_per_s / rate - 1:+.0%} | {r.free_cores:.2f} | {r.agent_cpu_per_sample * 1000:.1f} | "
                 f"{cpu * 1000:.1f} | "
                 f"{ratio_text(ratios[(replicas, shaped)])} | {r.own_cpu_per_step:.2f} | "
                 f"{r.bytes_sent_per_step / 1e6:.1f} | "
                 f"{max(r.peak_rss_mib):.0f} | {r.loss:.4f} |\n")
        key = f"r{replicas}_{'shaped' if shaped else 'loopback'}"
        figures[f"{key}_samples_per_s"] = round(r.samples_per_s, 3)
        figures[f"{key}_predicted_samples_per_s"] = round(rate, 3)
        figures[f"{key}_agent_cpu_ms_per_sample"] = round(r.agent_cpu_per_sample * 1000, 2)
        figures[f"{key}_cpu_ratio_to_r1"] = round(ratio, 3)
        if args.rounds > 1:
            figures[f"{key}_cpu_ratio_to_r1_rounds"] = [round(x, 3) for x in ratios[(replicas, shaped)]]
        figures[f"{key}_peak_rss_mib_max"] = round(max(r.peak_rss_mib), 1)
    measured_table = (
        "| R | links | samples/s | predicted | measured vs predicted | free cores | agent CPU ms/sample | "
        "predicted | CPU/sample vs R=1 | driver (+shaper) CPU s/step | MB sent/step | peak RSS per agent, max MiB | "
        "loss at last step |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        + rows
    )

    scale = scale_rows(args)
    scale_table = ("| exchange | R | devices | samples/s, no churn | samples/s, churn | rewinds | repairs | "
                   "steps replayed |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for s in scale:
        scale_table += (f"| {s['transfer']} | {s['replicas']} | {s['devices']} | {s['calm']:.2f} | {s['churn']:.2f} | "
                        f"{s['rewinds']} | {s['repairs']} | {s['replayed']} |\n")
    for transfer in BYTES_PER_VALUE:
        mine = [s for s in scale if s["transfer"] == transfer]
        best = max(mine, key=lambda s: s["churn"])
        figures[f"scale_{transfer}_r1_churn_samples_per_s"] = round(mine[0]["churn"], 3)
        figures[f"scale_{transfer}_best_r"] = best["replicas"]
        figures[f"scale_{transfer}_best_churn_samples_per_s"] = round(best["churn"], 3)
    figures.update(bench_seconds=round(time.perf_counter() - started))
    figures.update(steps=args.steps, warmup_steps=args.warmup, rounds=args.rounds, delay_ms=args.delay_ms,
                   rate_mbit=args.rate_mbit, load_average_1m=[round(load[0], 2), round(load_after[0], 2)])

    params = sum(model_spec_from_config(MODEL).layer_params())
    c = calibration
    body = (
        f"The machine was shared with other sessions (load average {load[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{os.cpu_count()} cores). GPT of `bench/pipeline_vs_torch.py` ({params / 1e6:.2f}M parameters) in 3 stages "
        f"(boundaries {BOUNDS}), batch {args.batch_size} × {DATASET['block_size']} tokens, M={MICRO_BATCHES}, "
        f"Adam, GPipe; R replicas per stage, each a static agent (one process, one torch thread); {args.steps} steps "
        f"per run, {args.warmup} warm-up not timed. Shaped: every agent behind its own shaper link, "
        f"{args.delay_ms:g} ms one way, {args.rate_mbit:g} Mbit/s per direction (each connection shaped on its own). "
        "Agent CPU: "
        "utime + stime of every agent over each measured step, over its samples. Every figure the median of the "
        "measured steps'"
        + ("" if args.rounds == 1 else
           f"; the R values ran interleaved {args.rounds} times (1, 2, 3, 1, 2, ...), each on fresh agents, and each "
           "figure is the median over those rounds; CPU/sample vs R=1 is each round's ratio to its own R=1: "
           "the median (the range over the rounds)")
        + ". Peak RSS: VmHWM of each agent after both of its runs.\n\n"
        "Predicted: `arceus.swarm.model.shared_host_samples_per_second`: the step replayed with every replica a "
        "process sharing the host's cores (processor sharing: n computing at once on c cores each run at "
        "min(1, c/n)), with the cores free during each run's measured steps (the cores less what other processes "
        "and the hypervisor took of them then: the host's busy CPU in /proc/stat, steal included, less the agents' "
        "and this process's), calibrated on the R=1 runs and on this machine only: each stage's "
        f"compute {' / '.join(f'{x * 1000:.1f} ms' for x in c.compute)} CPU per sample (its agent's CPU at R=1 "
        f"less one optimizer step), every replica's optimizer step {c.replica_overhead_s * 1000:.1f} ms (Adam over "
        "a stage's mean size, timed here: each replica runs it in full), the exchange's "
        f"{c.exchange_cpu_per_byte * 1e9:.2f} ns of CPU per byte each replica sends or receives "
        "(`bench/exchange_cost.py`: two replicas' real exchange over TLS on loopback, timed here after the runs "
        "in a process set up as an agent), "
        f"the driver's {c.driver_cpu_s:.3f} s/step and the shaper's {c.shaper_cpu_per_byte * 1e9:.1f} ns per byte "
        "carried taking their share of the cores. Predicted CPU/sample: the compute, every replica's optimizer "
        "step and its exchange's bytes. Shaped links as the shaper makes them: each connection, so each peer a "
        "replica sends to, a link of its own.\n\n"
        + measured_table
        + "\n" + overhead_note(runs, ratios, calibration) + "\n"
        + f"\nAt scale (simulated, `arceus.swarm.churn` over `arceus.swarm.model`): a {SCALE_PARAMS / 1e9:g}B-"
        f"parameter model in {SCALE_STAGES} stages, {SCALE_DEVICES} devices of {SCALE_FLOPS[0] / 1e12:g}-"
        f"{SCALE_FLOPS[1] / 1e12:g} TFLOP/s achieved (log-uniform, seed {args.seed}; 6 × parameters × tokens "
        f"FLOPs per sample), each with a {args.delay_ms:g} ms / {args.rate_mbit:g} Mbit/s uplink (the shaper's "
        f"rule); batch {SCALE_BATCH} × {SCALE_TOKENS} tokens in {SCALE_MICRO} micro-batches, 1F1B; boundary "
        f"activations {SCALE_TOKENS} × {SCALE_D_MODEL} values per sample; the exchange and the boundaries in "
        "fp32 or int8 (1.06 bytes per value). Each device leaves at "
        f"{args.leaves_per_hour:g}/hour (an equal one arrives as a spare) over {args.hours:g} hours. A lost "
        f"replica: its step runs again {args.repair_s:g} s later (measured: `bench/swarm_churn.py`), from its "
        "start (the model's conservative rule); a spare joins by copying the stage's state (weights + Adam, fp32) "
        f"over its link; a stage left empty (always, at R=1) rewinds: {args.repair_s:g} + {args.rewind_s:g} s "
        "(`bench/fault_trials.py`), then every stage loads its checkpoint over its link, and the "
        f"steps since the checkpoint (every ~30 minutes at R=1: {scale[0]['interval']} steps) are replayed. "
        "R=1 is today's one device per stage.\n\n" + scale_table
        + f"\nThe bench took {figures['bench_seconds']} s.\n"
    )
    report(args.section, "Replicated stages: scaling on this machine and at scale (`bench/swarm_scaling.py`"
           + ("" if args.section == "swarm_scaling" else f" {' '.join(sys.argv[1:])}") + ")",
           body, figures, write=not args.no_write)


if __name__ == "__main__":
    main()
