"""A GPT of 300M parameters (or `--params`, such as 1e9) trained over REST on four agents whose owners cap their
memory below what one process needs, side by side with the same model trained in one process.

    .venv/bin/python bench/large_model.py [--n-layer 24] [--d-model 1024] [--steps 8]
    .venv/bin/python bench/large_model.py --params 1e9 --optimizer adam8bit --steps 4
    .venv/bin/python bench/large_model.py --params 3e8 --steps 4 --staleness 1 --agent-share 0.45 --baseline F

`--params N` picks a GPT of about N parameters (`gpt_shape`: d_model 1024 below 600M, else 2048; as many layers
as make N), `--optimizer` the job's optimizer (adam, adam8bit, sgd), `--activation-checkpointing` makes every
stage recompute its activations, `--precision bf16` computes under bfloat16 autocast, `--staleness 1` trains
PipeDream-2BW (each stage keeps a second version of its weights and overlaps two steps), `--agent-share` sets the
owners' caps (what staleness 1's stages need does not fit 0.35x), `--baseline FILE` keeps the one process's result
in FILE and reuses it in a later run of the same model (staleness aside: the one process has none).

1. One process (a child of this script, 2 torch threads, run first and alone) trains the whole model for
   `--steps` steps on the same windows in the same order, exactly as the stages do: the same optimizer, the same
   micro-batches (gradients accumulated), the same activation checkpointing (each layer recomputed) and
   precision, and the same malloc settings as an agent (`nodeagent.heap.retain_freed_blocks`): its peak RSS
   (VmHWM) and seconds per step.
2. A whole deployment on this machine (gunicorn, Celery workers and beat, by DATABASE_URL / REDIS_URL or
   SQLite and an embedded redis-server) with five agents of one torch thread each (two while a stage computes
   alone: `--solo-threads 2`), declared equally fast (their measured speeds differ on a shared machine), each
   capped by its owner's `max_memory_bytes` at `--agent-share` (0.35) x the one-process peak. The default
   5M-parameter GPT trains first; then the large one, four stages, a checkpoint every `--steps // 2` steps. After
   the first checkpoint the agent of stage 1 is killed (SIGKILL) and the spare takes its stage over from it.
Measured: every agent's VmHWM (the killed one's read just before the kill) and their sum; the placement
solver's memory estimate per stage; the control plane's processes' VmHWM (web: gunicorn and its workers;
each Celery worker with its pool, the training worker's pool running the driver; beat) after the 5M job
and after the large one; checkpoint save seconds (the agents' `arceus_state_save_seconds`: state written
and uploaded) and load seconds (the spare's `arceus_stage_build_seconds{source="checkpoint"}`: downloaded
and loaded) with the bytes; and seconds per step, the median of the intervals between steps that include
no checkpoint, no first step and no recovery. Prints a table, writes docs/BENCHMARKS.md, and ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arceus.data.batches import epoch_batches  # noqa: E402
from arceus.data.config import validate_dataset_config  # noqa: E402
from arceus.data.loader import load_dataset  # noqa: E402
from arceus.data.text_config import BUNDLED_TEXT  # noqa: E402
from arceus.model.autocast import autocast  # noqa: E402
from arceus.model.build import build_full_model  # noqa: E402
from arceus.model.expected_state import optimizer_kind  # noqa: E402
from arceus.model.optimizers import make_optimizer  # noqa: E402
from arceus.model.registry import fit_model_to_dataset, model_spec_from_config  # noqa: E402
from arceus.placement.profiles import layer_profiles  # noqa: E402
from arceus.placement.solver import Workload, stage_memory  # noqa: E402
from bench.report import machine_line, write_section  # noqa: E402
from devtools.cluster import Agent, LocalCluster  # noqa: E402
from devtools.supervisor import peak_rss  # noqa: E402
from nodeagent.heap import retain_freed_blocks  # noqa: E402

# Twice as many micro-batches as stages (one sample each): no stage holds more than 4 samples' activations.
# Four of two cost less CPU but more memory than the goal allows (docs/BENCHMARKS.md, "Where the pipeline's
# step time goes").
BATCH, MICRO_BATCHES, BLOCK, STAGES = 8, 8, 128, 4
AGENT_SHARE = 0.35  # each owner's max_memory_bytes, as a fraction of the one-process peak
CONTROL_PLANE = ("web", "worker-control", "worker-training", "beat")
MIB = 2**20


def text_source(directory: Path, steps: int) -> Path:
    """The bundled text cut so that one epoch is `steps` batches of BATCH windows (90% trains)."""
    chars = int((steps * BATCH * BLOCK + 2) / 0.9) + 1
    path = directory / "text.txt"
    path.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return path


def gpt_shape(params: float) -> tuple[int, int]:
    """(n_layer, d_model) of a GPT of about `params` parameters: a block holds 12 d_model² of them (the
    character vocabulary's embeddings are negligible)."""
    if params < 1e7:
        raise ValueError(f"--params must be at least 1e7, got {params:g}")
    d_model = 1024 if params < 6e8 else 2048
    return max(1, round(params / (12 * d_model**2))), d_model


def large_job(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    return {
        "name": "large-model-bench",
        "model_config": {"type": "transformer", "n_layer": args.n_layer, "n_head": 16, "d_model": args.d_model,
                         "block_size": BLOCK},
        "dataset_config": {"name": "text", "source": str(source), "batch_size": BATCH, "val_batch_size": BATCH},
        "epochs": 1,
        "learning_rate": 1e-4,
        "optimizer": args.optimizer,
        "precision": args.precision,
        "activation_checkpointing": args.activation_checkpointing,
        "micro_batches": MICRO_BATCHES,
        "schedule": "1f1b",
        "staleness": args.staleness,
        "seed": 0,
        "stages": STAGES,
        "checkpoint_interval_steps": args.steps // 2,
        "audit_rate": 0.0,
        "requirements": {"owner_diversity": False},  # every agent here is one owner's
    }


def one_process(job: dict[str, Any]) -> None:
    """(In a child process.) Train the job's model whole for one epoch as its stages do (optimizer, micro-batches,
    activation checkpointing, precision, the agents' malloc settings); print its peak RSS and step times."""
    torch.set_num_threads(2)
    retain_freed_blocks()  # as every agent does (nodeagent.runner): the heap behaves alike on both sides
    _, model_config, dataset = fit_model_to_dataset(job["model_config"], validate_dataset_config(job["dataset_config"]))
    model = build_full_model(model_spec_from_config(model_config), job["seed"])
    optimizer = make_optimizer(model.parameters(), job["optimizer"], job["learning_rate"])  # as the agents' stages
    train_x, train_y, _, _ = load_dataset(dataset)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in model:  # layer by layer, recomputed in the backward where the stages recompute
            x = checkpoint(layer, x, use_reentrant=False) if job["activation_checkpointing"] else layer(x)
        return x

    seconds = []
    for indices in epoch_batches(len(train_x), dataset["batch_size"], job["seed"], 1):
        started = time.perf_counter()
        for part in indices.tensor_split(job["micro_batches"]):  # gradients accumulate, as across micro-batches
            with autocast(torch.device("cpu"), job["precision"]):
                logits = forward(train_x[part])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), train_y[part].flatten(), reduction="sum")
            (loss / train_y[indices].numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params, "peak_rss": peak_rss(os.getpid()), "step_seconds": seconds}))


