"""GPU readiness: the bench GPT of bench/pipeline_vs_torch.py trained as a 3-stage pipeline job on 3 static agents
started with `--device DEVICE`, in fp32 and in bf16, beside the same model trained in one process on the same
device on the same global batches.

    python bench/gpu_check.py [--device cuda] [--steps 12] [--no-write]

Per precision: both runs' losses and their largest relative difference against the precision's tolerance
(parity), samples/s of each (after WARMUP untimed steps), and every process's peak device memory (an agent's own
`arceus_device_memory_peak_bytes`: the most CUDA tensor memory it allocated, or its VmHWM on CPU) and peak RSS
(VmHWM). Each precision gets fresh agents, so their peaks are that precision's. The one process trains the whole
batch at once (no micro-batches), one torch thread, like each agent. Prints a table, writes the
`gpu_check_DEVICE` section of docs/BENCHMARKS.md (unless --no-write) and ends with one JSON line; exits 1 when a
precision's losses differ by more than its tolerance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeagent.openmp import cap_openmp_spin  # noqa: E402

# Before torch loads libgomp, here and (inherited) in every process this starts, as `python -m nodeagent` does.
cap_openmp_spin()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from arceus.contracts.assignment import max_micro_batch_size  # noqa: E402
from arceus.data.batches import epoch_batches  # noqa: E402
from arceus.data.loader import load_dataset  # noqa: E402
from arceus.model.autocast import autocast  # noqa: E402
from arceus.model.build import build_full_model  # noqa: E402
from arceus.model.optimizers import make_optimizer  # noqa: E402
from arceus.model.registry import model_spec_from_config  # noqa: E402
from arceus.training.driver import train  # noqa: E402
from arceus.training.plan import StageEndpoint, StepProgress, TrainPlan  # noqa: E402
from bench.clock import Clock  # noqa: E402
from bench.pipeline_vs_torch import DATASET, LR, MICRO_BATCHES, MODEL, SEED, WARMUP, gpt_loss, step_rate  # noqa: E402
from bench.report import report  # noqa: E402
from devtools.launch import AgentProcess, spawn_static_agents_on_free_ports, stop_agents  # noqa: E402
from devtools.pipeline import driver_token, pipeline_assignments  # noqa: E402
from devtools.supervisor import peak_rss  # noqa: E402
from nodeagent.device import (  # noqa: E402
    DeviceError,
    device_memory_peak_bytes,
    device_name,
    memory_peak_bytes,
    select_device,
    synchronize,
)
from nodeagent.heap import retain_freed_blocks  # noqa: E402

BOUNDARIES = (0, 3, 6, 8)  # embedding + 2 blocks | 3 blocks | 1 block + head
SCHEDULE = "1f1b"
# The largest relative difference between the pipeline's loss and the one process's at any step.
TOLERANCE = {
    # fp32 with TF32 off (the one process turns it off; the agents keep torch's default, off for matmuls): the
    # runs differ only in summation order (micro-batches of 4 against the whole batch of 16, one GPU kernel choice
    # against another), a few float32 roundings.
    "fp32": 1e-5,
    # bf16 autocast rounds every matmul's output to 8 bits of mantissa (2**-8 = 3.9e-3 relative), and the two runs'
    # different summation orders round differently; the loss, a mean over 2048 positions, averages most of that
    # out, but Adam's normalised steps carry the differences into the weights: on CPU this model's runs differed by
    # at most 3.3e-4 in 12 steps (1.5e-5 in 4). 2e-3 leaves room for other kernels and stays far under what one
    # skipped optimizer step or a wrong gradient moves the loss by (2e-2 to 2e-1 a step here).
    "bf16": 2e-3,
}
MIB = 2**20


def global_batches(steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The driver's first `steps` batches (epoch 1's order), on `device`."""
    x, y, _, _ = load_dataset(DATASET)
    return [(x[i].to(device), y[i].to(device)) for i in epoch_batches(len(x), DATASET["batch_size"], SEED, 1)[:steps]]


