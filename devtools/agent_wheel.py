"""The agent as a contributor installs it: the wheel built from a fresh clone of HEAD, `arceus[agent]` in a venv of
its own (no Django, Celery or psycopg), for the tests that run that install (tests/test_packaging.py, and the
end-to-end test that trains on it).

uv builds and installs (a warm run takes seconds where pip takes a minute, mostly unpacking torch), from the
package sources pip is configured with, as `make install` uses them; torch is the Makefile's pin, whose CPU
wheel those sources carry (an unpinned torch pulls CUDA packages).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).parent / "uv"


class AgentInstallError(RuntimeError):
    pass


@dataclass(frozen=True)
class InstalledAgent:
    wheel: Path
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def command(self) -> Path:
        return self.venv / "bin" / "arceus-agent"


def install_agent(workdir: Path) -> InstalledAgent:
    """Clone HEAD into `workdir`, build its wheel (sdist first, as a source install would) and install
    `torch==2.13.0` and `<wheel>[agent]` into a new venv there; AgentInstallError with the tool's output."""
    clone = workdir / "clone"
    _check(_run("git", "clone", "--quiet", REPO_ROOT, clone), "git clone")
    _check(_run(UV, "build", "--quiet", "--out-dir", workdir / "dist", clone), "uv build")
    (wheel,) = (workdir / "dist").glob("arceus-*.whl")
    venv = workdir / "venv"
    _check(_run(UV, "venv", "--quiet", "--python", sys.executable, venv), "uv venv")
    installed = InstalledAgent(wheel, venv)
    _check(_run(UV, "pip", "install", "--quiet", "--python", installed.python, *pip_sources(), "torch==2.13.0",
                f"{wheel}[agent]"), "uv pip install")
    return installed


def pip_sources() -> list[str]:
    """uv's options for the find-links and extra indexes pip's configuration names, every version of each
    package from all of them considered together, as pip does."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    options = ["--index-strategy", "unsafe-best-match"]
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = {"find-links": "--find-links", "extra-index-url": "--extra-index-url"}.get(key.rpartition(".")[2])
        for source in value.strip("'\"").split() if option else []:
            if [option, source] not in [options[i : i + 2] for i in range(2, len(options), 2)]:
                options += [option, source]
    return options


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600)


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        raise AgentInstallError(f"{what} failed ({result.returncode}): {result.stderr[-2000:]}")