def metric(agent: Agent, name: str, labels: str = "") -> float:
    """The sum of a metric's samples named exactly `name` on an agent's /metrics (scraped with its token), of those
    whose labels include `labels` ('source="checkpoint"'; "": any)."""
    response = requests.get(f"http://{agent.metrics_address}/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {agent.metrics_token}"})
    response.raise_for_status()
    return sum(float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name and labels in line.rsplit(" ", 1)[0])


def control_plane_peaks(cluster: LocalCluster) -> dict[str, dict[int, int]]:
    """Each control-plane part's processes' VmHWM by process id (web: gunicorn and its workers; a Celery worker
    and its pool)."""
    return {part: {pid: peak_rss(pid) for pid in sorted(cluster.process_ids(part))} for part in CONTROL_PLANE}


def control_plane_growth(small: dict[str, dict[int, int]], large: dict[str, dict[int, int]]) -> dict[str, int]:
    """Each control-plane process's peak after the large job above its peak after the small one ("part/pid");
    a process started since (a pool's replacement) against its part's largest peak after the small job."""
    return {f"{part}/{pid}": peak - small[part].get(pid, max(small[part].values()))
            for part in CONTROL_PLANE for pid, peak in large[part].items()}


def set_memory_cap(cluster: LocalCluster, agent: Agent, max_memory_bytes: int) -> None:
    response = cluster.client.session.put(
        f"{cluster.api_url}/api/nodes/{agent.node_id}/controls", json={"max_memory_bytes": max_memory_bytes},
        timeout=30,
    )
    response.raise_for_status()