def _one_process(device_type: str, precision: str, steps: int, out: Any) -> None:
    """(A spawned child.) Train the whole model on `device_type` in `precision`; put its figures on `out`."""
    retain_freed_blocks()  # as an agent does
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(device_type)
    model = build_full_model(model_spec_from_config(MODEL), SEED).to(device)
    optimizer = make_optimizer(model.parameters(), "adam", LR)  # as the agents' stages
    losses, times = [], []
    for x, y in global_batches(steps, device):
        with autocast(device, precision):
            loss = gpt_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        synchronize(device)
        times.append(time.perf_counter())
    out.put(
        {
            "device_name": device_name(device),
            "losses": losses,
            "samples_per_s": step_rate(times),
            "device_peak_bytes": device_memory_peak_bytes(device),
            "peak_rss_bytes": memory_peak_bytes(),
        }
    )


def one_process(device: str, precision: str, steps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA cannot be forked into; and its memory peak is the child's alone
    out = ctx.SimpleQueue()
    worker = ctx.Process(target=_one_process, args=(device, precision, steps, out))
    worker.start()
    worker.join()
    if worker.exitcode:
        raise RuntimeError(f"the one-process {precision} run exited with {worker.exitcode}")
    return out.get()


class LossClock(Clock):
    """Each step's end time and loss."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_step(self, p: StepProgress) -> None:
        super().on_step(p)
        self.losses.append(p.loss)


def scraped(agent: AgentProcess, name: str) -> float:
    """The value of the unlabelled metric `name` on the agent's /metrics."""
    url = f"http://{agent.metrics_address}/metrics?token={agent.metrics_token}"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.split(" ", 1)[0] == name:
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"agent {agent.grpc_address} exports no {name}")


