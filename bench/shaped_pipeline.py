"""fp32 GPipe vs 1F1B with int8 activations and gradients, every link shaped to a slow WAN; the int8 1F1B pipeline
also with staleness 1 (PipeDream-2BW) over the same links, and synchronous on unshaped loopback.

    .venv/bin/python bench/shaped_pipeline.py [--stages 2|3] [--steps 8] [--rounds 1]
                                              [--delay-ms 20] [--rate-mbit 100]

The GPT of bench/pipeline_vs_torch.py (same model, text batches, micro-batches, Adam, seed) trains in
2 or 3 stages of static agents (one process and one torch thread each). In the shaped setups every directed link,
driver → stage i and stage i ⇄ stage i±1, goes through its own `devtools.shaper` link: `--delay-ms` one way and
`--rate-mbit` per direction; the loopback setup calls the agents directly. Every setup trains the same batches from
the same weights; rounds alternate them. Reports samples/s (after warm-up), their ratios, the training loss at the
last step (and every step's, synchronous beside staleness 1), and per step: what each stage sent, its compute time
(wall seconds the agent counts), its agent process's CPU seconds (user + system, psutil: compute beside what the gRPC
threads do; on a loaded machine the compute's wall time grows, its CPU time does not) and its wait (step time minus
compute). `--setups` runs some of them (default: all). Writes docs/BENCHMARKS.md and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
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
    "int8_1f1b": Setup("1f1b", INT8),
    "int8_1f1b_stale": Setup("1f1b", INT8, staleness=1),
    "int8_1f1b_loopback": Setup("1f1b", INT8, shaped=False),
}


WHY = (
    "int8 shrinks only the bytes (4 → 1.06 per value, the last column); it does not shorten the one-way "
    "delays on each step's critical path (inputs pushed to stage 0, the pipeline's fill and drain hops, "
    "the last push's ack, the RunStep reply: about five delays, ≈ 0.1 s), and with one CPU thread per "
    "stage compute dominates the step, so the ratio stays near 1 here. 1F1B has the same bubble as GPipe "
    "for equal micro-batches (it saves activation memory, not time). Even with free compute, int8's "
    "ceiling is 3.76× and only where bytes dwarf those delays."
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
    processes: list[psutil.Process], staleness: int = 0,
) -> Run:
    """Train over the shaped links; the driver reaches agent i through driver_links[i]; agent i is processes[i]."""
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
    )


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
                                         args.steps, cpu, setup.staleness))
                print(f"{name} round {r}: {results[name][-1]} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        finally:
            stop_agents(processes)

    def med(name: str, attr: str) -> float:
        return statistics.median(getattr(x, attr) for x in results[name])

    def med_list(name: str, attr: str) -> list[float]:
        return [statistics.median(getattr(x, attr)[i] for x in results[name]) for i in range(n)]

    rates = {name: med(name, "samples_per_s") for name in setups}
    figures: dict[str, Any] = {f"{name}_samples_per_s": round(rate, 3) for name, rate in rates.items()}
    figures |= {f"{name}_loss": round(results[name][0].loss, 4) for name in setups}
    figures |= {f"{name}_cpu_s_per_step": [round(c, 3) for c in med_list(name, "cpu_s_per_step")] for name in setups}
    ratios = {"speedup": ("int8_1f1b", "fp32_gpipe"), "synchronous_of_loopback": ("int8_1f1b", "int8_1f1b_loopback"),
              "stale_of_loopback": ("int8_1f1b_stale", "int8_1f1b_loopback")}
    figures |= {key: round(rates[a] / rates[b], 3) for key, (a, b) in ratios.items() if a in rates and b in rates}
    if {"int8_1f1b", "int8_1f1b_loopback"} <= rates.keys():
        # The synchronous step's floor over the links: loopback's step T plus a delay d each way per hop of the fill
        # and the drain, T + 2(S-1)d.
        t = med("int8_1f1b_loopback", "seconds_per_step")
        bound = rates["int8_1f1b_loopback"] * t / (t + 2 * (n - 1) * args.delay_ms / 1e3)
        figures["synchronous_of_bound"] = round(rates["int8_1f1b"] / bound, 3)
    figures |= {
        "steps": args.steps, "warmup_steps": WARMUP, "rounds": args.rounds, "stages": n,
        "micro_batches": MICRO_BATCHES, "batch_size": DATASET["batch_size"],
        "delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit,
    }
    rows = ""
    for name in setups:
        step_s = med(name, "seconds_per_step")
        compute, cpu = med_list(name, "compute_s_per_step"), med_list(name, "cpu_s_per_step")
        sent = med_list(name, "bytes_sent_per_step")
        rows += (
            f"| {name} | {rates[name]:.2f} | {results[name][0].loss:.4f} | {step_s:.2f} | "
            f"{' / '.join(f'{b / 1e6:.2f}' for b in sent)} | {' / '.join(f'{c:.2f}' for c in compute)} | "
            f"{' / '.join(f'{c:.2f}' for c in cpu)} | "
            f"{' / '.join(f'{step_s - c:.2f}' for c in compute)} | {max(sent) * 8 / (args.rate_mbit * 1e6):.3f} |\n"
        )
    table = (
        "| setup | samples/s | loss at last step | s/step | MB sent/step per stage | compute s/step per stage "
        "| agent CPU s/step per stage | not computing s/step per stage | busiest stage's bytes at the rate, s/step |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows
    )
    if len(setups) < len(SETUPS):  # a partial run: its figures, not a section of docs/BENCHMARKS.md
        print(table)
        print(json.dumps(figures))
        return
    table += (
        f"\nint8 1F1B / fp32 GPipe: **{figures['speedup']}×** samples/s. Of int8 1F1B on loopback: synchronous "
        + f"**{figures['synchronous_of_loopback']}×**, staleness 1 **{figures['stale_of_loopback']}×**. Synchronous "
        + f"of its bound T/(T+2(S-1)d) (T: loopback's s/step): **{figures['synchronous_of_bound']}×**.\n"
        + "\nTraining loss per step (round 0), int8 1F1B synchronous / staleness 1: "
        + ", ".join(f"{a:.4f} / {b:.4f}" for a, b in zip(results["int8_1f1b"][0].losses,
                                                          results["int8_1f1b_stale"][0].losses, strict=True))
        + ".\n\n" + WHY + "\n\n" + STALE + "\n"
    )
    params = sum(model_spec_from_config(MODEL).layer_params())
    shaped_as_asked = (args.delay_ms, args.rate_mbit) == (20.0, 100.0)
    name = f"shaped_pipeline_{n}_stages" + ("" if shaped_as_asked else f"_{args.delay_ms:g}ms_{args.rate_mbit:g}mbit")
    write_section(name, (
        f"## fp32 GPipe vs int8 1F1B over shaped links, {n} stages (`bench/shaped_pipeline.py --stages {n}"
        f"{'' if shaped_as_asked else f' --delay-ms {args.delay_ms:g} --rate-mbit {args.rate_mbit:g}'}"
        f" --steps {args.steps} --rounds {args.rounds}`)\n\n"
        f"{machine_line()}. In the shaped setups every link (driver → stage, stage ⇄ neighbour) through a userspace "
        "shaper: "
        f"{args.delay_ms:g} ms one way and {args.rate_mbit:g} Mbit/s per direction. GPT of "
        f"`bench/pipeline_vs_torch.py` ({params / 1e6:.2f}M parameters), batch {DATASET['batch_size']} × "
        f"{DATASET['block_size']} tokens, M={MICRO_BATCHES}, Adam, layer boundaries {bounds}, one torch thread "
        f"per agent process; {args.steps} steps per run ({WARMUP} warm-up not timed), {args.rounds} round(s). "
        "Losses are the training loss of the last step; every setup trains the same batches from the same "
        "weights. `int8_1f1b_loopback`: the same pipeline with the agents called directly on loopback; "
        "`int8_1f1b_stale`: over the shaped links with `staleness: 1`.\n\n" + table
    ))
    print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
