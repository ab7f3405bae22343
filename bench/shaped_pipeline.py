"""fp32 vs int8 activations and gradients, GPipe vs 1F1B, every link shaped to a slow WAN; the int8 1F1B pipeline
also with staleness 1 (PipeDream-2BW) over the same links, and both int8 schedules synchronous on unshaped loopback.

    .venv/bin/python bench/shaped_pipeline.py [--stages 2|3] [--steps 8] [--rounds 1]
                                              [--delay-ms 20] [--rate-mbit 100]

The GPT of bench/pipeline_vs_torch.py (same model, text batches, micro-batches, Adam, seed) trains in
2 or 3 stages of static agents (one process and one torch thread each). In the shaped setups every directed link,
driver → stage i and stage i ⇄ stage i±1, goes through its own `devtools.shaper` link: `--delay-ms` one way and
`--rate-mbit` per direction; the loopback setup calls the agents directly. Every setup trains the same batches from
the same weights; rounds alternate them. Reports samples/s (after warm-up) per round and their medians, their ratios
(each synchronous schedule over the shaped links against the same schedule on loopback in the same run, and against
the bound a flush allows, T / (T + 2(S-1)d), T loopback's step), what the pure step model (arceus/swarm/model.py)
predicts over the links from loopback's step, how late the shaper delivered its chunks against its timing rule, the
training loss at the last step (and every step's, synchronous beside staleness 1), and per step: what each stage
sent, its compute time
(wall seconds the agent counts), its agent process's CPU seconds (user + system, psutil: compute beside what the gRPC
threads do; on a loaded machine the compute's wall time grows, its CPU time does not) and its wait (step time minus
compute). `--setups` runs some of them (default: all). Writes docs/BENCHMARKS.md and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.swarm.model import Link, Replica, Workload, step_time  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.pipeline_vs_torch import DATASET, LR, MICRO_BATCHES, MODEL, SEED, SPLIT, WARMUP, step_rate  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.launch import AgentProcess, free_ports, spawn_static_agents, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, identity_for, pipeline_assignments  # noqa: E402
from devtools.shaper import ShaperThread, add_link_arguments, link_shape  # noqa: E402


@dataclass(frozen=True)
class Setup:
    schedule: str
    transfer: dict[str, Any] | None
    shaped: bool = True  # every link through the shaper; else the agents on loopback
    staleness: int = 0


INT8 = {"activations": "int8", "gradients": "int8"}
SETUPS: dict[str, Setup] = {
    "fp32_gpipe": Setup("gpipe", None),
    "int8_gpipe": Setup("gpipe", INT8),
    "int8_1f1b": Setup("1f1b", INT8),
    "int8_1f1b_stale": Setup("1f1b", INT8, staleness=1),
    "int8_gpipe_loopback": Setup("gpipe", INT8, shaped=False),
    "int8_1f1b_loopback": Setup("1f1b", INT8, shaped=False),
}


WHY = (
    "int8 shrinks only the bytes (4 → 1.06 per value): a micro-batch's activation crosses a 100 Mbit/s link in "
    "≈ 11 ms instead of ≈ 42 ms. The schedule decides how many one-way delays a synchronous step waits for. GPipe "
    "sends all of stage 0's forwards at once: one fill and one drain, 2(S-1) delays a step, the bound's. 1F1B lets "
    "stage i hold at most S - i micro-batches: with M = 4 over S = 3 stages stage 0 may run its fourth forward only "
    "after its first backward, which waits for micro-batch 0's whole round trip through the pipeline (4 delays); "
    "micro-batch 3's own round trip follows it, so 8 delays lie on the step's path. On loopback the two schedules "
    "cost the same (1F1B saves activation memory, not time); over links whose round trip exceeds a micro-batch's "
    "compute, GPipe is the synchronous schedule to use. The model step is arceus/swarm/model.py's replay of the "
    "step over the links (each stage's compute set so that its step on free links is loopback's measured one, the "
    "boundary bytes as stage 0 sent them): it counts the delays, the rate and the schedule, nothing of the agents."
)
STALE = (
    "Staleness 1 (`\"staleness\": 1`, PipeDream-2BW) lets each stage start the next step's forwards once this "
    "step's are done there, with the weights before this step's update (each micro-batch's backward uses the "
    "weights its forward used), so the drain of one step overlaps the fill of the next and the delays on the "
    "flush's path are no longer paid every step. It trains differently from one process: the losses are the "
    "training loss at each step, of the same batches from the same weights (step 1 uses the same weights either "
    "way)."
)


class StepLog(Clock):
    """Clock (step end times) that also keeps each step's loss, the stages' cumulative counters and their agent
    processes' CPU seconds so far."""

    def __init__(self, agents: list[psutil.Process]) -> None:
        super().__init__()
        self.steps: list[StepProgress] = []
        self.cpu: list[list[float]] = []
        self._agents = agents

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.steps.append(p)
        self.cpu.append([sum(a.cpu_times()[:2]) for a in self._agents])


