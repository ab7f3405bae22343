"""The `arceus-agent` command and `python -m nodeagent`. The owner's commands (init, status, service) load no torch:
they are dispatched before `nodeagent.cli`, which runs an agent, is imported; before that import OpenMP's
spinning is capped."""

from __future__ import annotations

import logging
import os
import sys

from nodeagent.openmp import cap_openmp_spin
from nodeagent.owner_commands import OWNER_COMMANDS, run_owner_command


def main() -> int:
    argv = sys.argv[1:]
    if argv and argv[0] in OWNER_COMMANDS:
        return run_owner_command(argv)
    cap_openmp_spin()  # before nodeagent.cli imports torch
    from nodeagent.cli import main as cli_main

    code = cli_main(argv)
    # The agent has stopped: its server is down, its stages dropped, nothing is left to do. Python's own teardown
    # (module by module, with full collections over every object torch and gRPC made) can take longer on a busy
    # machine than a supervisor waits for a stopped process (devtools.launch, systemd) before it kills it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
