"""Repairing a step that lost replicas, without rewinding: the plan the driver sends the survivors.

Only the lost replicas' micro-batches move, each to a surviving member of its stage, which computes it
anew (forward and backward: the lost replica's partial gradient is gone with it). Every other boundary
tensor is where it was or is re-sent from the neighbour that kept it, and never to a replica that already
holds it, so each micro-batch counts once in each stage's gradient and no stage without a loss recomputes
anything; such a stage whose members all completed their gradient exchange keeps it (`keep_exchange`): only
the stages whose membership changed exchange again. A stage that lost every replica cannot be repaired: the
plan says rewind (the job's checkpoint).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from arceus.swarm.holdings import Holding, StepHoldings
from arceus.swarm.json_fields import boolean, exact_object, integers, pairs
from arceus.swarm.routing import Routes, Speeds, reroute

# The repair's interface: what it plans from (the survivors' holdings) and what it plans.
__all__ = ["Holding", "RepairPlan", "ReplicaInstructions", "StepHoldings", "repair_step"]


@dataclass(frozen=True)
class ReplicaInstructions:
    """What one survivor does on resuming: it runs the new routes' list, skipping what it did, and
    recompute: the lost micro-batches it takes over and computes anew (forward and backward);
    resend_outputs / resend_input_gradients: (micro_batch, to_replica) of kept tensors to push again;
    skip_output / skip_input_gradient: micro-batches still to run whose activation (downstream) or input
    gradient (upstream) the neighbour already holds from a lost replica, so the run keeps it unsent.
    keep_exchange: its stage lost no member and every member completed its exchange: the reduced gradient it
    holds stands, and it exchanges nothing again. A replica keeps every tensor it computes, sent or not, until
    commit; a later plan's instructions replace an earlier one's."""

    recompute: tuple[int, ...] = ()
    resend_outputs: tuple[tuple[int, int], ...] = ()
    resend_input_gradients: tuple[tuple[int, int], ...] = ()
    skip_output: tuple[int, ...] = ()
    skip_input_gradient: tuple[int, ...] = ()
    keep_exchange: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: v if isinstance(v := getattr(self, f.name), bool) else [list(e) if isinstance(e, tuple) else e
                                                                          for e in v]
            for f in fields(self)
        }

    @classmethod
    def from_json(cls, data: Any, field: str = "repair") -> ReplicaInstructions:
        names = tuple(f.name for f in fields(cls))
        data = exact_object(data, field, names)
        parse = {n: boolean if n == "keep_exchange" else pairs if n.startswith("resend") else integers for n in names}
        return cls(**{n: parse[n](data[n], f"{field}.{n}") for n in names})


@dataclass(frozen=True)
class RepairPlan:
    """epoch: the step's new membership epoch (every message of the old one is refused); routes: the new
    routes (lost members removed); instructions: for every surviving member; driver_repush_inputs /
    driver_repush_labels: (micro_batch, replica) the driver pushes again to stage 0 / the last stage.
    rewind: a stage lost every replica (`rewind_stages`), and nothing else in the plan applies."""

    epoch: int
    routes: Routes
    instructions: Mapping[tuple[int, int], ReplicaInstructions]
    driver_repush_inputs: tuple[tuple[int, int], ...]
    driver_repush_labels: tuple[tuple[int, int], ...]
    rewind: bool
    rewind_stages: tuple[int, ...]


def repair_step(
    routes: Routes, lost: Iterable[tuple[int, int]], holdings: StepHoldings, speeds: Speeds, epoch: int,
    exchanged: Collection[tuple[int, int]] = (),
) -> RepairPlan:
    """Plan the repair of the step running on `routes` at `epoch` that lost the (stage, replica)s `lost`.
    `holdings`: every survivor's, once each waits with no send in flight (a lost replica's are ignored);
    `speeds` share the moved micro-batches (arceus.swarm.routing.reroute); `exchanged`: the survivors holding
    the reduced gradient of `epoch`'s members. A stage that lost no member and whose every member is in
    `exchanged` keeps its exchange: only the stages whose membership changed exchange again. Nothing `lost` (a
    failure between live replicas) resumes the step with every member under the new epoch: nothing is recomputed,
    what did not arrive is sent again, and the stages whose exchange did not complete everywhere exchange again."""
    lost = set(lost)
    for stage, replica in sorted(lost):
        if not 0 <= stage < routes.num_stages or replica not in routes.members[stage]:
            raise ValueError(f"stage {stage} replica {replica} is lost but is not a member of the step")
    dead = tuple(i for i, ids in enumerate(routes.members) if all((i, k) in lost for k in ids))
    if dead:
        return RepairPlan(epoch + 1, routes, {}, (), (), rewind=True, rewind_stages=dead)
    kept = StepHoldings({key: h for key, h in holdings.items() if key[:2] not in lost})
    for stage, replica, m in kept:
        if m >= routes.num_micro_batches or routes.of[m][stage] != replica:
            raise ValueError(f"stage {stage} replica {replica} reports micro-batch {m}, which is not routed to it")
    new = reroute(routes, lost, speeds)
    moved = {(i, m) for m, route in enumerate(routes.of) for i, r in enumerate(route) if (i, r) in lost}
    settled = {i for i, ids in enumerate(routes.members)
               if all((i, k) not in lost and (i, k) in exchanged for k in ids)}
    instructions = {
        (i, r): _instructions(i, r, new, moved, kept, keep_exchange=i in settled)
        for i, ids in enumerate(new.members) for r in ids
    }
    last, ms = routes.num_stages - 1, range(routes.num_micro_batches)
    return RepairPlan(
        epoch=epoch + 1,
        routes=new,
        instructions=instructions,
        driver_repush_inputs=tuple((m, new.of[m][0]) for m in ms if (0, m) in moved),
        driver_repush_labels=tuple((m, new.of[m][last]) for m in ms if (last, m) in moved),
        rewind=False,
        rewind_stages=(),
    )


def _instructions(
    stage: int, replica: int, new: Routes, moved: set[tuple[int, int]], kept: StepHoldings, *, keep_exchange: bool
) -> ReplicaInstructions:
    last = new.num_stages - 1
    mine = new.micro_batches_of(stage, replica)
    resend_outputs, resend_input_gradients, skip_output, skip_input_gradient = [], [], [], []
    for m in mine:
        held = kept.of(stage, replica, m)
        if stage < last:
            to = new.of[m][stage + 1]
            there = held.output_sent_to == to or kept.of(stage + 1, to, m).input_received
            if held.forwarded and not there:
                resend_outputs.append((m, to))  # kept, and its destination changed to one without it
            elif not held.forwarded and there:
                skip_output.append(m)  # a forward of a lost replica's micro-batch the neighbour already used
        if stage > 0:
            to = new.of[m][stage - 1]
            there = held.input_gradient_sent_to == to or kept.of(stage - 1, to, m).gradient_received
            if held.backwarded and not there:
                resend_input_gradients.append((m, to))
            elif not held.backwarded and there:
                skip_input_gradient.append(m)
    return ReplicaInstructions(
        recompute=tuple(m for m in mine if (stage, m) in moved),
        resend_outputs=tuple(resend_outputs),
        resend_input_gradients=tuple(resend_input_gradients),
        skip_output=tuple(skip_output),
        skip_input_gradient=tuple(skip_input_gradient),
        keep_exchange=keep_exchange,
    )
