"""`arceus-agent service install`: a systemd user unit (Linux) or a launchd agent (macOS) that runs the agent
from its settings in the background, restarts it after a crash and starts it with the owner's session (or at
boot, with lingering, on Linux).

It writes the file and prints the commands to enable and to remove it; it runs no systemctl or launchctl itself.
Both give a stop more time than the agent's leave takes (nodeagent.leaving), so the service manager's SIGTERM
drains the node instead of killing the agent mid-handover.
"""

from __future__ import annotations

import argparse
import plistlib
import shlex
import sys
from pathlib import Path

import platformdirs

from nodeagent.settings import DEFAULT_LEAVE_TIMEOUT_SECONDS, SettingsError, default_settings_path, load_settings

UNIT_NAME = "arceus-agent.service"
LAUNCHD_LABEL = "org.arceus.agent"
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


def launchd_agent(python: str, config: Path, logs: Path) -> bytes:
    """A launchd agent property list: run at login, started again unless it exited 0 (stopped)."""
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [python, "-m", "nodeagent", "run", "--config", str(config)],
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        # launchd's SIGTERM hands this node's stages over first: allow for the agent's --leave-timeout.
        "ExitTimeOut": int(DEFAULT_LEAVE_TIMEOUT_SECONDS) + STOP_MARGIN_SECONDS,
        "StandardOutPath": str(logs / "arceus-agent.log"),
        "StandardErrorPath": str(logs / "arceus-agent.log"),
    })


def service_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="arceus-agent service",
        description="Run the agent in the background: `install` writes a systemd user unit (Linux) or a launchd "
        "agent (macOS) that starts `arceus-agent run` from your settings, and prints how to enable and remove it.",
    )
    parser.add_argument("action", choices=["install"])
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help=f"settings file (default: {default_settings_path()})"
    )
    parser.add_argument(
        "--unit-dir", type=Path, metavar="DIR",
        help="where to write the unit (default: ~/.config/systemd/user on Linux, ~/Library/LaunchAgents on macOS)",
    )
    parser.add_argument(
        "--platform", choices=["linux", "macos"], default="macos" if sys.platform == "darwin" else "linux",
        help="which service manager to write for (default: this machine's)",
    )
    args = parser.parse_args(argv)
    if args.platform == "linux" and not sys.platform.startswith("linux") and args.unit_dir is None:
        print(f"arceus-agent service: systemd units are for Linux, this is {sys.platform}; pass --platform macos "
              "on a Mac, or run `arceus-agent run` under your own process manager", file=sys.stderr)
        return 2
    config = (args.config or default_settings_path()).resolve()
    try:
        load_settings(config)  # refused now rather than by a service that fails at every start
    except SettingsError as exc:
        print(f"arceus-agent service: {exc}", file=sys.stderr)
        return 2
    if args.platform == "macos":
        return _install_launchd(config, args.unit_dir or Path.home() / "Library" / "LaunchAgents")
    return _install_systemd(config, args.unit_dir or platformdirs.user_config_path("systemd") / "user")


def _install_systemd(config: Path, unit_dir: Path) -> int:
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


def _install_launchd(config: Path, agent_dir: Path) -> int:
    agent_dir.mkdir(parents=True, exist_ok=True)
    logs = platformdirs.user_log_path("arceus")
    logs.mkdir(parents=True, exist_ok=True)
    path = agent_dir / f"{LAUNCHD_LABEL}.plist"
    path.write_bytes(launchd_agent(sys.executable, config, logs))
    quoted = shlex.quote(str(path))
    print(f"launchd agent written to {path} (its log: {logs / 'arceus-agent.log'})")
    print(f"start it now and at every login:  launchctl bootstrap gui/$(id -u) {quoted}")
    print(f"remove it:  launchctl bootout gui/$(id -u) {quoted} && rm {quoted}")
    return 0
