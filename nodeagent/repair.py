"""What a replica keeps of its step until the driver's next step commits the update (arceus/swarm/repair.py): per
micro-batch what it received, ran and sent (reported as arceus.swarm.holdings), every boundary tensor it computed
(an activation for the next stage, an input gradient for the previous one: sent or not, as encoded), the last
stage's losses, and its own partial gradient as it entered the exchange.

A step that lost replicas stops where it is on every survivor (the driver cancels it): the graphs of its forwards
and its accumulated gradient stay, its sends settle, and it waits here. The driver reads the survivors' holdings
(ReplicaService.Holdings), plans the repair and runs the step again under the same id with each survivor's
instructions: a survivor then re-sends the kept tensors they name, runs only the actions it has not done (the lost
replicas' micro-batches it took over among them), and exchanges its partial with the surviving members only. Nothing
here touches torch but holding tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from arceus.pipeline.schedule import Action
from arceus.swarm.holdings import Holding, StepHoldings
from arceus.wire.compression import Encoded


@dataclass
class Record:
    """One micro-batch as this replica saw it (the mutable form of arceus.swarm.holdings.Holding)."""

    input_received: bool = False
    forwarded: bool = False
    output_sent_to: int | None = None
    gradient_received: bool = False
    backwarded: bool = False
    input_gradient_sent_to: int | None = None


class HeldStep:
    """One train step of a replica that exchanges its gradient every step, from its start until the next step
    commits it. `finished`: the step ran to its end (its update waits, deferred); `partial`: this replica's own
    gradient as it entered the exchange (None before), what a repair exchanges again."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.micro_batches: tuple[int, ...] = ()  # routed to this replica by the latest attempt's routes
        self.records: dict[int, Record] = {}
        self.outputs: dict[int, Encoded] = {}
        self.input_gradients: dict[int, Encoded] = {}
        self.forward_sizes: dict[int, int] = {}
        self.results: dict[int, tuple[float, int, int]] = {}  # last stage: (loss sum, correct, samples)
        self.partial: torch.Tensor | None = None
        self.finished = False
        self._lock = threading.Lock()  # sends are recorded from the push streams' threads

    def record(self, micro_batch: int) -> Record:
        with self._lock:
            return self.records.setdefault(micro_batch, Record())

    def done(self, action: Action) -> bool:
        """Whether this replica already ran `action` in an earlier attempt of the step."""
        with self._lock:
            held = self.records.get(action.micro_batch)
            return held is not None and (held.forwarded if action.kind == "F" else held.backwarded)

    def output_sent(self, micro_batch: int, to: int) -> None:
        """The next stage's replica `to` accepted this micro-batch's activation."""
        with self._lock:
            self.records.setdefault(micro_batch, Record()).output_sent_to = to

    def input_gradient_sent(self, micro_batch: int, to: int) -> None:
        """The previous stage's replica `to` accepted this micro-batch's input gradient."""
        with self._lock:
            self.records.setdefault(micro_batch, Record()).input_gradient_sent_to = to

    def holdings(self, stage: int, replica: int, arrived: set[tuple[str, int]]) -> StepHoldings:
        """What this replica holds of its micro-batches: its records, with what waits unread in its mailbox
        (`arrived`: (kind, micro_batch) of the step) counted as received."""
        entries = {}
        with self._lock:
            for m in self.micro_batches:
                r = self.records.get(m, Record())
                holding = Holding(
                    input_received=r.input_received or ("ACTIVATION", m) in arrived,
                    forwarded=r.forwarded,
                    output_sent_to=r.output_sent_to,
                    gradient_received=r.gradient_received or ("GRADIENT", m) in arrived,
                    backwarded=r.backwarded,
                    input_gradient_sent_to=r.input_gradient_sent_to,
                )
                if holding != Holding():
                    entries[(stage, replica, m)] = holding
        return StepHoldings(entries)
