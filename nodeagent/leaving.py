"""Leaving without losing work: the first SIGTERM or SIGINT of an agent serving a control plane tells the
control plane it is leaving (POST /api/agent/leave; its node then drains like a paused one: the driver
checkpoints and the stage moves to another node) and keeps serving until the heartbeat's assignments are
empty, or `timeout` passes; a second signal, or one before registration, stops at once."""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

from nodeagent.control_plane import ControlPlaneClient, HeartbeatReply
from nodeagent.control_plane_http import ControlPlaneError

log = logging.getLogger("nodeagent")


class Leaving:
    def __init__(self, stop: threading.Event, timeout: float) -> None:
        self.stop = stop
        self.timeout = timeout
        self.requested = threading.Event()  # the first signal since registration
        self._armed = False  # registered: a signal asks to leave rather than stops
        self._told = threading.Event()  # the control plane knows: an empty reply now means "go"
        self._emptied = threading.Event()

    def arm(self) -> None:
        self._armed = True

    def on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        if self._armed and not self.requested.is_set():
            self.requested.set()
        else:
            self.stop.set()

    def on_reply(self, reply: HeartbeatReply) -> None:
        if self._told.is_set() and not reply.assignments and not reply.rejected:
            self._emptied.set()

    def drain(self, client: ControlPlaneClient) -> None:
        """Tell the control plane, serve until nothing is assigned (or the timeout, or a second signal),
        then set `stop`."""
        try:
            stages = client.leave()
        except ControlPlaneError as exc:
            log.warning("could not tell the control plane this node is leaving (%s); stopping now: its job "
                        "resumes from its last checkpoint once the node is missed", exc)
            self.stop.set()
            return
        self._told.set()
        if stages == 0:
            log.info("left: this node hosts no stage")
            self.stop.set()
            return
        log.info("leaving: the control plane moves this node's %d stage(s) elsewhere (at most %gs; "
                 "signal again to stop at once)", stages, self.timeout)
        deadline = time.monotonic() + self.timeout
        while not self.stop.wait(0.2):  # short: a second signal only sets the flag
            if self._emptied.is_set():
                log.info("left: this node's stages moved elsewhere")
                break
            if time.monotonic() >= deadline:
                log.warning("leaving timed out after %gs with a stage still assigned; stopping anyway: its job "
                            "resumes from its last checkpoint", self.timeout)
                break
        self.stop.set()
