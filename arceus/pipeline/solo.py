"""Which schedule actions run while every other stage of the pipeline waits.

Stages that share one machine each compute on their share of its cores. In the pipeline's fill and
drain (GPipe's first forward, 1F1B's last backward, ...) one stage computes while the others wait for
what it sends them, and their cores idle: such an action may borrow them. Stage s's action `a` is *solo*
when every forward and backward of every other stage either has ended before `a` starts or cannot start
before `a` ends, because the tensors the stages pass each other order it after `a`.

What must have ended follows from the schedule alone (the actions `a` waits for, transitively); a stage
also learns of more at run time, from the tensors that have reached it (their producers, and everything
those waited for, are done). Optimizer steps are not counted: each runs after its stage's last action
and may overlap a neighbour's last backward (it is short). A stage's own optimizer step is solo when
every other stage's actions precede it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from arceus.pipeline.schedule import Action, Schedule, build_schedule


class SoloPlanner:
    """The order the tensors impose on one schedule's actions, and the solo test on it."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._offsets = [sum(len(actions) for actions in schedule[:s]) for s in range(len(schedule))]
        self._position = [{a: i for i, a in enumerate(actions)} for actions in schedule]
        self._before = self._ancestors()

    def solo(self, stage: int, index: int, arrived: Iterable[Action] = ()) -> bool:
        """True if no other stage can compute while `stage` runs its action `index`. `arrived`: the
        neighbours' actions whose output has reached `stage` (a forward of stage-1, a backward of
        stage+1): they are done."""
        done = self._before[stage][index]
        for action in arrived:
            source = stage - 1 if action.kind == "F" else stage + 1
            j = self._position[source][action]
            done |= self._before[source][j] | self._bit(source, j)
        me = self._bit(stage, index)
        # Stage t runs in order, so its done actions are a prefix of its list; the first after it, if
        # any, must wait for `a` (and so must every later one).
        return all(
            (k := self._prefix_length(t, done)) == len(self.schedule[t]) or self._before[t][k] & me != 0
            for t in range(len(self.schedule))
            if t != stage
        )

    def solo_optimizer_step(self, stage: int) -> bool:
        """True if every action of every other stage ends before `stage`'s optimizer step, which comes
        after its last action."""
        if not self.schedule[stage]:
            return True
        last = len(self.schedule[stage]) - 1
        done = self._before[stage][last] | self._bit(stage, last)
        return all(
            self._prefix_length(t, done) == len(self.schedule[t]) for t in range(len(self.schedule)) if t != stage
        )

    def _bit(self, stage: int, index: int) -> int:
        return 1 << (self._offsets[stage] + index)

    def _prefix_length(self, stage: int, actions: int) -> int:
        """How many of `stage`'s actions the bit set `actions` holds."""
        return ((actions >> self._offsets[stage]) & ((1 << len(self.schedule[stage])) - 1)).bit_count()

    def _ancestors(self) -> list[list[int]]:
        """For every action, the bit set of the actions that must end before it starts: its stage's
        earlier actions; for F(m) stage s-1's F(m); for B(m) stage s+1's B(m), or on the last stage its
        own F(m). Computed in an order in which every stage runs its list (schedules never deadlock)."""
        schedule, n = self.schedule, len(self.schedule)
        before: list[list[int]] = [[0] * len(actions) for actions in schedule]
        cursor = [0] * n
        while any(cursor[s] < len(schedule[s]) for s in range(n)):
            progressed = False
            for s in range(n):
                i = cursor[s]
                if i == len(schedule[s]):
                    continue
                action = schedule[s][i]
                inputs = [(s, i - 1)] if i else []
                if action.kind == "F" and s > 0:
                    inputs.append((s - 1, self._position[s - 1][action]))
                elif action.kind == "B" and s < n - 1:
                    inputs.append((s + 1, self._position[s + 1][action]))
                elif action.kind == "B":
                    inputs.append((s, self._position[s][Action("F", action.micro_batch)]))
                if any(cursor[t] <= j for t, j in inputs):
                    continue  # an input is not computed yet
                for t, j in inputs:
                    before[s][i] |= before[t][j] | self._bit(t, j)
                cursor[s] += 1
                progressed = True
            if not progressed:
                raise ValueError("the schedule deadlocks: some stage waits for an input no stage produces")
        return before


def solo_actions(schedule: Schedule, stage: int) -> list[bool]:
    """For each action of `stage`, in its order: True if no other stage can compute while it runs,
    whatever each action takes."""
    planner = SoloPlanner(schedule)
    return [planner.solo(stage, i) for i in range(len(schedule[stage]))]


@cache
def solo_planner(name: str, num_stages: int, num_micro_batches: int, train: bool) -> SoloPlanner:
    """The planner of a named schedule (what a running step asks, once per step)."""
    return SoloPlanner(build_schedule(name, num_stages, num_micro_batches, train))
