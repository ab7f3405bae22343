"""The driver's side of a window of train steps (RunSteps, arceus.contracts.step_window): every agent's stream of
replies, one per step as the agent finishes it, taken step by step. A step is done once every agent answered it; an
agent whose stream ended before a step's reply failed that step (its status, or a stream that ended short), and the
steps every agent answered before it stand."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from arceus.v1 import stage_pb2


@dataclass
class _Stream:
    call: grpc.Call
    replies: list[stage_pb2.RunStepReply] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)  # time.perf_counter() when the driver had each reply
    ended: BaseException | None = None
    done: int = 0  # once its stream ended: its place among the streams that ended (1, 2, ...)


class WindowStreams:
    """Reads every agent's RunSteps stream on a thread of its own; the driver is woken once a step's last reply is
    read (every agent answered it) or a stream ended."""

    def __init__(self, calls: Sequence[grpc.Call]) -> None:
        self._streams = [_Stream(call) for call in calls]
        self._arrived: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ends = itertools.count(1)
        for stream in self._streams:
            threading.Thread(target=self._read, args=(stream,), name="window-replies", daemon=True).start()

    def _read(self, stream: _Stream) -> None:
        try:
            for reply in stream.call:
                with self._lock:
                    stream.replies.append(reply)
                    stream.answered.append(time.perf_counter())
                    answered = len(stream.replies)
                    complete = all(len(s.replies) >= answered for s in self._streams)
                if complete:
                    self._arrived.put(None)
        except BaseException as exc:  # noqa: BLE001 - a grpc.RpcError; handed to the driver's thread as it is
            stream.ended = exc
        with self._lock:
            stream.done = next(self._ends)
        self._arrived.put(None)

    def steps(
        self, count: int, failure: Callable[[int, int, BaseException | None], Exception]
    ) -> Iterator[tuple[list[stage_pb2.RunStepReply], list[float]]]:
        """For each of the window's `count` steps in order, every agent's reply and when the driver had it. Once an
        agent's stream ended without step k's reply, `failure(agent, k, its error, or None for a stream that ended
        short)` is raised (the first agent whose stream so ended: the others on step k wait for what will never come);
        the streams are cancelled when the steps stop being taken."""
        try:
            for k in range(count):
                while True:
                    with self._lock:
                        if all(len(s.replies) > k for s in self._streams):
                            replies = [s.replies[k] for s in self._streams]
                            answered = [s.answered[k] for s in self._streams]
                            break
                        ended = [(s.done, i) for i, s in enumerate(self._streams) if s.done and len(s.replies) == k]
                        if ended:
                            agent = min(ended)[1]
                            raise failure(agent, k, self._streams[agent].ended)
                    self._arrived.get()
                yield replies, answered
        finally:
            self.cancel()

    def cancel(self) -> None:
        for stream in self._streams:
            stream.call.cancel()
