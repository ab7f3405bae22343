"""The `arceus-agent` command and `python -m nodeagent`: caps OpenMP's spinning before anything imports torch."""

from __future__ import annotations

from nodeagent.openmp import cap_openmp_spin


def main() -> int:
    cap_openmp_spin()  # before nodeagent.cli imports torch
    from nodeagent.cli import main as cli_main

    return cli_main()
