"""What a running agent last heard from the control plane, kept beside its settings for `arceus-agent status`.

The agent rewrites `status.json` (atomically) after each heartbeat answer: its node, device, the stages it
reported and the owner's controls in force. `status` reads it without calling the control plane: a heartbeat
from anything but the agent would keep a dead agent's node looking alive.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_status(path: Path, status: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps({**status, "pid": os.getpid(), "updated_at": time.time()}, indent=1))
    os.replace(temporary, path)


def read_status(path: Path) -> dict[str, Any] | None:
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def _process_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_status(status: dict[str, Any] | None, now: float) -> list[str]:
    """The lines `arceus-agent status` prints about the running agent (after the settings' lines)."""
    if status is None:
        return ["registration:  none yet: the agent has not run with these settings (`arceus-agent run`)"]
    age = max(0.0, now - float(status.get("updated_at", 0)))
    running = "running" if _process_alive(status.get("pid")) else "not running"
    lines = [
        f"registration:  node {status.get('node_id')}, last heartbeat answer {age:.0f} s ago "
        f"(agent pid {status.get('pid')}, {running})",
        f"device:        {status.get('device')}, serving gRPC at {status.get('grpc_address')}",
    ]
    stages = status.get("stages") or []
    if not stages:
        lines.append("stages:        none")
    for i, stage in enumerate(stages):
        message = f" ({stage['message']})" if stage.get("message") else ""
        label = "stages:" if i == 0 else ""
        lines.append(f"{label:<15}{stage.get('stage_id')} generation {stage.get('generation')}: "
                     f"{stage.get('state')}{message}")
    controls = status.get("controls") or {}
    caps = []
    if controls.get("max_threads"):
        caps.append(f"at most {controls['max_threads']} compute threads")
    if controls.get("max_memory_bytes"):
        caps.append(f"stages within {_bytes(controls['max_memory_bytes'])}")
    lines.append(f"controls:      {'; '.join(caps) if caps else 'none (no thread or memory cap)'}")
    return lines
