"""What a replica keeps of its step for a repair (nodeagent/repair.py): its records become the holdings the driver
plans from, a tensor waiting unread in its mailbox counts as received, only the micro-batches its latest routes give
it are reported, and what it already ran is skipped when the step resumes."""

from __future__ import annotations

import threading

from arceus.pipeline.schedule import Action
from arceus.swarm.holdings import Holding, StepHoldings
from nodeagent.repair import HeldStep


def test_the_holdings_are_the_records_with_the_unread_arrivals_counted_as_received() -> None:
    held = HeldStep(7)
    held.micro_batches = (0, 2, 3)
    held.mark(0, input_received=True, forwarded=True, gradient_received=True, backwarded=True)
    held.output_sent(0, 1)
    held.input_gradient_sent(0, 0)
    held.mark(2, input_received=True, forwarded=True)
    held.mark(5, input_received=True, forwarded=True)  # a micro-batch the latest routes no longer give it: not reported
    arrived = {("GRADIENT", 2), ("ACTIVATION", 3), ("ACTIVATION", 4)}
    assert held.holdings(1, 2, arrived) == StepHoldings({
        (1, 2, 0): Holding(True, True, 1, True, True, 0),
        (1, 2, 2): Holding(input_received=True, forwarded=True, gradient_received=True),
        (1, 2, 3): Holding(input_received=True),
    })
    assert held.holdings(1, 2, set()).of(1, 2, 3) == Holding()  # nothing of it here: not reported at all
    assert len(held.holdings(1, 2, set())) == 2


def test_what_it_ran_is_done_and_sends_recorded_from_other_threads_land_in_its_records() -> None:
    held = HeldStep(1)
    for m in range(50):
        held.mark(m, input_received=True, forwarded=True)
    assert held.done(Action("F", 4)) and not held.done(Action("B", 4)) and not held.done(Action("F", 50))
    threads = [threading.Thread(target=held.output_sent, args=(m, m % 2)) for m in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {m: held.records[m].output_sent_to for m in range(50)} == {m: m % 2 for m in range(50)}
