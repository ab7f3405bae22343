"""Write one benchmark's section of docs/BENCHMARKS.md, replacing its previous figures."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
HEADER = (
    "# Benchmarks\n\n"
    "Each section is rewritten by the script it names; figures are medians of runs made side by side.\n"
)


def _git(*args: str) -> str | None:
    """git's output; None where this tree is no git checkout (or there is no git), as a copy on a lent machine."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=BENCHMARKS.parent)
    except FileNotFoundError:
        return None
    return done.stdout if done.returncode == 0 else None


def _changed_files() -> list[str]:
    """Tracked files changed and untracked files (not ignored), but this report, which the benchmarks
    themselves rewrite: if any, the figures are not the commit's."""
    entries = iter((_git("status", "--porcelain", "-z") or "").split("\0"))
    changed = []
    for entry in entries:
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if status[0] in "RC":
            next(entries, None)  # a rename's or copy's original path
        if path != "docs/BENCHMARKS.md":
            changed.append(path)
    return changed


def machine_line() -> str:
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        commit = "unknown (not run in a git checkout)"
    elif changed := _changed_files():
        commit = f"{head.strip()} with uncommitted changes to {', '.join(changed)}"
    else:
        commit = head.strip()
    return (f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit}, {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}")


def write_section(name: str, body: str) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n{body.strip()}\n{end}"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    BENCHMARKS.write_text(text)


def report(name: str, title: str, body: str, result: dict[str, Any], *, write: bool) -> None:
    """Print the figures; write them as section `name` of docs/BENCHMARKS.md (headed `title` and the machine line)
    unless told not to; end with the one JSON line."""
    print(body)
    if write:
        write_section(name, f"## {title}\n\n{machine_line()}\n\n{body}")
    print(json.dumps(result))
