"""`arceus-agent service install`: a systemd user unit that runs the agent from its settings in the
background, restarts it after a crash and starts it with the owner's session (or at boot, with lingering).

It writes the unit and prints the commands to enable and to remove it; it runs no systemctl itself. The
unit gives a stop more time than the agent's leave takes (nodeagent.leaving), so systemd's SIGTERM drains
the node instead of systemd killing the agent mid-handover. launchd (macOS) is not built yet.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import platformdirs

from nodeagent.leaving import DEFAULT_LEAVE_TIMEOUT_SECONDS
from nodeagent.settings import SettingsError, default_settings_path, load_settings

UNIT_NAME = "arceus-agent.service"
STOP_MARGIN_SECONDS = 30  # beyond the leave: the agent's own shutdown after its stages moved


def _quoted(arg: str) -> str:
    """One ExecStart word: systemd reads C-style quotes and expands `%` specifiers."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def systemd_unit(python: str, config: Path) -> str:
    command = " ".join(_quoted(a) for a in (python, "-m", "nodeagent", "run", "--config", str(config)))
    return f"""[Unit]
Description=Arceus node agent (lends this computer to training jobs)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart={command}
Environment=PYTHONUNBUFFERED=1
# A stop (SIGTERM) hands this node's stages over first: allow for the agent's --leave-timeout.
TimeoutStopSec={int(DEFAULT_LEAVE_TIMEOUT_SECONDS) + STOP_MARGIN_SECONDS}
# It exits 0 when stopped; anything else is a crash or a refusal worth retrying.
Restart=on-failure
RestartSec=10

[Install]
WantedBy=default.target
"""


def service_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="arceus-agent service",
        description="Run the agent in the background: `install` writes a systemd user unit (Linux) that starts "
        "`arceus-agent run` from your settings and prints how to enable and remove it.",
    )
    parser.add_argument("action", choices=["install"])
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help=f"settings file (default: {default_settings_path()})"
    )
    parser.add_argument(
        "--unit-dir", type=Path, metavar="DIR",
        help=f"where to write {UNIT_NAME} (default: {platformdirs.user_config_path('systemd') / 'user'})",
    )
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print(f"arceus-agent service: only systemd (Linux) is supported yet, not {sys.platform}; run "
              "`arceus-agent run` under your own process manager", file=sys.stderr)
        return 2
    config = (args.config or default_settings_path()).resolve()
    try:
        load_settings(config)  # refused now rather than by a unit that fails at every start
    except SettingsError as exc:
        print(f"arceus-agent service: {exc}", file=sys.stderr)
        return 2
    unit_dir: Path = args.unit_dir or platformdirs.user_config_path("systemd") / "user"
    unit_dir.mkdir(parents=True, exist_ok=True)
    path = unit_dir / UNIT_NAME
    path.write_text(systemd_unit(sys.executable, config))
    print(f"systemd user unit written to {path}")
    print("start it now and at every login:  systemctl --user daemon-reload && systemctl --user enable --now "
          "arceus-agent")
    print("start it at boot, logged in or not:  loginctl enable-linger")
    print(f"remove it:  systemctl --user disable --now arceus-agent && rm {shlex.quote(str(path))} "
          "&& systemctl --user daemon-reload")
    return 0
