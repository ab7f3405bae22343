from __future__ import annotations

import threading
import time

import pytest

from nodeagent.mailbox import Mailbox, MailboxCancelled, MailboxClosed, MailboxFull, MailboxTimeout


def test_get_returns_what_was_put_once() -> None:
    box: Mailbox[str] = Mailbox(capacity=4)
    box.put((1, "ACTIVATION", 0), "a")
    box.put((1, "ACTIVATION", 0), "a2")  # a retried push replaces the first
    assert len(box) == 1
    assert box.get((1, "ACTIVATION", 0), timeout=0) == "a2"
    assert len(box) == 0


def test_arrived_lists_what_waits_for_a_step() -> None:
    box: Mailbox[str] = Mailbox(capacity=4)
    box.put((1, "ACTIVATION", 0), "a")
    box.put((1, "GRADIENT", 2), "g")
    box.put((2, "ACTIVATION", 0), "next step's")
    assert sorted(box.arrived(1)) == [("ACTIVATION", 0), ("GRADIENT", 2)]
    box.get((1, "GRADIENT", 2), timeout=0)
    assert box.arrived(1) == [("ACTIVATION", 0)]


def test_get_blocks_until_the_value_arrives() -> None:
    box: Mailbox[int] = Mailbox(capacity=4)
    threading.Timer(0.05, box.put, args=((3, "GRADIENT", 1), 42)).start()
    started = time.monotonic()
    assert box.get((3, "GRADIENT", 1), timeout=5) == 42
    assert time.monotonic() - started < 2


def test_get_times_out() -> None:
    box: Mailbox[int] = Mailbox(capacity=4)
    box.put((1, "ACTIVATION", 1), 1)
    started = time.monotonic()
    with pytest.raises(MailboxTimeout):
        box.get((1, "ACTIVATION", 0), timeout=0.1)
    assert 0.09 <= time.monotonic() - started < 1


def test_close_wakes_waiters_and_rejects_puts() -> None:
    box: Mailbox[int] = Mailbox(capacity=4)
    threading.Timer(0.05, box.close).start()
    with pytest.raises(MailboxClosed):
        box.get((1, "LABELS", 0), timeout=5)
    with pytest.raises(MailboxClosed):
        box.put((1, "LABELS", 0), 1)


def test_cancellation_wakes_the_waiter() -> None:
    box: Mailbox[int] = Mailbox(capacity=4)
    cancelled = threading.Event()

    def cancel() -> None:
        cancelled.set()
        box.wake()

    threading.Timer(0.05, cancel).start()
    started = time.monotonic()
    with pytest.raises(MailboxCancelled):
        box.get((1, "LABELS", 0), timeout=5, cancelled=cancelled)
    assert time.monotonic() - started < 2


def test_capacity_bounds_undelivered_items_of_one_step() -> None:
    box: Mailbox[int] = Mailbox(capacity=2)
    box.put((1, "ACTIVATION", 0), 0)
    box.put((1, "ACTIVATION", 1), 1)
    with pytest.raises(MailboxFull, match="2 undelivered tensors of step 1 are waiting, the limit is 2"):
        box.put((1, "ACTIVATION", 2), 2)
    box.put((1, "ACTIVATION", 1), 9)  # replacing needs no room
    box.put((2, "ACTIVATION", 0), 5)  # leftovers of another step make room
    assert len(box) == 1 and box.get((2, "ACTIVATION", 0), timeout=0) == 5


def test_retain_step_and_clear() -> None:
    box: Mailbox[int] = Mailbox(capacity=8)
    for step in (1, 2, 3):
        box.put((step, "ACTIVATION", 0), step)
    assert box.retain_step(2) == 2
    assert box.get((2, "ACTIVATION", 0), timeout=0) == 2
    box.put((4, "ACTIVATION", 0), 4)
    box.clear()
    assert len(box) == 0
