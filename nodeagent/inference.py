"""The sequences a hosted stage decodes for text samplers (`Infer`), by the session key each sampler chose.

Bounded: at most MAX_SESSIONS (`arceus.placement.solver.DECODE_SESSIONS`) per stage, the least recently used
dropped first, so no caller can make a stage keep caches without end; a session is taken out while it decodes,
so two calls never share one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import grpc
import torch

from arceus.model.decoding import DecodeState
from arceus.placement.solver import DECODE_SESSIONS
from nodeagent.rpc import RpcFailure
from nodeagent.runtime import StageRuntime

MAX_SESSIONS = DECODE_SESSIONS
MAX_SESSION_KEY = 64


class DecodeSessions:
    def __init__(self, runtime: StageRuntime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, DecodeState] = OrderedDict()

    def decode(self, session: str, start: int, x: torch.Tensor) -> torch.Tensor:
        """Decode positions [start, start + t) of `session` (start 0 begins it afresh)."""
        if not 1 <= len(session) <= MAX_SESSION_KEY:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"session must be 1 to {MAX_SESSION_KEY} characters")
        with self._lock:
            state = self._sessions.pop(session, None)
            if start == 0:
                state = DecodeState()
            elif state is None:
                raise RpcFailure(
                    grpc.StatusCode.NOT_FOUND,
                    f"no session {session!r} here (ended, dropped for newer ones, or in use); start it at 0",
                )
            elif state.position != start:
                self._keep(session, state)
                raise RpcFailure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"session {session!r} has decoded {state.position} positions; continue it at {state.position}",
                )
        try:
            out = self._runtime.decode(x, state)
        except ValueError as exc:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        with self._lock:
            self._keep(session, state)
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _keep(self, session: str, state: DecodeState) -> None:
        self._sessions[session] = state
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