@dataclass
class Run:
    samples_per_s: float
    loss: float
    losses: list[float]  # every step's
    seconds_per_step: float
    bytes_sent_per_step: list[float]  # per stage, measured steps only
    compute_s_per_step: list[float]
    cpu_s_per_step: list[float]  # per stage, its agent process's user + system CPU
    # How late the shaper wrote each chunk of the run against its timing rule (none: loopback); not in the repr printed
    # after each run.
    late_s: list[float] = field(repr=False)


def boundaries(stages: int) -> list[int]:
    end = model_spec_from_config(MODEL).num_layers
    # 3 stages: embedding + 2 blocks | 2 blocks | 2 blocks + head
    return [0, SPLIT, end] if stages == 2 else [0, 3, 5, end]


def shaped_assignments(
    job_id: str, bounds: list[int], agents: list[str], links: dict[tuple[int, int], str] | None, setup: Setup
) -> list[dict[str, Any]]:
    """The stages' assignments with each neighbour address replaced by that directed link's shaper (None: the
    agents' own addresses, on loopback)."""
    stages = pipeline_assignments(
        job_id=job_id, model_config=MODEL, boundaries=bounds, addresses=agents,
        optimizer={"name": "adam", "lr": LR}, seed=SEED, micro_batches=MICRO_BATCHES,
        max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES), transfer=setup.transfer,
        staleness=setup.staleness,
    )
    if links is None:
        return stages
    for i, stage in enumerate(stages):
        stage["prev_address"] = links.get((i, i - 1))
        stage["next_address"] = links.get((i, i + 1))
        # The shaper passes TLS through: behind each link is the neighbour's agent, with its certificate.
        stage["certificates"] = {
            links[(i, j)]: identity_for(agents[j]).certificate for j in (i - 1, i + 1) if (i, j) in links
        }
    return stages


def run(
    job_id: str, schedule: str, bounds: list[int], agents: list[str], driver_links: list[str], steps: int,
    processes: list[psutil.Process], shaper: ShaperThread, staleness: int = 0,
) -> Run:
    """Train over the shaped links; the driver reaches agent i through driver_links[i]; agent i is processes[i]."""
    shaper.take_lateness()  # the links' chunks of runs before
    plan = TrainPlan(
        job_id=job_id, generation=1, credential=driver_token(job_id, 1),
        stages=tuple(
            StageEndpoint(i, driver_links[i], f"agent-{i}", bounds[i], bounds[i + 1],
                          certificate=identity_for(agents[i]).certificate)
            for i in range(len(driver_links))
        ),
        dataset=DATASET, epochs=1, learning_rate=LR, micro_batches=MICRO_BATCHES, seed=SEED, max_steps=steps,
        schedule=schedule, rpc_timeout_seconds=120.0, staleness=staleness,
    )
    log = StepLog(processes)
    train(plan, log)
    late = shaper.take_lateness()
    # Counters are cumulative: the difference from the last warm-up step covers the measured steps.
    pairs = list(zip(log.steps[WARMUP - 1].stages, log.steps[-1].stages, strict=True))
    measured = len(log.steps) - WARMUP
    return Run(
        samples_per_s=step_rate(log.times),
        loss=log.steps[-1].loss,
        losses=[p.loss for p in log.steps],
        seconds_per_step=(log.times[-1] - log.times[WARMUP - 1]) / measured,
        bytes_sent_per_step=[(b.bytes_sent - a.bytes_sent) / measured for a, b in pairs],
        compute_s_per_step=[(b.compute_seconds - a.compute_seconds) / measured for a, b in pairs],
        cpu_s_per_step=[(b - a) / measured for a, b in zip(log.cpu[WARMUP - 1], log.cpu[-1], strict=True)],
        late_s=late,
    )


