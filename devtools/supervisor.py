"""Start child processes in their own process groups and stop all of them, always.

Every child gets its own session so that one signal to its group also reaches what it forked
(Celery's pool, gunicorn's workers). On Linux each child also asks the kernel to send it SIGTERM
if this process dies, so even a SIGKILL of the supervisor leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessError(RuntimeError):
    """A child process failed to start or died while it was needed."""


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path | None = None
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the child owns the descriptor from here on
        try:
            process = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        child = Child(name=name, process=process, log_path=log_path)
        self.children.append(child)
        return child

    def wait_for_log_line(self, child: Child, prefix: str, timeout: float, offset: int = 0) -> str:
        """Block until the child's log (from byte `offset`: logs are appended across restarts) holds a
        line starting with `prefix`; return that line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(child.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
            for line in text.splitlines():
                if line.startswith(prefix):
                    return line
            if not child.alive():
                raise ProcessError(
                    f"{child.name} exited with code {child.process.returncode} before it was ready; "
                    f"last lines of {child.log_path}:\n{child.log_tail()}"
                )
            time.sleep(0.05)
        raise ProcessError(f"{child.name} did not print {prefix!r} within {timeout:.0f}s; see {child.log_path}")

    def check_alive(self) -> None:
        for child in self.children:
            if not child.alive():
                raise ProcessError(
                    f"{child.name} exited with code {child.process.returncode}; "
                    f"last lines of {child.log_path}:\n{child.log_tail()}"
                )

    def stop(self, child: Child, grace: float = 10.0) -> None:
        _signal_group(child, signal.SIGTERM)
        try:
            child.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.process.wait()
        # Whatever the leader left behind in its group goes too.
        _signal_group(child, signal.SIGKILL)

    def kill(self, child: Child) -> None:
        """SIGKILL the whole group at once: a crash, not a shutdown. The child is forgotten, so a
        relaunch under the same name is the one `check_alive` watches."""
        _signal_group(child, signal.SIGKILL)
        child.process.wait()
        self.children.remove(child)

    def stop_all(
        self, grace: float | Callable[[int], float] = 10.0, *, wave: Callable[[str], int] = lambda name: 0
    ) -> None:
        """SIGTERM every child, wait (up to `grace`, or `grace(wave number)`) for them to exit, then SIGKILL what is
        left of their groups; in waves by `wave(name)`, lowest first: a server outlives the clients that still talk
        to it while they shut down."""
        for number in sorted({wave(c.name) for c in self.children}):
            self._stop_wave([c for c in self.children if wave(c.name) == number],
                            grace(number) if callable(grace) else grace)

    @staticmethod
    def _stop_wave(children: Sequence[Child], grace: float) -> None:
        for child in reversed(children):
            if child.alive():
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(children):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for child in children:
            _signal_group(child, signal.SIGKILL)
            child.process.wait()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.process.pid, sig)


def peak_rss(pid: int) -> int:
    """A process's peak resident set so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ProcessError(f"/proc/{pid}/status has no VmHWM")