def pipeline(device: str, precision: str, steps: int, workdir: Path) -> dict[str, Any]:
    """Train on 3 fresh agents; their figures, read before they stop."""
    job_id = f"gpu-check-{precision}"

    def assignments_for(addresses: list[str]) -> list[list[dict[str, Any]]]:
        flat = pipeline_assignments(
            job_id=job_id,
            model_config=MODEL,
            boundaries=BOUNDARIES,
            addresses=addresses,
            optimizer={"name": "adam", "lr": LR},
            seed=SEED,
            micro_batches=MICRO_BATCHES,
            max_micro_batch_size=max_micro_batch_size(DATASET, MICRO_BATCHES),
            precision=precision,
        )
        return [[assignment] for assignment in flat]

    agents, addresses = spawn_static_agents_on_free_ports(
        len(BOUNDARIES) - 1, assignments_for, workdir / precision, threads=1, device=device, ready_timeout=180.0
    )
    try:
        plan = TrainPlan(
            job_id=job_id,
            generation=1,
            credential=driver_token(job_id, 1),
            stages=tuple(
                StageEndpoint(
                    i, addresses[i], f"agent-{i}", BOUNDARIES[i], BOUNDARIES[i + 1], certificate=agents[i].certificate
                )
                for i in range(len(agents))
            ),
            dataset=DATASET,
            epochs=1,
            learning_rate=LR,
            micro_batches=MICRO_BATCHES,
            seed=SEED,
            max_steps=steps,
            schedule=SCHEDULE,
            precision=precision,
        )
        clock = LossClock()
        train(plan, clock)
        return {
            "losses": clock.losses,
            "samples_per_s": step_rate(clock.times),
            "agents": [
                {
                    "device_peak_bytes": int(scraped(a, "arceus_device_memory_peak_bytes")),
                    "peak_rss_bytes": peak_rss(a.process.pid),
                }
                for a in agents
            ],
        }
    finally:
        stop_agents(agents)


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        raise RuntimeError(f"the pipeline ran {len(losses)} steps, the one process {len(reference)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def _mib(value: int) -> str:
    return f"{value / MIB:.0f}"


def table(precision: str, piped: dict[str, Any], single: dict[str, Any]) -> str:
    def losses(values: list[float]) -> str:
        return ", ".join(f"{v:.6f}" for v in values)

    rows = [
        f"| one process | {single['samples_per_s']:.1f} | {_mib(single['device_peak_bytes'])} | "
        f"{_mib(single['peak_rss_bytes'])} | {losses(single['losses'])} |"
    ]
    rows += [
        f"| agent {i} (layers {BOUNDARIES[i]}-{BOUNDARIES[i + 1] - 1}) | "
        f"{piped['samples_per_s']:.1f} (pipeline) | {_mib(a['device_peak_bytes'])} | "
        f"{_mib(a['peak_rss_bytes'])} | {losses(piped['losses']) if i == len(piped['agents']) - 1 else ''} |"
        for i, a in enumerate(piped["agents"])
    ]
    return (
        f"**{precision}**: largest relative loss difference **{piped['max_rel_diff']:.2e}** "
        f"(tolerance {TOLERANCE[precision]:.0e}): **{'parity' if piped['parity'] else 'PARITY FAILED'}**\n\n"
        "| process | samples/s | peak device memory (MiB) | peak RSS (MiB) | losses per step |\n"
        "| --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/BENCHMARKS.md")
    args = parser.parse_args()
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must exceed the {WARMUP} untimed warm-up steps by at least 2")
    try:
        select_device(args.device)
    except DeviceError as exc:
        parser.error(str(exc))

    started = time.perf_counter()
    results: dict[str, Any] = {}
    singles: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for precision in TOLERANCE:
            singles[precision] = one_process(args.device, precision, args.steps)
            piped = pipeline(args.device, precision, args.steps, Path(workdir))
            piped["max_rel_diff"] = max_relative_difference(piped["losses"], singles[precision]["losses"])
            piped["parity"] = piped["max_rel_diff"] <= TOLERANCE[precision]
            results[precision] = piped
    name = singles["fp32"]["device_name"]
    body = (
        f"`python bench/gpu_check.py --device {args.device} --steps {args.steps}` on {name}: GPT d_model 256, "
        f"6 blocks, 8 heads, block 128, batch {DATASET['batch_size']}, Adam; 3 agents (`--device {args.device}`, "
        f"1 torch thread) with stages split at layers {list(BOUNDARIES)}, M={MICRO_BATCHES}, {SCHEDULE}, against "
        f"one process (1 torch thread, whole batches); {args.steps} steps, samples/s after {WARMUP} untimed. "
        f"Peak device memory: CUDA tensor memory allocated (the agents' `arceus_device_memory_peak_bytes`), "
        f"VmHWM on CPU.\n\n" + "\n".join(table(p, results[p], singles[p]) for p in TOLERANCE)
    )
    figures = {
        "device": args.device,
        "device_name": name,
        "steps": args.steps,
        "parity": all(results[p]["parity"] for p in TOLERANCE),
        "seconds": round(time.perf_counter() - started, 1),
        **{
            p: {
                "parity": results[p]["parity"],
                "max_rel_diff": results[p]["max_rel_diff"],
                "tolerance": TOLERANCE[p],
                "pipeline_samples_per_s": round(results[p]["samples_per_s"], 2),
                "single_samples_per_s": round(singles[p]["samples_per_s"], 2),
                "agents_device_peak_mib": [round(a["device_peak_bytes"] / MIB, 1) for a in results[p]["agents"]],
                "agents_peak_rss_mib": [round(a["peak_rss_bytes"] / MIB, 1) for a in results[p]["agents"]],
                "single_device_peak_mib": round(singles[p]["device_peak_bytes"] / MIB, 1),
                "single_peak_rss_mib": round(singles[p]["peak_rss_bytes"] / MIB, 1),
                "pipeline_losses": results[p]["losses"],
                "single_losses": singles[p]["losses"],
            }
            for p in TOLERANCE
        },
    }
    report(
        f"gpu_check_{args.device}",
        f"GPU readiness on {args.device}: a 3-stage pipeline job against one process (`bench/gpu_check.py`)",
        body,
        figures,
        write=not args.no_write,
    )
    if not figures["parity"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
