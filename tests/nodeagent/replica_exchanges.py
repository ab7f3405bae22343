"""Replicas of one stage exchanging at once in the test process (the harness of the exchange tests, direct and
through a relay): each replica's `ReplicaExchange.exchange` in a thread of its own, over real streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from arceus.v1 import stage_pb2
from nodeagent.replicas import ReplicaExchange


def port(exchange: ReplicaExchange) -> int:
    """Where `exchange`'s agent listens for its siblings' streams."""
    return exchange._wire.port


def exchange_together(
    exchanges: dict[int, ReplicaExchange],
    partials: dict[int, torch.Tensor],
    *,
    peer_of: Callable[[int], stage_pb2.ReplicaPeer],
    port_of: Callable[[int], int] | None = None,
    options: Callable[[int], dict[str, Any]] = lambda _k: {},
    seconds: float = 30.0,
    step: int = 1,
) -> tuple[dict[int, torch.Tensor], dict[int, BaseException]]:
    """Every replica of `exchanges` sums its partial with its siblings' at once (epoch 0) within `seconds`;
    `peer_of(k)`: replica k as the step names it; `port_of`: where siblings' listeners are (by default their own
    listeners' ports); `options(k)`: replica k's other arguments of ReplicaExchange.exchange. Their sums and their
    errors."""
    members = tuple(sorted(exchanges))
    results: dict[int, torch.Tensor] = {}
    errors: dict[int, BaseException] = {}

    def run(k: int) -> None:
        try:
            results[k] = exchanges[k].exchange(
                partials[k],
                step=step,
                epoch=0,
                members=members,
                peers={j: peer_of(j) for j in members if j != k},
                port_of=port_of or (lambda j: port(exchanges[j])),
                deadline=time.monotonic() + seconds,
                abort=threading.Event(),
                **options(k),
            )
        except BaseException as exc:
            errors[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * seconds)
    return results, errors
