"""deploy/ holds together: the compose file passes Debian's `docker-compose config`, the Kubernetes manifests
pass `kubernetes-validate --strict`, and the image, compose and Kubernetes start exactly the processes
README "Running it for real" lists, in its order, with no dev dependencies installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from controlplane.celery import QUEUE_TASK_MODULES, TRAINING_QUEUE
from controlplane.common.worker_pool import TRAINING_WORKER_POOL

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
# The Kubernetes release the manifests are checked against (kubernetes-validate bundles its schemas).
K8S_VERSION = "1.30.0"
# The long-running processes; each must wait for both one-off steps to succeed.
LONG_RUNNING = ("web", "worker-control", "worker-reachability", "worker-training", "beat")
# Services of a compose profile, each started as its own README block says: an agent, the LAN advertiser.
OPTIONAL = ("agent", "advertise")


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Running it for real\n(.*?)^## ", text, re.S | re.M)
    assert match, "README.md has no '## Running it for real' section"
    return match.group(1)


def _sh_commands(block: str) -> list[list[str]]:
    """The commands of a ```sh block: continuation lines joined, comments and `export` lines dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] != "export":
            commands.append(words)
    return commands


def _readme_blocks() -> list[list[list[str]]]:
    return [_sh_commands(b) for b in re.findall(r"```sh\n(.*?)```", _readme_section(), re.S)]


def _readme_operator_commands() -> list[list[str]]:
    """The control plane's start-up, in order, without the install lines."""
    return [c for c in _readme_blocks()[0] if c[0] != "pip"]


def _compose_config() -> dict:
    env = {**os.environ, "ARCEUS_SECRET_KEY": "a-secret-for-the-config-check",
           "ARCEUS_RELAY_SECRET": "a-relay-secret-for-the-config-check", "ARCEUS_PUBLIC_URL": "http://10.0.0.2:8000"}
    result = subprocess.run(
        ["docker-compose", "-f", str(DEPLOY / "compose.yaml"), "config"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return yaml.safe_load(result.stdout)


def _dockerfile_stages() -> dict[str, list[str]]:
    """Each build stage's instructions (continuation lines joined), by stage name."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [])
        current.append(line)
    return stages


def _cmd(stage: list[str]) -> list[str]:
    (cmd,) = [line for line in stage if line.startswith("CMD ")]
    return json.loads(cmd.removeprefix("CMD "))


def _k8s_documents() -> list[dict]:
    return [doc for path in K8S_FILES for doc in yaml.safe_load_all(path.read_text()) if doc]


def _k8s_containers() -> list[dict]:
    containers = []
    for doc in _k8s_documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        containers += pod.get("initContainers", []) + pod.get("containers", [])
    return containers


def test_the_readme_lists_the_operator_start_up_in_order() -> None:
    programs = [" ".join(c[:4]) for c in _readme_operator_commands()]
    assert programs == [
        "python manage.py migrate --noinput",
        "python manage.py collectstatic --noinput",
        "python manage.py createsuperuser",
        "gunicorn controlplane.asgi -c python:controlplane.gunicorn_conf",
        "celery -A controlplane.celery worker",
        "celery -A controlplane.celery worker",
        "celery -A controlplane.celery worker",
        "celery -A controlplane.celery beat",
        "python -m arceus.relay --listen",
    ]


def test_compose_file_is_valid_and_runs_the_readme_commands() -> None:
    services = _compose_config()["services"]
    image_cmd = _cmd(_dockerfile_stages()["server"])
    started = {name: services[name].get("command", image_cmd) for name in services if name not in OPTIONAL
               and services[name].get("image", "").startswith("arceus-server")}
    readme = [c for c in _readme_operator_commands() if c[-1] != "createsuperuser"]
    distinct = {tuple(command) for command in started.values()}  # replicas (the two relays) run one command
    assert sorted(distinct) == sorted(map(tuple, readme)), "compose's commands differ from README 'Running it for real'"
    assert started["web"] == image_cmd


def test_compose_runs_migrate_and_collectstatic_once_before_the_rest() -> None:
    services = _compose_config()["services"]
    for name in ("migrate", "collectstatic"):
        assert services[name]["restart"] == "no"
    for name in LONG_RUNNING:
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, name
    assert services["web"]["depends_on"]["collectstatic"] == {"condition": "service_completed_successfully"}


def test_compose_shares_checkpoints_and_static_files_with_web() -> None:
    services = _compose_config()["services"]

    def mounts(name: str) -> dict[str, str]:
        """Target -> named volume (docker-compose 1.x prints `source:target[:mode]`)."""
        return {v.split(":")[1]: v.split(":")[0] for v in services[name].get("volumes", [])}

    for name in ("web", "worker-control", "worker-training"):
        assert mounts(name).get("/app/var/checkpoints") == "checkpoints", name
    assert mounts("web")["/app/var/static"] == mounts("collectstatic")["/app/var/static"] == "static"


def test_the_advertiser_runs_as_the_readme_says() -> None:
    # The section's line: `ARCEUS_PUBLIC_URL=http://HOST:PORT python -m arceus.discovery advertise`.
    (line,) = [c for block in _readme_blocks() for c in block if c[1:4] == ["python", "-m", "arceus.discovery"]]
    advertise = _compose_config()["services"]["advertise"]
    assert line[1:] == advertise["command"] == ["python", "-m", "arceus.discovery", "advertise"]
    assert line[0].startswith("ARCEUS_PUBLIC_URL=") and "ARCEUS_PUBLIC_URL" in advertise["environment"]
    assert advertise["network_mode"] == "host" and advertise["profiles"] == ["lan"]


