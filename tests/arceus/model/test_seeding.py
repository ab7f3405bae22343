"""A training forward's draws (arceus/model/seeding.py) depend on their seed alone, whatever else draws at once."""

from __future__ import annotations

import threading

import torch

from arceus.model.seeding import seeded_draws

CPU = torch.device("cpu")


def test_seeded_draws_on_two_threads_at_once_draw_what_each_draws_alone() -> None:
    """Two threads (an agent's stages, a sibling's recompute beside a step, agents sharing a process) drawing under
    their own seeds again and again: every draw is the one its seed gives alone, bit for bit; and the generator
    outside is as if nothing had drawn."""
    alone = {seed: _draw(seed) for seed in (1, 2)}
    torch.manual_seed(5)
    outside = torch.rand(3)
    torch.manual_seed(5)
    wrong: list[int] = []

    def draw(seed: int) -> None:
        for _ in range(300):
            if not torch.equal(_draw(seed), alone[seed]):
                wrong.append(seed)

    threads = [threading.Thread(target=draw, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, f"{len(wrong)} of 600 draws were not their seed's"
    assert torch.equal(torch.rand(3), outside)


def _draw(seed: int) -> torch.Tensor:
    with seeded_draws(seed, CPU):
        first = torch.rand(64)
        return torch.cat([first, torch.nn.functional.dropout(torch.ones(256), 0.5)])
