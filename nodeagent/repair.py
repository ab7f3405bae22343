"""What a replica keeps of its step until the driver's next step commits the update (arceus/swarm/repair.py): per
micro-batch what it received, ran and sent (reported as arceus.swarm.holdings), every boundary tensor it computed
(an activation for the next stage, an input gradient for the previous one: sent or not, as encoded), the last
stage's losses, and its own partial gradient as it entered the exchange.

A step that lost replicas stops where it is on every survivor (the driver cancels it): the graphs of its forwards
and its accumulated gradient stay, its sends settle, and it waits here. The driver reads the survivors' holdings
(ReplicaService.Holdings), plans the repair and runs the step again under the same id with each survivor's
instructions: a survivor then re-sends the kept tensors they name, runs only the actions it has not done (the lost
replicas' micro-batches it took over among them), and exchanges its partial with the surviving members only; a
replica of a stage that lost no member, whose members all completed their exchange, keeps its reduced gradient and
exchanges nothing again. A retained step's audit evidence (nodeagent.step_audit) is held too: the repaired step's
reply signs for the whole step, what the survivor did before the loss included. Nothing here touches torch but
holding tensors."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from arceus.pipeline.schedule import Action
from arceus.swarm.holdings import NOTHING, Holding, StepHoldings
from arceus.wire.compression import Encoded

if TYPE_CHECKING:  # the step's audit is StepRun's (nodeagent.step); held here across its attempts
    from nodeagent.step_audit import StepAudit


class HeldStep:
    """One train step of a replica that exchanges its gradient every step, from its start until the next step
    commits it. `finished`: the step ran to its end (its update waits, deferred); `partial`: this replica's own
    gradient as it entered the exchange (None before), what a repair exchanges again."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.micro_batches: tuple[int, ...] = ()  # routed to this replica by the latest attempt's routes
        self.records: dict[int, Holding] = {}
        self.outputs: dict[int, Encoded] = {}
        self.input_gradients: dict[int, Encoded] = {}
        self.forward_sizes: dict[int, int] = {}
        self.results: dict[int, tuple[float, int, int]] = {}  # last stage: (loss sum, correct, samples)
        self.partial: torch.Tensor | None = None
        # The membership epoch whose reduced gradient it holds (its exchange completed among that epoch's members).
        self.exchanged_epoch: int | None = None
        self.finished = False
        self.audit: StepAudit | None = None  # every attempt's receipts and audit record of the step, as one
        self._lock = threading.Lock()  # sends are recorded from the push streams' threads

    def mark(self, micro_batch: int, **changes: bool | int) -> None:
        """This micro-batch's record with `changes` (Holding's fields) made."""
        with self._lock:
            self.records[micro_batch] = replace(self.records.get(micro_batch, NOTHING), **changes)

    def done(self, action: Action) -> bool:
        """Whether this replica already ran `action` in an earlier attempt of the step."""
        with self._lock:
            held = self.records.get(action.micro_batch)
            return held is not None and (held.forwarded if action.kind == "F" else held.backwarded)

    def output_sent(self, micro_batch: int, to: int) -> None:
        """The next stage's replica `to` accepted this micro-batch's activation."""
        self.mark(micro_batch, output_sent_to=to)

    def input_gradient_sent(self, micro_batch: int, to: int) -> None:
        """The previous stage's replica `to` accepted this micro-batch's input gradient."""
        self.mark(micro_batch, input_gradient_sent_to=to)

    def holdings(self, stage: int, replica: int, arrived: set[tuple[str, int]]) -> StepHoldings:
        """What this replica holds of its micro-batches: its records, with what waits unread in its mailbox
        (`arrived`: (kind, micro_batch) of the step) counted as received."""
        entries = {}
        with self._lock:
            for m in self.micro_batches:
                r = self.records.get(m, NOTHING)
                holding = replace(
                    r,
                    input_received=r.input_received or ("ACTIVATION", m) in arrived,
                    gradient_received=r.gradient_received or ("GRADIENT", m) in arrived,
                )
                if holding != NOTHING:
                    entries[(stage, replica, m)] = holding
        return StepHoldings(entries)