def model_step(schedule: str, stages: int, boundary_bytes: float, t: float, delay_s: float, rate_bps: float) -> float:
    """arceus/swarm/model.py's step over links of `delay_s` and `rate_bps` (each direction of each pair its own, as
    the shaper's), with equal stages whose compute makes the step on free links (no delay, no rate) last `t`:
    `boundary_bytes` per sample each way between neighbours (the measured, as sent)."""

    def step(seconds_per_sample: float, link: Link) -> float:
        workload = Workload(MICRO_BATCHES, DATASET["batch_size"], (boundary_bytes,) * (stages - 1), (0.0,) * stages,
                            schedule=schedule)
        return step_time([[Replica(seconds_per_sample, link)] for _ in range(stages)], workload).seconds

    free = step(1.0, Link(0.0, math.inf, per_peer=True))  # linear in the compute
    return step(t / free, Link(delay_s, rate_bps, per_peer=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, choices=[2, 3], default=2)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each setup, alternating")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"comma-separated, of {', '.join(SETUPS)} (default: all)")
    add_link_arguments(parser)
    args = parser.parse_args()
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    setups = args.setups.split(",")
    if unknown := sorted(set(setups) - set(SETUPS)):
        parser.error(f"--setups: unknown {', '.join(unknown)}; choose from {', '.join(SETUPS)}")

    n, bounds = args.stages, boundaries(args.stages)
    jobs = [(name, r) for r in range(args.rounds) for name in setups]
    results: dict[str, list[Run]] = {name: [] for name in setups}
    shape = link_shape(args)
    with tempfile.TemporaryDirectory() as workdir, ShaperThread() as shaper:
        # Two sets of agents: the shaped setups' advertise their peer-stream listeners through the shaper, so the
        # neighbour streams between stages cross shaped links too; the loopback setup's are dialled directly.
        sets: dict[bool, tuple[list[str], list[str], list[psutil.Process]]] = {}  # addresses, driver's links, CPU
        processes: list[AgentProcess] = []
        try:
            for shaped in sorted({SETUPS[name].shaped for name in setups}):
                ports = free_ports(2 * n)
                agents, streams = [f"127.0.0.1:{p}" for p in ports[:n]], [f"127.0.0.1:{p}" for p in ports[n:]]
                links = {(i, j): shaper.address(agents[j], **shape) for i in range(n) for j in (i - 1, i + 1)
                         if 0 <= j < n} if shaped else None
                per_job = [shaped_assignments(f"shaped-{name}-{r}", bounds, agents, links, SETUPS[name])
                           for name, r in jobs if SETUPS[name].shaped == shaped]
                advertised = [["--exchange-port", listener.rsplit(":", 1)[1], "--advertise-exchange",
                               shaper.address(listener, **shape)] for listener in streams] if shaped else ()
                started = spawn_static_agents([[a[i] for a in per_job] for i in range(n)], agents,
                                              Path(workdir) / ("shaped" if shaped else "loopback"),
                                              extra_args=advertised)
                processes += started
                sets[shaped] = (agents, [shaper.address(a, **shape) for a in agents] if shaped else agents,
                                [psutil.Process(p.process.pid) for p in started])
            for name, r in jobs:
                start = time.perf_counter()
                setup = SETUPS[name]
                agents, driver_links, cpu = sets[setup.shaped]
                results[name].append(run(f"shaped-{name}-{r}", setup.schedule, bounds, agents, driver_links,
                                         args.steps, cpu, shaper, setup.staleness))
                print(f"{name} round {r}: {results[name][-1]} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        finally:
            stop_agents(processes)

    def med(name: str, attr: str) -> float:
        return statistics.median(getattr(x, attr) for x in results[name])

    def med_list(name: str, attr: str) -> list[float]:
        return [statistics.median(getattr(x, attr)[i] for x in results[name]) for i in range(n)]

    rates = {name: med(name, "samples_per_s") for name in setups}
    batch, d = DATASET["batch_size"], args.delay_ms / 1e3
    figures: dict[str, Any] = {f"{name}_samples_per_s": round(rate, 3) for name, rate in rates.items()}
    figures |= {f"{name}_per_round": [round(x.samples_per_s, 3) for x in results[name]] for name in setups}
    figures |= {f"{name}_loss": round(results[name][0].loss, 4) for name in setups}
    figures |= {f"{name}_cpu_s_per_step": [round(c, 3) for c in med_list(name, "cpu_s_per_step")] for name in setups}
    ratios = {"int8_of_fp32": ("int8_gpipe", "fp32_gpipe"),
              "stale_of_loopback": ("int8_1f1b_stale", "int8_1f1b_loopback")}
    figures |= {key: round(rates[a] / rates[b], 3) for key, (a, b) in ratios.items() if a in rates and b in rates}
    verdicts, predictions = [], ""
    for schedule in ("gpipe", "1f1b"):
        shaped, loopback = f"int8_{schedule}", f"int8_{schedule}_loopback"
        if not {shaped, loopback} <= rates.keys():
            continue
        # The synchronous step's floor over the links: loopback's step T plus a delay d each way per hop of the fill
        # and the drain, T + 2(S-1)d; each round's shaped run against that round's loopback one too.
        def bound(samples_per_s: float, step_s: float) -> float:
            return samples_per_s * step_s / (step_s + 2 * (n - 1) * d)

        t = med(loopback, "seconds_per_step")
        figures[f"{schedule}_synchronous_of_loopback"] = round(rates[shaped] / rates[loopback], 3)
        figures[f"{schedule}_synchronous_of_bound"] = round(rates[shaped] / bound(rates[loopback], t), 3)
        figures[f"{schedule}_synchronous_of_bound_per_round"] = [
            round(a.samples_per_s / bound(b.samples_per_s, b.seconds_per_step), 3)
            for a, b in zip(results[shaped], results[loopback], strict=True)
        ]
        boundary = med_list(loopback, "bytes_sent_per_step")[0] / batch  # stage 0 sends only activations
        modelled = model_step(schedule, n, boundary, t, d, args.rate_mbit * 1e6)
        figures[f"{schedule}_model_s_per_step"] = round(modelled, 3)
        predictions += (f"{schedule}: loopback {t:.3f} s a step, over the links measured "
                        f"{med(shaped, 'seconds_per_step'):.3f}, model {modelled:.3f}, "
                        f"bound {t + 2 * (n - 1) * d:.3f}; ")
        verdicts.append(f"{schedule} synchronous of loopback **{figures[f'{schedule}_synchronous_of_loopback']}×**, of "
                        f"its bound **{figures[f'{schedule}_synchronous_of_bound']}×** (per round "
                        f"{', '.join(map(str, figures[f'{schedule}_synchronous_of_bound_per_round']))})")
    late = {name: sorted(v for x in results[name] for v in x.late_s) for name in setups if SETUPS[name].shaped}

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else math.nan

    figures |= {f"{name}_shaper_late_ms_p50_p99": [round(pct(v, 0.5), 2), round(pct(v, 0.99), 2)]
                for name, v in late.items()}
    figures |= {
        "steps": args.steps, "warmup_steps": WARMUP, "rounds": args.rounds, "stages": n,
        "micro_batches": MICRO_BATCHES, "batch_size": batch, "delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit,
    }
    rows = ""
    for name in setups:
        step_s = med(name, "seconds_per_step")
        compute, cpu = med_list(name, "compute_s_per_step"), med_list(name, "cpu_s_per_step")
        sent = med_list(name, "bytes_sent_per_step")
        shaper_late = f"{pct(late[name], 0.5):.2f} / {pct(late[name], 0.99):.2f}" if name in late else "-"
        rows += (
            f"| {name} | {rates[name]:.2f} | {', '.join(f'{x.samples_per_s:.2f}' for x in results[name])} | "
            f"{results[name][0].loss:.4f} | {step_s:.3f} | "
            f"{' / '.join(f'{b / 1e6:.2f}' for b in sent)} | {' / '.join(f'{c:.2f}' for c in compute)} | "
            f"{' / '.join(f'{c:.2f}' for c in cpu)} | "
            f"{' / '.join(f'{step_s - c:.2f}' for c in compute)} | {shaper_late} |\n"
        )
    table = (
        "| setup | samples/s (median) | per round | loss at last step | s/step | MB sent/step per stage "
        "| compute s/step per stage | agent CPU s/step per stage | not computing s/step per stage "
        "| shaper's lateness p50 / p99, ms |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows
    )
    if len(setups) < len(SETUPS):  # a partial run: its figures, not a section of docs/BENCHMARKS.md
        print(table)
        print(predictions)
        print(json.dumps(figures))
        return
    table += (
        f"\nint8 / fp32 (GPipe): **{figures['int8_of_fp32']}×** samples/s. Over the shaped links, in this run: "
        + "; ".join(verdicts) + f"; staleness 1 (1F1B) of loopback 1F1B **{figures['stale_of_loopback']}×**.\n"
        + f"\nStep seconds (medians; model: arceus/swarm/model.py from loopback's step): {predictions.rstrip('; ')}.\n"
        + "\nTraining loss per step (round 0), int8 1F1B synchronous / staleness 1: "
        + ", ".join(f"{a:.4f} / {b:.4f}" for a, b in zip(results["int8_1f1b"][0].losses,
                                                          results["int8_1f1b_stale"][0].losses, strict=True))
        + f"; at the last step GPipe synchronous {results['int8_gpipe'][0].loss:.4f}.\n\n" + WHY + "\n\n" + STALE + "\n"
    )
    params = sum(model_spec_from_config(MODEL).layer_params())
    shaped_as_asked = (args.delay_ms, args.rate_mbit) == (20.0, 100.0)
    name = f"shaped_pipeline_{n}_stages" + ("" if shaped_as_asked else f"_{args.delay_ms:g}ms_{args.rate_mbit:g}mbit")
    write_section(name, (
        f"## fp32 vs int8, GPipe vs 1F1B over shaped links, {n} stages (`bench/shaped_pipeline.py --stages {n}"
        f"{'' if shaped_as_asked else f' --delay-ms {args.delay_ms:g} --rate-mbit {args.rate_mbit:g}'}"
        f" --steps {args.steps} --rounds {args.rounds}`)\n\n"
        f"{machine_line()}. In the shaped setups every link (driver → stage, stage ⇄ neighbour) through a userspace "
        "shaper: "
        f"{args.delay_ms:g} ms one way and {args.rate_mbit:g} Mbit/s per direction. GPT of "
        f"`bench/pipeline_vs_torch.py` ({params / 1e6:.2f}M parameters), batch {batch} × "
        f"{DATASET['block_size']} tokens, M={MICRO_BATCHES}, Adam, layer boundaries {bounds}, one torch thread "
        f"per agent process; {args.steps} steps per run ({WARMUP} warm-up not timed), {args.rounds} round(s), the "
        "setups alternating in each. Losses are the training loss of the last step; every setup trains the same "
        "batches from the same weights. `*_loopback`: the same pipeline with the agents (three of their own) "
        "called directly on loopback; `int8_1f1b_stale`: over the shaped links with `staleness: 1`.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
