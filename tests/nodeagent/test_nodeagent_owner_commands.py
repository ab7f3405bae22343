"""The owner's commands start fast and light: `arceus-agent init` and `status`, run as the owner runs them, import
neither torch nor gRPC (what running an agent needs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def owner_command(args: list[str], stdin: str = "") -> tuple[str, set[str]]:
    """Run `python -m nodeagent ARGS` (what `arceus-agent` runs); its stdout and the modules it imported."""
    env = {k: v for k, v in os.environ.items() if k != "ARCEUS_NODE_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nodeagent", *args],
        input=stdin, capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    return done.stdout, imported


def test_init_and_status_import_neither_torch_nor_grpc(tmp_path: Path) -> None:
    config = str(tmp_path / "agent.toml")
    out, imported = owner_command(
        ["init", "--control-plane", "http://127.0.0.1:1", "--token-stdin", "--config", config], stdin="tok\n"
    )
    assert (tmp_path / "node-token").read_text().strip() == "tok"
    assert "nodeagent.owner_commands" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "grpc")}

    out, imported = owner_command(["status", "--config", config])
    assert "registration:  none yet" in out
    assert "earnings:      unknown (GET http://127.0.0.1:1/api/agent/earnings failed" in out  # it asked
    assert not {m for m in imported if m.split(".")[0] in ("torch", "grpc")}
