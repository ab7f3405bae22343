"""`arceus`: the developer's command line, a thin shell over `arceus.sdk`.

    export ARCEUS_URL=http://127.0.0.1:8000 ARCEUS_TOKEN=...   # or: arceus login USER
    arceus signup USER --email ME@EXAMPLE.ORG   # a new account; prints its API token
    arceus jobs submit job.json          # prints the new job's id
    arceus jobs train JOB_ID --watch     # starts it and draws a live progress bar
    arceus jobs show JOB_ID
    arceus jobs model JOB_ID -o model.safetensors   # the trained weights
    arceus jobs model JOB_ID --format hf -o my-llama  # a llama (or transformer) as a Hugging Face folder
    arceus jobs weights JOB_ID my-llama  # a llama (transformer) job not yet started starts from these weights
    arceus jobs serve JOB_ID --wait      # keep a succeeded text job on agents for sampling (--stop: release them)
    arceus jobs sample JOB_ID --prompt "And God said"  # text from a running or served transformer job
    arceus datasets upload corpus.txt --format text   # resumable; prints the dataset (its id goes in dataset_config)
    arceus datasets list
    arceus nodes create my-laptop        # prints the agent token, once, in the commands that start its agent
    arceus nodes pause NODE_ID           # drain it: its stages move elsewhere without losing work
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from arceus.contracts.credentials import NODE_TOKEN_ENV
from arceus.contracts.status import JobStatus
from arceus.progress_bar import JobProgressBar
from arceus.sdk import TOKEN_ENV, URL_ENV, ApiError, ArceusClient


def _client(args: argparse.Namespace) -> ArceusClient:
    if not args.url:
        raise SystemExit("error: no control-plane URL: pass --url or set ARCEUS_URL")
    if not args.token:
        raise SystemExit("error: no API token: pass --token, set ARCEUS_TOKEN, or run `arceus login USER`")
    return ArceusClient(args.url, args.token)


def _print(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def _load_spec(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise SystemExit(f"error: cannot read job file {path}: {exc.strerror}") from exc
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from exc
    if not isinstance(spec, dict):
        raise SystemExit(f"error: {path} must hold one JSON object describing the job")
    return spec


def _watch(client: ArceusClient, job_id: str) -> int:
    bar = JobProgressBar(file=sys.stderr)
    try:
        detail = client.wait(job_id, on_update=bar.update)
    finally:
        bar.close()
    _print({k: detail[k] for k in ("id", "status", "step", "final_loss", "val_accuracy", "error")})
    return 0 if detail["status"] == JobStatus.SUCCEEDED else 1


def cmd_login(args: argparse.Namespace) -> int:
    password = os.environ.get("ARCEUS_PASSWORD") or getpass.getpass(f"password for {args.username}: ")
    client = ArceusClient.login(args.url, args.username, password)
    print(client.session.headers["Authorization"].removeprefix("Token "))
    return 0


def cmd_signup(args: argparse.Namespace) -> int:
    if not args.url:
        raise SystemExit("error: no control-plane URL: pass --url or set ARCEUS_URL")
    password = os.environ.get("ARCEUS_PASSWORD") or getpass.getpass(f"new password for {args.username}: ")
    client = ArceusClient.register(args.url, args.username, args.email, password)
    print(client.session.headers["Authorization"].removeprefix("Token "))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "submit":
        job = client.submit_job(_load_spec(args.file))
        print(job["id"])
    elif args.action == "estimate":
        _print(client.estimate(_load_spec(args.file)))
    elif args.action == "train":
        client.start_job(args.job_id, epochs=args.epochs, learning_rate=args.learning_rate)
        if args.watch:
            return _watch(client, args.job_id)
        print(f"job {args.job_id} queued")
    elif args.action == "watch":
        return _watch(client, args.job_id)
    elif args.action == "show":
        _print(client.job(args.job_id))
    elif args.action == "cancel":
        _print(client.cancel_job(args.job_id))
    elif args.action == "model" and args.format == "hf":
        output = Path(args.output or f"{args.job_id}-hf")
        received = client.save_hugging_face_model(args.job_id, output)
        print(f"wrote the folder {output} ({received:,} bytes): transformers' from_pretrained loads it")
    elif args.action == "model":
        output = Path(args.output or f"{args.job_id}.safetensors")
        written = client.save_model(args.job_id, output)
        print(f"wrote {output} ({written:,} bytes)")
    elif args.action == "weights":
        job = client.upload_initial_weights(args.job_id, Path(args.source))
        print(f"job {job['id']} starts from the uploaded weights ({job['initial_weights_sha256']})")
    elif args.action == "serve" and args.stop:
        client.stop_serving(args.job_id)
        print(f"job {args.job_id} no longer served: its agents drop its stages")
    elif args.action == "serve":
        client.serve_job(args.job_id)
        if args.wait:
            client.wait_served(args.job_id, timeout=args.timeout)
            print(f"job {args.job_id} is served: sample it with `arceus jobs sample {args.job_id}`")
        else:
            print(f"job {args.job_id} will be served once its stages are ready: see its Serving condition "
                  f"(arceus jobs show {args.job_id})")
    elif args.action == "sample":
        print(client.sample(
            args.job_id, prompt=args.prompt, length=args.length, temperature=args.temperature, seed=args.seed
        )["text"])
    else:
        _print(client.jobs())
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "create":
        created = client.create_node(args.name)
        print(f"node {created['id']} created; its agent token is shown only this once.\n"
              f"{_agent_commands(args.url, created['token'])}")
    elif args.action in ("pause", "resume"):
        node = client.pause_node(args.node_id) if args.action == "pause" else client.resume_node(args.node_id)
        print(f"node {node['id']} {'paused: its stages move elsewhere' if node['paused'] else 'resumed'}")
    else:
        _print(client.nodes())
    return 0


def _agent_commands(url: str, token: str) -> str:
    """How the node's owner starts its agent (`arceus-agent`, nodeagent): the token goes by the environment or
    standard input, never as an argument, which every local user sees in `ps`."""
    url, token = shlex.quote(url), shlex.quote(token)
    return (
        "Start its agent on the machine it lends:\n"
        f"  {NODE_TOKEN_ENV}={token} arceus-agent --control-plane {url}\n"
        "or keep the token in a file only you can read, with settings `arceus-agent run` starts from:\n"
        f"  echo {token} | arceus-agent init --control-plane {url} --token-stdin\n"
        "  arceus-agent run"
    )


def cmd_datasets(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "upload":
        source = Path(args.file)
        if not source.is_file():
            raise SystemExit(f"error: no file {source}")
        fmt = args.format or _FORMAT_BY_SUFFIX.get(source.suffix.lower())
        if fmt is None:
            raise SystemExit(f"error: cannot tell {source}'s format from its name; pass --format")

        def progress(sent: int, total: int) -> None:
            print(f"\r{sent / total:6.1%} of {total:,} bytes", end="", file=sys.stderr, flush=True)

        dataset = client.upload_dataset(source, fmt, name=args.name, column=args.column, on_progress=progress)
        print(file=sys.stderr)
        _print(dataset)
    elif args.action == "delete":
        client.delete_dataset(args.dataset_id)
        print(f"dataset {args.dataset_id} deleted")
    else:
        _print(client.datasets())
    return 0


_FORMAT_BY_SUFFIX = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".safetensors": "safetensors",
                     ".npz": "npz", ".json": "tokenizer"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arceus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get(URL_ENV), help=f"control plane URL (${URL_ENV})")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"API token (${TOKEN_ENV})")
    sub = parser.add_subparsers(dest="command", required=True)

    login = sub.add_parser("login", help="exchange a username and password for an API token")
    login.add_argument("username")
    login.set_defaults(func=cmd_login)
    signup = sub.add_parser("signup", help="create an account and print its API token")
    signup.add_argument("username")
    signup.add_argument("--email", required=True)
    signup.set_defaults(func=cmd_signup)

    jobs = sub.add_parser("jobs", help="submit, start, watch and inspect training jobs")
    jobs_sub = jobs.add_subparsers(dest="action", required=True)
    submit = jobs_sub.add_parser("submit", help="submit a job from a JSON file (- for stdin)")
    submit.add_argument("file")
    jobs_sub.add_parser(
        "estimate", help="what a job from a JSON file (- for stdin) would get now: placement, speed, price"
    ).add_argument("file")
    train = jobs_sub.add_parser("train", help="start (or restart) a job")
    train.add_argument("job_id")
    train.add_argument("--epochs", type=int)
    train.add_argument("--learning-rate", type=float)
    train.add_argument("--watch", action="store_true", help="draw a progress bar until it finishes")
    for name, text in (("watch", "progress bar until the job finishes"), ("show", "the job as JSON"),
                       ("cancel", "cancel the job")):
        jobs_sub.add_parser(name, help=text).add_argument("job_id")
    model = jobs_sub.add_parser("model", help="download the trained weights as a safetensors file")
    model.add_argument("job_id")
    model.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                       help="hf: a llama or transformer as a Hugging Face folder (config.json, model.safetensors)")
    model.add_argument("-o", "--output",
                       help="file (folder for --format hf) to write (default: JOB_ID.safetensors, JOB_ID-hf)")
    weights = jobs_sub.add_parser(
        "weights", help="upload the weights a job starts from: a Hugging Face folder or its model.safetensors"
    )
    weights.add_argument("job_id")
    weights.add_argument("source")
    serve = jobs_sub.add_parser("serve", help="serve a succeeded text job for sampling, or stop serving it")
    serve.add_argument("job_id")
    serve.add_argument("--stop", action="store_true", help="stop serving it: its nodes are released")
    serve.add_argument("--wait", action="store_true", help="wait until every stage is ready to sample")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")
    sample = jobs_sub.add_parser("sample", help="generate text from a running or served transformer job")
    sample.add_argument("job_id")
    sample.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sample.add_argument("--length", type=int, default=300, help="tokens to generate (characters for a char vocabulary)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    sample.add_argument("--seed", type=int, default=0)
    jobs_sub.add_parser("list", help="your jobs")
    jobs.set_defaults(func=cmd_jobs)

    datasets = sub.add_parser("datasets", help="upload, list or delete your datasets")
    datasets_sub = datasets.add_subparsers(dest="action", required=True)
    upload = datasets_sub.add_parser("upload", help="upload a dataset file (resumes an interrupted upload of it)")
    upload.add_argument("file")
    upload.add_argument("--format", choices=("text", "jsonl", "parquet", "safetensors", "npz", "tokenizer"),
                        help="default: from the file's suffix (.txt .jsonl .parquet .safetensors .npz .json)")
    upload.add_argument("--name", help="a label (default: the file's name)")
    upload.add_argument("--column", default="text", help="jsonl/parquet: the text field (default: text)")
    datasets_sub.add_parser("list", help="your datasets")
    datasets_sub.add_parser("delete", help="delete a dataset").add_argument("dataset_id")
    datasets.set_defaults(func=cmd_datasets)

    nodes = sub.add_parser("nodes", help="list, mint, pause or resume nodes")
    nodes_sub = nodes.add_subparsers(dest="action", required=True)
    nodes_sub.add_parser("create", help="register a node and print its agent token").add_argument("name")
    nodes_sub.add_parser("list", help="every node with its state and capabilities")
    nodes_sub.add_parser("pause", help="drain your node: its stages move elsewhere").add_argument("node_id")
    nodes_sub.add_parser("resume", help="offer your node again").add_argument("node_id")
    nodes.set_defaults(func=cmd_nodes)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # connection refused, DNS, timeouts from requests
        print(f"error: cannot reach the control plane at {args.url}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
