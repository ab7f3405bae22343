"""A thread-safe keyed mailbox: pushes from the network land here, the running step waits for them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
MailKey = tuple[int, str, int]  # (step, kind, micro_batch)


class MailboxTimeout(TimeoutError):
    pass


class MailboxClosed(RuntimeError):
    """The stage was dropped or reconfigured while someone waited."""


class MailboxCancelled(RuntimeError):
    """The waiter's own call was cancelled."""


class MailboxFull(RuntimeError):
    pass


class Mailbox(Generic[T]):
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: dict[MailKey, T] = {}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, key: MailKey, value: T) -> None:
        """Deliver `value`; a second delivery under the same key (a retried push) replaces the first.

        When full, entries of other steps make room: steps run one at a time, so they are leftovers.
        """
        with self._cond:
            if self._closed:
                raise MailboxClosed("the stage is no longer hosted here")
            if key not in self._items and len(self._items) >= self._capacity:
                self._drop_where(lambda k: k[0] != key[0])
            if key not in self._items and len(self._items) >= self._capacity:
                raise MailboxFull(
                    f"{len(self._items)} undelivered tensors of step {key[0]} are waiting, "
                    f"the limit is {self._capacity}"
                )
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: MailKey, timeout: float, cancelled: threading.Event | None = None) -> T:
        """Remove and return the value under `key`, waiting up to `timeout` seconds for it to arrive."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if key in self._items:
                    return self._items.pop(key)
                if self._closed:
                    raise MailboxClosed("the stage is no longer hosted here")
                if cancelled is not None and cancelled.is_set():
                    raise MailboxCancelled("the call was cancelled")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MailboxTimeout(f"nothing arrived for {key} within {timeout:.1f}s")
                self._cond.wait(remaining)

    def arrived(self, step: int) -> list[tuple[str, int]]:
        """(kind, micro_batch) of what waits here for `step`."""
        with self._cond:
            return [(kind, micro_batch) for s, kind, micro_batch in self._items if s == step]

    def wake(self) -> None:
        """Make waiters re-check their cancellation flag."""
        with self._cond:
            self._cond.notify_all()

    def retain_step(self, step: int) -> int:
        """Drop everything not addressed to `step` (left over from failed or abandoned steps)."""
        with self._cond:
            return self._drop_where(lambda k: k[0] != step)

    def discard(self, predicate: Callable[[MailKey], bool]) -> int:
        """Drop what `predicate` picks (how many)."""
        with self._cond:
            return self._drop_where(predicate)

    def clear(self) -> None:
        with self._cond:
            self._items.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    def _drop_where(self, predicate: Callable[[MailKey], bool]) -> int:
        stale = [key for key in self._items if predicate(key)]
        for key in stale:
            del self._items[key]
        return len(stale)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
