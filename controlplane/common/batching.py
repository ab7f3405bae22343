"""Calls made in one turn of an event loop, answered by one call on all their arguments (the quiet heartbeat's
database read, lease renewal and Ready transition: controlplane/agents/heartbeat.py). Heartbeats that arrive
together (one epoll wake-up of the web server reads many connections) then share a round trip: a batch waits for
nothing but the current turn, and grows only when the server is busy, which is when sharing pays.

At most `concurrency` batches are in flight at once; calls made while none is free join the batch that waits for
one. So a burst (10,000 agents' first heartbeats, or a loop slowed by a garbage collection) makes a few large
batches, not one small batch per turn, each holding a connection: the web process's Redis pool refused the
hundred-and-first ("Too many connections") before this bound.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Batched(Generic[K, V]):
    def __init__(self, run: Callable[[list[K]], Awaitable[list[V]]], *, concurrency: int = 4) -> None:
        """`run`: the answers to a list of arguments, in their order."""
        self._run = run
        self._concurrency = concurrency
        # Per event loop: the batch not yet started, and the free slots.
        self._pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[tuple[K, asyncio.Future[V]]]] = (
            weakref.WeakKeyDictionary())
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())
        self._running: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly: one collected mid-batch
        # would leave its callers waiting forever

    async def __call__(self, key: K) -> V:
        loop = asyncio.get_running_loop()
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._start, loop)  # after the calls this turn makes
        future: asyncio.Future[V] = loop.create_future()
        pending.append((key, future))
        return await future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        task = loop.create_task(self._answer(loop))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, loop: asyncio.AbstractEventLoop) -> None:
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self._concurrency)
        async with slots:
            batch = self._pending.pop(loop)  # every call made until a slot was free
            try:
                answers = await self._run([key for key, _ in batch])
            except BaseException as exc:  # every caller learns of it (a cancelled batch too)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                for (_, future), answer in zip(batch, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