def as_tenant(job: dict[str, Any]) -> dict[str, Any]:
    """`job` naming its text relative to the cluster's data root (the work directory that holds it)."""
    return {**job, "dataset_config": {**job["dataset_config"], "source": Path(job["dataset_config"]["source"]).name}}


def run_job(cluster: LocalCluster, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    created = cluster.client.submit_job(as_tenant(job))
    cluster.client.start_job(created["id"])
    final = cluster.client.wait(created["id"], timeout=timeout)
    if final["status"] != "succeeded":
        raise RuntimeError(f"job {job['name']} {final['status']}: {final['error']} {final['conditions']}")
    return final


def train_large(cluster: LocalCluster, agents: list[Agent], job: dict[str, Any], steps: int) -> dict[str, Any]:
    """Submit the large job; kill stage 1's agent after the first checkpoint; step times and peaks."""
    created = cluster.client.submit_job(as_tenant(job))
    cluster.client.start_job(created["id"])
    job_id, peaks = created["id"], {}
    step_at: dict[int, float] = {}  # when each step was first seen since the job (re)started
    seen: list[tuple[int, float, bool]] = []  # (step, seconds since the step before it, after the kill)
    killed: Agent | None = None
    resumed_from = None
    last_status, since = "", time.monotonic()
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        detail = cluster.client.job(job_id)
        if detail["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"the large job {detail['status']}: {detail['error']} {detail['conditions']}")
        if detail["status"] != last_status:
            last_status, since = detail["status"], time.monotonic()
            print(f"{last_status}: {detail['conditions'][-1:]}", file=sys.stderr, flush=True)
        if last_status == "queued" and time.monotonic() - since > 120:
            raise RuntimeError(f"the large job found no placement in 2 minutes: {detail['conditions']}")
        if killed is not None and detail["resumed_from_step"] is not None and resumed_from is None:
            resumed_from = detail["resumed_from_step"]
        step = detail["step"]
        # Between the kill and the rewind the job still shows the step it was killed at: not a step's start.
        timing = killed is None or resumed_from is not None
        if step not in step_at and detail["status"] in ("running", "succeeded") and timing:
            step_at[step] = time.monotonic()
            if step - 1 in step_at:
                seen.append((step, step_at[step] - step_at[step - 1], killed is not None))
            print(f"step {step} ({detail['status']})", file=sys.stderr, flush=True)
        if killed is None and detail["checkpoints"] and detail["step"] > job["checkpoint_interval_steps"]:
            placed = {p["stage_index"]: p["node_id"] for p in detail["placements"]}
            killed = next(a for a in agents if a.node_id == placed[1])
            peaks[killed.name] = peak_rss(killed.child.process.pid)
            cluster.crash(killed.child.name)
            print(f"killed {killed.name} (stage 1) after step {detail['step']}", file=sys.stderr, flush=True)
            step_at.clear()  # the steps from the checkpoint on are replayed
        if detail["status"] == "succeeded":
            break
        time.sleep(0.2)
    else:
        raise TimeoutError("the large job did not finish within an hour")
    if killed is None or resumed_from is None:
        raise RuntimeError("the large job finished before a kill after its first checkpoint and a resume")
    for agent in agents:
        if agent is not killed:
            peaks[agent.name] = peak_rss(agent.child.process.pid)
    placed = {p["stage_index"]: p["node_id"] for p in detail["placements"]}
    spare = next(a for a in agents if a.node_id == placed[1])
    every = job["checkpoint_interval_steps"]
    # An interval ending at step s is step s's; one right after a checkpoint includes its save, the first
    # step's and the first after the resume their warm-up.
    intervals = [seconds for step, seconds, after_kill in seen
                 if (step - 1) % every and step > 1 and not (after_kill and step == resumed_from + 1)]
    if not intervals:
        raise RuntimeError(f"no step could be timed (seen: {seen}); steps too fast for polling, or too few of them")
    live = [a for a in agents if a is not killed]
    saves = sum(metric(a, "arceus_state_save_seconds_count") for a in live)
    runtime = {n["id"]: n["runtime_memory_bytes"] for n in cluster.client.nodes()}
    stage_of = {a.name: i for i, node in placed.items() for a in live if a.node_id == node}
    return {
        "detail": detail,
        "peaks": peaks,
        "stage_of": {**stage_of, killed.name: 1},
        "runtime": {a.name: runtime[a.node_id] for a in agents},
        "step_seconds": intervals,
        "killed": killed.name,
        "spare": spare.name,
        "resumed_from": resumed_from,
        "save_seconds": sum(metric(a, "arceus_state_save_seconds_sum") for a in live) / saves,
        # per build from the checkpoint (a resume may rebuild every stage, the spare's more than once)
        "load_seconds": metric(spare, "arceus_stage_build_seconds_sum", 'source="checkpoint"')
        / metric(spare, "arceus_stage_build_seconds_count", 'source="checkpoint"'),
    }


def solver_estimates(job: dict[str, Any], detail: dict[str, Any]) -> list[int]:
    """The placement solver's memory per placed stage, in stage order (arceus.placement.solver.stage_memory,
    each stage holding what 1F1B has in flight on it)."""
    _, model_config, dataset = fit_model_to_dataset(job["model_config"], validate_dataset_config(job["dataset_config"]))
    spec = model_spec_from_config(model_config)
    layers = layer_profiles(spec)
    workload = Workload(-(-BATCH // MICRO_BATCHES), MICRO_BATCHES, job["schedule"],
                        optimizer=optimizer_kind(job["optimizer"], 0.0),
                        activation_checkpointing=job["activation_checkpointing"], precision=job["precision"],
                        staleness=job["staleness"])
    ranges = [(p["layer_start"], p["layer_end"]) for p in sorted(detail["placements"], key=lambda p: p["stage_index"])]
    return [stage_memory(layers[s:e], workload, in_flight=workload.in_flight(i, len(ranges)))
            for i, (s, e) in enumerate(ranges)]


def one_process_result(job: dict[str, Any], baseline: Path | None) -> dict[str, Any]:
    """The one process's result for `job` and the load average around it: read from `baseline` where it holds one
    of the same job but its staleness (the one process trains synchronously either way) and its text's directory,
    else measured in a child process (and kept in `baseline`)."""
    same = {**job, "staleness": 0,
            "dataset_config": {**job["dataset_config"], "source": Path(job["dataset_config"]["source"]).name}}
    if baseline is not None and baseline.exists():
        kept = json.loads(baseline.read_text())
        if kept["job"] != same:
            raise SystemExit(f"--baseline {baseline} holds another job's one-process run ({kept['job']}): "
                             "remove it, or name a new file")
        print(f"one process: from {baseline}", file=sys.stderr, flush=True)
        return {**kept["result"], "kept": True}
    print("training in one process ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    child = subprocess.run([sys.executable, __file__, "--one-process", json.dumps(job)],
                           capture_output=True, text=True, check=True)
    result = {**json.loads(child.stdout.strip().splitlines()[-1]), "load": max(load, os.getloadavg()[0])}
    if baseline is not None:
        baseline.write_text(json.dumps({"job": same, "result": result}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--params", type=float, help="about this many parameters (overrides --n-layer, --d-model)")
    parser.add_argument("--optimizer", choices=("adam", "adam8bit", "sgd"), default="adam")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=8, help="steps of the large job (one epoch); at least 4")
    parser.add_argument("--staleness", type=int, choices=(0, 1), default=0, help="the large job's staleness")
    parser.add_argument("--agent-share", type=float, default=AGENT_SHARE,
                        help="each owner's max_memory_bytes as a fraction of the one-process peak")
    parser.add_argument("--baseline", type=Path, metavar="FILE",
                        help="the one process's result: reused from FILE (a run of the same model, optimizer and "
                             "steps), else measured and written there")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy the deployment's logs (agents, web, workers) here before cleaning up")
    parser.add_argument("--one-process", help=argparse.SUPPRESS)  # the child's job JSON
    args = parser.parse_args()
    if args.one_process:
        one_process(json.loads(args.one_process))
        return
    if args.steps < 4:
        parser.error("--steps must be at least 4: a checkpoint, a kill after it, and steps to time")
    if args.params is not None:
        try:
            args.n_layer, args.d_model = gpt_shape(args.params)
        except ValueError as exc:
            parser.error(str(exc))

    with tempfile.TemporaryDirectory(prefix="arceus-large-model-") as workdir:
        job = large_job(args, text_source(Path(workdir), args.steps))
        single = one_process_result(job, args.baseline)
        load_single = single["load"]
        cap = int(args.agent_share * single["peak_rss"])

        cluster = LocalCluster(workdir=Path(workdir) / "cluster", database_url=os.environ.get("DATABASE_URL"),
                               redis_url=os.environ.get("REDIS_URL"),
                               extra_env={"ARCEUS_RPC_TIMEOUT_SECONDS": "900", "ARCEUS_DATA_ROOT": workdir})
        try:
            cluster.start()
            # Each agent computes on one thread and borrows idle ones while its stage fills or drains the pipeline.
            agents = cluster.start_agents([f"agent-{i}" for i in range(STAGES + 1)], "--declare-flops", "2e10",
                                          "--solo-threads", "2")
            for agent in agents:
                set_memory_cap(cluster, agent, cap)
            small = {"name": "default-gpt", "model_config": {"type": "transformer"},
                     "dataset_config": {"name": "text", "source": job["dataset_config"]["source"],
                                        "batch_size": BATCH, "val_batch_size": BATCH},
                     "epochs": 1, "learning_rate": 1e-3, "optimizer": "adam", "stages": STAGES, "seed": 0,
                     "requirements": job["requirements"]}
            print("training the default GPT ...", file=sys.stderr, flush=True)
            run_job(cluster, small, timeout=900)
            control_small = control_plane_peaks(cluster)
            print("training the large GPT ...", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            large = train_large(cluster, agents, job, args.steps)
            load_after = os.getloadavg()[0]
            control_large = control_plane_peaks(cluster)
            estimates = solver_estimates(job, large["detail"])  # while the text file is there
            print("measured:", json.dumps({"one_process": single, "peaks": large["peaks"], "runtime": large["runtime"],
                                           "stage_of": large["stage_of"], "estimates": estimates,
                                           "control_small": control_small, "control_large": control_large}),
                  file=sys.stderr, flush=True)
        finally:
            cluster.stop()
            if args.keep_logs is not None:
                shutil.copytree(cluster.supervisor.log_dir, args.keep_logs, dirs_exist_ok=True)

    detail = large["detail"]
    checkpoint = next(c for c in detail["checkpoints"] if c["step"] == large["resumed_from"])
    checkpoint_bytes = sum(s["size_bytes"] for s in checkpoint["stages"])
    stage1_bytes = next(s["size_bytes"] for s in checkpoint["stages"] if s["stage_index"] == 1)
    peaks, one_peak = large["peaks"], single["peak_rss"]
    # The memory model's prediction of each agent's peak: what it held before any stage, and its stage's estimate.
    predicted = {name: large["runtime"][name] + estimates[stage] for name, stage in large["stage_of"].items()}
    errors = {name: predicted[name] / peaks[name] - 1 for name in predicted}
    growth = control_plane_growth(control_small, control_large)
    hosting = [name for name in large["stage_of"] if name != large["killed"]]
    one_step = statistics.median(single["step_seconds"][1:])
    pipeline_step = statistics.median(large["step_seconds"])
    figures = {
        "params": single["params"],
        "optimizer": args.optimizer,
        "precision": args.precision,
        "activation_checkpointing": args.activation_checkpointing,
        "staleness": args.staleness,
        "agent_share": args.agent_share,
        "one_process_peak_mib": one_peak // MIB,
        "agent_cap_mib": cap // MIB,
        "agent_peaks_mib": {name: peak // MIB for name, peak in sorted(peaks.items())},
        "agent_peak_max_ratio": round(max(peaks.values()) / one_peak, 3),
        "stage_agents_peak_sum_ratio": round(sum(peaks[name] for name in hosting) / one_peak, 3),
        "solver_stage_estimates_mib": [e // MIB for e in estimates],
        "predicted_peaks_mib": {name: p // MIB for name, p in sorted(predicted.items())},
        "prediction_error_max": round(max(abs(e) for e in errors.values()), 3),
        "control_plane_peak_mib_5m": {f"{part}/{pid}": peak // MIB for part, by_pid in control_small.items()
                                      for pid, peak in by_pid.items()},
        "control_plane_peak_mib_large": {f"{part}/{pid}": peak // MIB for part, by_pid in control_large.items()
                                         for pid, peak in by_pid.items()},
        "control_plane_growth_max_mib": max(growth.values()) // MIB,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_save_seconds_mean_per_stage": round(large["save_seconds"], 2),
        "checkpoint_load_seconds_stage1": round(large["load_seconds"], 2),
        "checkpoint_load_bytes_stage1": stage1_bytes,
        "seconds_per_step_one_process": round(one_step, 2),
        "seconds_per_step_pipeline": round(pipeline_step, 2),
        "step_time_ratio": round(pipeline_step / one_step, 2),
        "load_average_1m": {"one_process": round(load_single, 1), "pipeline_start": round(load_before, 1),
                            "pipeline_end": round(load_after, 1)},
        "steps": detail["step"],
        "final_loss": detail["final_loss"],
    }
    def role(name: str) -> str:
        stage = large["stage_of"].get(name)
        if stage is None:
            return "no stage"
        return f"stage {stage}" + (", killed after the first checkpoint" if name == large["killed"] else
                                   ", took it over from the checkpoint" if name == large["spare"] else "")

    agent_rows = "\n".join(
        f"| {name} ({role(name)}) | {peak // MIB} | {peak / one_peak:.2f} | "
        + (f"{predicted[name] // MIB} ({errors[name]:+.0%}) |" if name in predicted else "|")
        for name, peak in sorted(peaks.items())
    )
    control_rows = "\n".join(
        f"| {part} (pid {pid}) | "
        + (f"{control_small[part][pid] // MIB}" if pid in control_small[part] else "(started since)")
        + f" | {peak // MIB} | {growth[f'{part}/{pid}'] // MIB} |"
        for part in CONTROL_PLANE for pid, peak in control_large[part].items()
    )
    command = "python bench/large_model.py " + " ".join(sys.argv[1:])
    title = ("bench/large_model.py" + ("" if args.params is None else f", --params {args.params:.0e}")
             + (f", --staleness {args.staleness}" if args.staleness else ""))
    baseline = (f"measured by an earlier run, kept in `{args.baseline}`" if single.get("kept") else
                "run first and alone")
    body = f"""## Large model over REST ({title})

{machine_line()}

`{command}`

GPT of {single['params'] / 1e6:.0f}M parameters (n_layer {args.n_layer}, d_model {args.d_model}, block {BLOCK}),
optimizer {args.optimizer}, precision {args.precision}, activation checkpointing
{'on' if args.activation_checkpointing else 'off'}, batch {BATCH} in {MICRO_BATCHES} micro-batches (1F1B), staleness
{args.staleness},
{detail['step']} steps over {STAGES} agents of one torch thread each (two while its stage alone computes:
`--solo-threads 2`), every owner's `max_memory_bytes` at {args.agent_share}x the one-process peak ({cap // MIB} MiB).
The one process (2 threads, {baseline}) trains the same model with the same optimizer, precision,
micro-batches (gradients accumulated) and activation checkpointing, synchronously. Stage 1's agent was killed
after the first checkpoint; the spare resumed it from step {large['resumed_from']}.

| process | peak RSS (MiB) | / one process | memory model (MiB, error) |
| --- | ---: | ---: | ---: |
| one process, whole model | {one_peak // MIB} | 1.00 | |
{agent_rows}

Largest agent {figures['agent_peak_max_ratio']}x the one-process peak (goal 0.35x); the {STAGES} agents hosting
the stages at the end together {figures['stage_agents_peak_sum_ratio']}x (goal 1.3x). The memory model's
prediction of an agent's peak is what the agent held before any stage (its `runtime_bytes`) plus the solver's
estimate for its stage (`stage_memory`, per stage in MiB: {figures['solver_stage_estimates_mib']}); its largest
error {figures['prediction_error_max']:.0%} (goal 15%).

Every control-plane process (goal: within 100 MB of its peak after the 5M GPT; largest growth
{figures['control_plane_growth_max_mib']} MiB):

| control-plane process | peak after the 5M GPT (MiB) | after the large GPT (MiB) | growth (MiB) |
| --- | ---: | ---: | ---: |
{control_rows}

Checkpoint of step {large['resumed_from']}: {checkpoint_bytes / 1e9:.2f} GB in all; a stage's save (state written
and uploaded by its agent) took {large['save_seconds']:.1f} s on average; the spare's load of stage 1
({stage1_bytes / 1e9:.2f} GB, downloaded and loaded) took {large['load_seconds']:.1f} s a build.
Seconds per step (median, no checkpoint or recovery in the interval): one process {one_step:.1f}, pipeline
{pipeline_step:.1f} ({figures['step_time_ratio']}x; goal 1.25x). The machine's 1-minute load average (2 cores;
above 2, other programs competed for them): {load_single:.1f} around the one process, {load_before:.1f} and
{load_after:.1f} at the start and end of the large job.
"""
    print(body)
    write_section(("large-model" if args.params is None else f"large-model-{args.params:.0e}")
                  + (f"-staleness{args.staleness}" if args.staleness else ""), body)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