def test_the_agents_start_as_the_readme_says() -> None:
    # The section's agent line: `ARCEUS_NODE_TOKEN=... arceus-agent run --control-plane URL --listen ...`.
    (line,) = [c for block in _readme_blocks() for c in block if "--listen" in c and "arceus-agent" in c]
    env, agent = line[:1], line[1:]
    agent_service = _compose_config()["services"]["agent"]
    assert env[0].startswith("ARCEUS_NODE_TOKEN=") and "ARCEUS_NODE_TOKEN" in agent_service["environment"]
    assert agent_service["command"][:2] == agent[:2] == _cmd(_dockerfile_stages()["agent"])
    # The same flags; the addresses are each host's own.
    assert agent_service["command"][2::2] == agent[2::2], "the agent's flags differ between compose and README"


def test_the_images_install_no_dev_dependencies() -> None:
    stages = _dockerfile_stages()
    installs = {name: [line for line in lines if "pip install" in line] for name, lines in stages.items()}
    assert any('".[server,s3]"' in line for line in installs["server"])
    assert any('".[agent]"' in line for line in installs["agent"])
    for line in sum(installs.values(), []):
        extras = {e for group in re.findall(r'"\.\[([^\]]*)\]"', line) for e in group.split(",")}
        assert "dev" not in extras, line
    assert any("torch==2.13.0" in line for line in installs["base"])
    assert list(stages)[-1] == "server", "the default target (the last stage) must be the control plane"


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_kubernetes_manifests_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_runs_the_readme_commands_from_the_secret() -> None:
    containers = _k8s_containers()
    readme = [c for c in _readme_operator_commands() if c[-1] != "createsuperuser"]
    assert sorted(c["command"] for c in containers) == sorted(readme)
    for container in containers:
        if container["name"] == "relay":  # a relay needs its ticket secret and identity only, not the database's
            assert [e["name"] for e in container["env"]] == ["ARCEUS_RELAY_SECRET"] and "envFrom" not in container
            assert [m["name"] for m in container["volumeMounts"]] == ["identity"]
            continue
        assert {"secretRef": {"name": "arceus"}} in container["envFrom"], container["name"]
        # Every control-plane process reads the relays' certificate at start-up, never their key.
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "relay-cert"]
        assert mount["mountPath"] == "/etc/arceus/relay", container["name"]
    (web,) = [d for d in _k8s_documents() if d["metadata"]["name"] == "arceus-web" and d["kind"] == "Deployment"]
    (init,) = web["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][2] == "collectstatic"
    secret_keys = set(re.findall(r"--from-literal=(\w+)=", (DEPLOY / "k8s" / "controlplane.yaml").read_text()))
    assert {"ARCEUS_SECRET_KEY", "ARCEUS_CHECKPOINT_S3_BUCKET", "DATABASE_URL", "REDIS_URL"} <= secret_keys


def test_each_worker_imports_its_queues_own_task_modules_and_no_other() -> None:
    """The training and reachability tasks load gRPC (the training ones torch too): only the worker of their
    queue imports them (`-I`), and a worker without them would drop each of its tasks as an unknown one."""
    workers = _worker_commands()
    assert len(workers) == 9
    for command in workers:
        queues = command[command.index("-Q") + 1].split(",")
        imports = set(command[command.index("-I") + 1].split(",")) if "-I" in command else set()
        assert imports == {QUEUE_TASK_MODULES[q] for q in queues if q in QUEUE_TASK_MODULES}, command


def test_every_training_worker_runs_its_drivers_as_threads_of_one_process() -> None:
    """README, compose and Kubernetes start the training worker with the pool devtools/cluster.py uses (one home:
    controlplane/common/worker_pool.py), not a process per running job."""
    training = [c for c in _worker_commands() if TRAINING_QUEUE in c[c.index("-Q") + 1].split(",")]
    assert len(training) == 3
    for command in training:
        assert any(command[i : i + len(TRAINING_WORKER_POOL)] == list(TRAINING_WORKER_POOL)
                   for i in range(len(command))), command


def _worker_commands() -> list[list[str]]:
    """Every `celery worker` command of README, compose and Kubernetes."""
    workers = [c for c in _readme_operator_commands() if c[3:4] == ["worker"]]
    workers += [service["command"] for service in _compose_config()["services"].values()
                if service.get("command", [])[3:4] == ["worker"]]
    workers += [c["command"] for c in _k8s_containers() if c.get("command", [])[3:4] == ["worker"]]
    return workers
