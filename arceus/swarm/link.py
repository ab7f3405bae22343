"""A link's timing rule, shared by the userspace shaper (devtools/shaper.py), which delays real bytes by it,
and the swarm's performance model (arceus/swarm/model.py), which predicts with it."""

from __future__ import annotations

from dataclasses import dataclass, field

BURST_BYTES = 16 * 1024  # what an idle link lets through at once (the shaper reads in chunks of this size)


@dataclass
class LinkPlan:
    """When each chunk sent into one direction of a link arrives at the other end.

    A token bucket of `burst_bytes` filled at `rate_bps` (as tc's tbf; in GCRA form, `_tat` is when the
    bucket would be full again) decides when a chunk leaves; it arrives `delay_s` later. Chunks leave in
    order, so arrivals never reorder."""

    delay_s: float
    rate_bps: float
    burst_bytes: int = BURST_BYTES
    _tat: float = field(default=float("-inf"), init=False)  # when the bucket is full again

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.rate_bps <= 0 or self.burst_bytes <= 0:
            raise ValueError("delay_s must be >= 0, rate_bps and burst_bytes > 0")

    def arrival(self, now: float, nbytes: float) -> float:
        """The time (same clock as `now`) at which `nbytes` handed to the link at `now` have arrived."""
        cost = nbytes * 8 / self.rate_bps  # seconds of link time the chunk takes
        tat = max(self._tat, now)
        # The chunk may leave once the bucket holds nbytes of tokens, i.e. tat - burst_time + cost <= t.
        leave = max(now, tat + cost - self.burst_bytes * 8 / self.rate_bps)
        self._tat = tat + cost
        return leave + self.delay_s  # `now` and `_tat` only grow, so arrivals keep the chunks' order
