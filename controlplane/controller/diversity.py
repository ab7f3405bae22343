"""Owner diversity: by default no single owner holds every stage of a job (with replicas: a replica of every stage;
and so the whole model: contributors see only part of it). A job opts out with `requirements.owner_diversity: false`.
Pure: the reconciler's rules and the estimate both place through `diverse_placement`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from arceus.placement.solver import Placement, PlacementError
from controlplane.controller.views import NodeView

OPT_OUT = "or submit it with requirements.owner_diversity false"
# Each search that found one owner holding everything is followed by one with fewer of that owner's nodes; past this
# many, the job waits (each search has the solver's time budget).
MAX_SEARCHES = 4


class OwnerDiversityError(PlacementError):
    """The market offers no placement in which no single owner holds every stage; the message says why."""


def owner_of_every_stage(rows: Iterable[tuple[int, int, str]], owners: Mapping[str, str]) -> str | None:
    """The owner who holds a whole copy of every stage, if one does: `rows` are (stage index, replica, node id) of
    every rank of every replica of a job's stages; a copy is whole when one owner holds all of its ranks."""
    copies: dict[tuple[int, int], set[str]] = defaultdict(set)
    for index, replica, node_id in rows:
        copies[index, replica].add(owners[node_id])
    holders: dict[int, set[str]] = defaultdict(set)
    for (index, _), held in copies.items():
        holders[index] |= held if len(held) == 1 else set()
    common = set.intersection(*holders.values()) if holders else set()
    return min(common) if common else None


def diverse_placement(
    candidates: Sequence[NodeView], fewest: int, most: int | None,
    solve_on: Callable[[Sequence[NodeView], int], Placement],
) -> Placement:
    """The solver's placement on `candidates` (fastest first), `solve_on(nodes, min_stages)`, in which no single
    owner holds every stage. When its best holds them all, it searches again with that owner's slowest node among
    them left out and at least two stages, until another owner takes a part. A PlacementError of the first search is
    the job's own (no placement at all); OwnerDiversityError: the market cannot satisfy the rule now."""
    owners = {n.id: n.owner for n in candidates}
    nodes, least = list(candidates), fewest
    for search in range(MAX_SEARCHES):
        try:
            placement = solve_on(nodes, least)
        except PlacementError as exc:
            if search == 0:
                raise  # the job's own: no placement at all
            raise OwnerDiversityError(f"no placement keeps every stage from a single owner ({exc}); {OPT_OUT}") from exc
        used = [node_id for stage in placement.stages for node_id in stage.device_ids]
        owner = owner_of_every_stage(
            [(index, 0, node_id) for index, stage in enumerate(placement.stages) for node_id in stage.device_ids],
            owners,
        )
        if owner is None:
            return placement
        if len(set(owners.values())) < 2:
            raise OwnerDiversityError(
                f"every free Ready node meeting its requirements ({len(candidates)}) belongs to one owner, and no "
                f"single owner may hold every stage of a job: waiting for another owner's node, {OPT_OUT}"
            )
        if most is not None and most < 2:
            raise OwnerDiversityError(
                f"a job of one stage is held whole by its node's owner: ask for 2 stages or more, {OPT_OUT}"
            )
        theirs = [n.id for n in nodes if n.owner == owner][: len(used) - 1]  # their fastest, one fewer than it used
        nodes, least = [n for n in nodes if n.owner != owner or n.id in theirs], max(least, 2)
    raise OwnerDiversityError(
        f"no placement keeping every stage from a single owner was found in {MAX_SEARCHES} searches; {OPT_OUT}"
    )
