"""`fences_counted`: how often a replica was fenced within its window of train steps (what the reconciler's rule
for a replica fenced too often reads)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.driver.progress import fences_counted


@given(steps=st.lists(st.integers(0, 500), min_size=1, max_size=12), window=st.integers(1, 100))
def test_the_count_is_the_fences_since_the_window_opened_and_the_fence_lies_in_it(
    steps: list[int], window: int
) -> None:
    """Folded over any fences, the count is those since the fence that opened the window (the first, or the first
    outside the window before it), which the window starts at."""
    fences, since, opened = 0, None, 0
    for k, step in enumerate(steps):
        fences, since = fences_counted(fences, since, step, window)
        if not steps[opened] <= step < steps[opened] + window:
            opened = k
        assert since == steps[opened] <= step < since + window
        assert 1 <= fences == k + 1 - opened


@given(first=st.integers(0, 500), gaps=st.lists(st.integers(0, 9), max_size=8), window=st.integers(10, 100))
def test_fences_within_one_window_add_up_and_one_outside_opens_a_new_window(
    first: int, gaps: list[int], window: int
) -> None:
    fences, since, step = fences_counted(0, None, first, window) + (first,)
    for gap in gaps:
        if step + gap >= first + window:
            break
        step += gap
        fences, since = fences_counted(fences, since, step, window)
    assert since == first
    assert fences_counted(fences, since, first + window, window) == (1, first + window)
    if first > 0:  # a step before the window (the job went back to a checkpoint)
        assert fences_counted(fences, since, first - 1, window) == (1, first - 1)
