"""What each replica holds and did in the step in progress, per micro-batch: the facts a repair plans from.

A replica keeps every boundary tensor it sent (activations downstream, input gradients upstream) until the
step commits, and records per micro-batch what it received, what it ran and whom it sent to. When it
stalls on a lost peer it reports these (`StepHoldings`, JSON on the wire) once none of its sends is in
flight; the driver's repair (arceus.swarm.repair) decides from them what is re-sent and what recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from arceus.errors import SpecError
from arceus.swarm.json_fields import array, boolean, exact_object, integer, optional_integer

HoldingKey = tuple[int, int, int]  # (stage, replica id, micro-batch)


@dataclass(frozen=True)
class Holding:
    """One replica's record of one micro-batch. `*_sent_to`: the replica its last completed send of that
    tensor reached (None: never sent, or the send failed). For stage 0 the input comes from the driver;
    the last stage has no gradient to receive and stage 0 no input gradient to send."""

    input_received: bool = False
    forwarded: bool = False
    output_sent_to: int | None = None
    gradient_received: bool = False
    backwarded: bool = False
    input_gradient_sent_to: int | None = None

    def __post_init__(self) -> None:
        for needs, what, because in (
            (self.forwarded, self.input_received, "forwarded without its input received"),
            (self.output_sent_to is not None, self.forwarded, "an output sent without a forward"),
            (self.backwarded, self.forwarded, "backwarded without a forward"),
            (self.input_gradient_sent_to is not None, self.backwarded, "an input gradient sent without a backward"),
        ):
            if needs and not what:
                raise SpecError("holding", f"inconsistent record: {because}")


NOTHING = Holding()


class StepHoldings(Mapping[HoldingKey, Holding]):
    """Holdings of one or more replicas, by (stage, replica, micro-batch); a micro-batch a replica has no
    record of is `NOTHING` (`of`). Equal when they hold the same records."""

    def __init__(self, entries: Mapping[HoldingKey, Holding] | None = None) -> None:
        self._entries = dict(entries or {})
        for key in self._entries:
            if len(key) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in key):
                raise ValueError(f"a holding's key is (stage, replica, micro_batch) of non-negative ints, got {key}")

    def __getitem__(self, key: HoldingKey) -> Holding:
        return self._entries[key]

    def __iter__(self) -> Iterator[HoldingKey]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"StepHoldings({dict(sorted(self._entries.items()))})"

    def of(self, stage: int, replica: int, micro_batch: int) -> Holding:
        return self._entries.get((stage, replica, micro_batch), NOTHING)

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"stage": s, "replica": r, "micro_batch": m, **{f.name: getattr(h, f.name) for f in fields(Holding)}}
            for (s, r, m), h in sorted(self._entries.items())
        ]

    @classmethod
    def from_json(cls, data: Any, field: str = "holdings") -> StepHoldings:
        """Parse `to_json`'s form strictly: a SpecError names the record and field that are wrong; a
        micro-batch recorded twice is an error."""
        keys = ("stage", "replica", "micro_batch", *(f.name for f in fields(Holding)))
        entries: dict[HoldingKey, Holding] = {}
        for j, item in enumerate(array(data, field)):
            at = f"{field}[{j}]"
            record = exact_object(item, at, keys)
            key = (
                integer(record["stage"], f"{at}.stage"),
                integer(record["replica"], f"{at}.replica"),
                integer(record["micro_batch"], f"{at}.micro_batch"),
            )
            if key in entries:
                raise SpecError(at, f"stage {key[0]} replica {key[1]} micro-batch {key[2]} is recorded twice")
            values = {
                f.name: (optional_integer if f.name.endswith("_sent_to") else boolean)(record[f.name], f"{at}.{f.name}")
                for f in fields(Holding)
            }
            try:
                entries[key] = Holding(**values)
            except SpecError as exc:
                raise SpecError(at, exc.message) from None
        return cls(entries)
