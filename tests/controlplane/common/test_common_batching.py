"""Batched calls (controlplane/common/batching.py): one run for the calls of one event-loop turn, a bounded number
of runs in flight, and every caller answered, or told of the failure."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.common.batching import Batched


def test_calls_of_one_turn_share_a_run_and_get_their_own_answers() -> None:
    runs: list[list[int]] = []

    async def double(keys: list[int]) -> list[int]:
        runs.append(keys)
        return [2 * k for k in keys]

    batched = Batched(double)

    async def main() -> list[int]:
        return await asyncio.gather(*(batched(k) for k in range(5)))

    assert asyncio.run(main()) == [0, 2, 4, 6, 8]
    assert runs == [[0, 1, 2, 3, 4]]


def test_calls_made_while_every_slot_is_busy_join_one_waiting_batch() -> None:
    runs: list[list[int]] = []
    release = asyncio.Event()
    in_flight = peak = 0

    async def slow(keys: list[int]) -> list[int]:
        nonlocal in_flight, peak
        runs.append(keys)
        in_flight += 1
        peak = max(peak, in_flight)
        await release.wait()
        in_flight -= 1
        return keys

    batched = Batched(slow, concurrency=2)

    async def main() -> list[int]:
        first = [asyncio.ensure_future(batched(k)) for k in (0, 1)]
        await asyncio.sleep(0.01)  # a turn later: a second run takes the other slot
        second = [asyncio.ensure_future(batched(k)) for k in (2, 3)]
        await asyncio.sleep(0.01)
        later = []
        for k in range(4, 10):  # over several turns, while both slots are busy
            later.append(asyncio.ensure_future(batched(k)))
            await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*first, *second, *later)

    assert asyncio.run(main()) == list(range(10))
    assert runs == [[0, 1], [2, 3], [4, 5, 6, 7, 8, 9]] and peak == 2


def test_a_failed_run_fails_each_of_its_callers_and_the_next_run_goes_on() -> None:
    async def fail_once(keys: list[str]) -> list[str]:
        if "bad" in keys:
            raise ConnectionError("the server went away")
        return keys

    batched = Batched(fail_once)

    async def main() -> tuple[list[object], str]:
        results = await asyncio.gather(batched("bad"), batched("ok"), return_exceptions=True)
        return results, await batched("again")

    results, again = asyncio.run(main())
    assert all(isinstance(r, ConnectionError) for r in results) and again == "again"


@pytest.mark.parametrize("concurrency", [1, 3])
def test_every_caller_is_answered_under_a_burst(concurrency: int) -> None:
    async def echo(keys: list[int]) -> list[int]:
        await asyncio.sleep(0.001)
        return keys

    batched = Batched(echo, concurrency=concurrency)

    async def main() -> list[int]:
        async def caller(k: int) -> int:
            await asyncio.sleep(k % 7 * 0.001)
            return await batched(k)

        return await asyncio.gather(*(caller(k) for k in range(2000)))

    assert asyncio.run(main()) == list(range(2000))
