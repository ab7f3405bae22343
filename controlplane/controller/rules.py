"""The reconciler's decisions: a pure `plan(desired, observed, now) -> [Action]` over plain snapshots.

Level-triggered: every pass looks at the whole state afresh and trusts nothing from earlier passes.
Each action names the generation (and status) it was decided on; the executor applies it only if the
row still has them, so two passes planning from the same snapshot can never both win.

Rules, in order:
0. facts that services recorded at an active job's generation (`_recorded_facts`): failed spot checks →
   RollBackJob; the driver's outcome → SucceedJob or FailJob; a node whose agent restarted while hosting a stage →
   RewindJob counted as a restart (FailJob once the restarts run out);
0b. a placed job past its `deadline`, or whose charges with the time its nodes hold it until it could stop
   (`JobView.stop_seconds`) would reach its `max_total_usd` (`_limits`): a live driver is first asked to checkpoint
   where it is and let go (RequestHandover, a Stopping condition saying why), then FailJob with the reason
   (DeadlineExceeded, BudgetExhausted), its model kept in that checkpoint;
1. a registered node whose lease expired (no heartbeat for longer than its duration) → MarkNodeUnknown;
2. a queued job → PlaceJob on free Ready nodes that meet its requirements (one stage per node, one
   active job per node), devices and cut points chosen by `arceus.placement.solver.solve` (fastest
   pipeline, cheaper devices among near-equals, within the job's budget); a tensor-parallel stage gets
   a group of distinct nodes, one placed row per rank; unless the job opts out, no single owner holds every
   stage (`controlplane/controller/diversity.py`); too few nodes, too few owners or no feasible placement → a
   Placed=False condition saying why;
3. a placed job (placing, pending or running) with stage ranks whose node is lost (silent longer than
   the job's tolerance, or the node's lease) or paused by its owner → RewindJob moving only those ranks
   to free Ready nodes with room (not leaving one owner holding every stage, unless the job opts out); if
   some cannot be moved, they are unplaced and the job waits as pending. A running job's live driver is
   first asked to checkpoint where it is and let go (RequestHandover), so a paused node's stage moves
   without losing work. A tensor-parallel group keeps its healthy ranks: the rewind's new generation makes
   every rank rebuild from the unsplit checkpoint with the group's new peer list anyway, so re-forming it
   needs only the lost rank's node. A pass rewinds at most `guard.max_moves` jobs to move (or unplace) lost
   stages, oldest first (ARCEUS_MAX_MOVES_PER_PASS; a pending job's stages placed again count too), and none while
   more than `guard.disruption_threshold` of the nodes hosting stages of active jobs are silent at once (at least
   `guard.disruption_min_nodes` of them: ARCEUS_DISRUPTION_THRESHOLD, ARCEUS_DISRUPTION_MIN_NODES): the control
   plane or its network is then the likelier fault (`controlplane/controller/moves.py`, as Kubernetes' node
   lifecycle controller). A job held so keeps its nodes, its Placed condition Unknown saying why (MovesDeferred,
   NodesDisrupted; NodesBack once its nodes answer and nothing else is to do), and the pass ends with MovesHeld;
   stages moved off paused nodes alone (NodeDrained) and dropped replicas (no rewind) are neither counted nor held;
4. a placing job: a stage reports failure (its node could not build it) → RewindJob moving that stage to
   the fastest free node with room, counted as a restart (so a failure that follows the stage from node
   to node fails the job once the restarts run out), or FailJob when no other node can take it; every
   stage reports ready at the job's generation → StartDriver; else a StagesReady=False condition;
5. a running job whose driver lease expired: never claimed → StartDriver again; claimed (the driver
   died or gave up) → once every stage's node heartbeated since (else it waits: a node whose agent died with the
   driver's call counts lost soon, and rule 3 moves its stage in the one rewind) RewindJob in place, or FailJob
   after too many restarts without progress;
A replicated job (`JobView.replicated`, arceus/swarm) is placed with `replicas_min` replicas of each stage on
distinct nodes (rule 2); while a replica of a stage that holds its state lives (a joiner still copying it holds
none), its others that are lost, paused, restarted or failed are dropped (DropReplicas: no rewind, the driver's roster
goes on without them), and a stage that lost every such replica, in one pass or over several, keeps one row: a live
joiner, which a rewind rebuilds from the checkpoint where it is (ReplicasLost), else a gone replica, which rules 0, 3
and 4 move with a rewind as any stage's (each move names its replica, so a sibling of the same stage rank keeps its
node); a running job with no replica to
drop gets one more replica per stage (AddReplicas, at most `replicas_max` and `micro_batches`) on a free node with
room: up to `replicas_min` the fastest, always; beyond it the cheapest for which `arceus.swarm.model.replica_gain`
predicts at least MIN_REPLICA_GAIN more samples/s (each node at its speed for the job: measured where the driver
timed it, else calibrated by the timed ones, controlplane/controller/calibration.py), within the job's price cap; a
node a replica of the job was dropped from is no candidate for the job's stages (grown or moved) until it heartbeats
after the drop. A replica the driver fenced `max_fences` times within its window of steps (failed steps between live
replicas keep coming back to it) is dropped while it is fenced and its stage keeps a replica that trains (never the
last: DropReplicas, ReplicaFencedOut), and its node takes none of the job's replicas for `fenced_out_seconds`; a
replica then grows on another node as after any drop. No stage of a job is moved or added onto a node the job
would count lost (silent past its `node_grace_seconds`, though within the node's longer lease: the node a lost stage
just left);
6. a succeeded job its owner asked to serve (`JobView.serving`) → ServeJob placing its final checkpoint's
   stages for inference, one whole stage per node (no tensor parallelism, no optimizer: weights and decoding
   caches, `stage_inference_memory`), each on the fastest free node with room; a stage whose node is lost or
   paused moves the same way (the others keep theirs); with no room for every stage → StopServing releases
   what it holds and the Serving condition says what it waits for; a stage its node could not build →
   StopServing, asked no more; every stage ready → Serving=True; a served job no longer asked for → StopServing.
Every RewindJob bumps the generation, so all stages rebuild from the job's last checkpoint.
Jobs are considered oldest first; a job that cannot be placed does not hold back a later one. At most
`max_placements` queued jobs are searched a placement for per pass (ARCEUS_MAX_PLACEMENTS_PER_PASS).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from arceus.contracts.observed import ObservedState
from arceus.contracts.status import ACTIVE_STATUSES, JobStatus
from arceus.placement.solver import (
    DECODE_SESSIONS,
    MAX_CANDIDATES,
    PRICE_ROUNDING,
    Budget,
    LayerProfile,
    Placement,
    PlacementError,
    Workload,
    placed_stage_memory,
    smallest_stage_memory,
    solve,
    stage_inference_memory,
)
from arceus.swarm.model import Workload as SwarmWorkload
from arceus.swarm.model import replica_gain
from controlplane.common.conditions import (
    FALSE,
    TRUE,
    UNKNOWN,
    Condition,
    get_condition,
    has_condition,
    set_conditions,
)
from controlplane.controller.actions import (
    Action,
    AddReplicas,
    DropReplicas,
    FailJob,
    MarkNodeUnknown,
    MovesHeld,
    PlaceJob,
    PlannedStage,
    RequestHandover,
    RequeueJob,
    RewindJob,
    RollBackJob,
    ServeJob,
    SetCondition,
    StartDriver,
    StopServing,
    SucceedJob,
)
from controlplane.controller.calibration import Calibration, calibration
from controlplane.controller.diversity import OPT_OUT, OwnerDiversityError, diverse_placement, owner_of_every_stage
from controlplane.controller.moves import MOVES_DEFERRED, NODES_DISRUPTED, MoveGuard, Moves
from controlplane.controller.views import (
    Desired,
    JobView,
    NodeView,
    Observed,
    PlacedStage,
    Requirements,
    StageReport,
    stage_bounds,
)
from controlplane.market.services import MICROS_PER_DOLLAR
from controlplane.nodes.labels import node_label

QUEUED, PLACING, PENDING, RUNNING = JobStatus.QUEUED, JobStatus.PLACING, JobStatus.PENDING, JobStatus.RUNNING
SUCCEEDED = JobStatus.SUCCEEDED
READY, FAILED = ObservedState.READY, ObservedState.FAILED
# One more replica beyond `replicas_min` is placed only where the swarm model predicts at least this much more
# samples/s (a relative gain): a replica that adds nothing but its exchange is not worth its price.
MIN_REPLICA_GAIN = 0.01
# What replicas that sync every H > 1 steps average per parameter (arceus/swarm/outer.py): the weight delta and the
# optimizer's state, Adam's two moments (the optimizer placement's memory assumes: BYTES_PER_PARAMETER).
SYNC_VALUES_PER_PARAMETER = 3


def plan(
    desired: Desired, observed: Observed, now: datetime, solver_budget: Budget | None = None,
    max_placements: int | None = None, guard: MoveGuard | None = None,
) -> list[Action]:
    """The actions of one pass; `solver_budget` bounds each queued job's placement search (None: no bound), and
    `max_placements` how many queued jobs one pass searches a placement for (None: all): a burst of submissions
    then spreads over passes, and each pass stays short enough to notice silent nodes in time. `guard` bounds the
    jobs rewound to move lost stages (None: no bound; controlplane/controller/moves.py)."""
    actions: list[Action] = []
    ready: dict[str, NodeView] = {}
    for node in observed.nodes:
        if node.lease_renewed_at is None:
            continue  # never registered
        silent = (now - node.lease_renewed_at).total_seconds()
        if silent > node.lease_duration_seconds:
            if node.ready_status != UNKNOWN:
                actions.append(
                    MarkNodeUnknown(
                        node.id, node.lease_renewed_at, "NodeLeaseExpired", f"no heartbeat for {silent:.0f}s"
                    )
                )
        elif node.ready_status == TRUE:
            ready[node.id] = node
    nodes = {n.id: n for n in observed.nodes}
    busy = {s.node_id for job in desired.jobs if job.status in (*ACTIVE_STATUSES, SUCCEEDED) for s in job.stages}
    free = sorted(
        (n for n in ready.values() if n.id not in busy and not n.paused),
        key=lambda n: (-n.flops, n.price_per_hour, n.id),  # the solver's order: fastest, then cheapest
    )
    roomiest = Roomiest(nodes, now)
    moves = Moves(guard or MoveGuard(), *_silent_hosts(desired, nodes, now))
    placements = 0
    for job in desired.jobs:
        action: Action | None = None
        taken: set[str | None] = set()
        if job.status == QUEUED:
            if max_placements is not None and placements >= max_placements:
                continue  # the next pass places it (jobs stay oldest first)
            placements += 1
            action = _place(job, free, nodes, now, solver_budget)
            if isinstance(action, PlaceJob):
                taken = {s.node_id for s in action.stages}
        elif job.status in ACTIVE_STATUSES:
            action = _recorded_facts(job, nodes) or _limits(job, nodes, now) or _supervise(
                job, observed, nodes, free, now, roomiest, moves
            )
            if _moves_lost(action, job, nodes, now):  # `_supervise` held those with a stage on a lost node already
                hold = moves.hold
                if hold is None:
                    moves.moved += 1
                else:
                    moves.held += 1
                    action = _condition(job, hold, now)
            if isinstance(action, RewindJob):
                taken = {node for *_, node in action.moves}
            elif isinstance(action, AddReplicas):
                taken = {s.node_id for s in action.stages}
        elif job.status == SUCCEEDED:
            action = _serve(job, observed, nodes, free, now)
            if isinstance(action, ServeJob):
                taken = {s.node_id for s in action.stages}
        if action is not None:
            actions.append(action)
            _take(free, taken)
    if moves.held or moves.disrupted:
        reason = NODES_DISRUPTED if moves.disrupted else MOVES_DEFERRED
        actions.append(MovesHeld(reason, moves.held, moves.silent, moves.hosting))
    return actions


def _silent_hosts(desired: Desired, nodes: Mapping[str, NodeView], now: datetime) -> tuple[int, int]:
    """(silent, hosting): the nodes hosting stages of active jobs, and how many of those a job they host counts lost
    (silent past its tolerance, not Ready, or deregistered): what a disruption is judged by."""
    hosting: dict[str, bool] = {}
    for job in desired.jobs:
        if job.status in ACTIVE_STATUSES:
            for s in job.stages:
                if s.node_id is not None:
                    hosting[s.node_id] = hosting.get(s.node_id, False) or _is_lost(s, nodes, job, now)
    return sum(hosting.values()), len(hosting)


def _moves_lost(action: Action | None, job: JobView, nodes: Mapping[str, NodeView], now: datetime) -> bool:
    """Whether `action` rewinds `job` to move (or unplace) a lost stage, as `_replace_lost` does: what a pass's
    `Moves` counts and holds. A stage moved off a paused node alone (NodeDrained) is not: its node lives and its
    owner asked for it, and a running job's driver hands it over first."""
    if not isinstance(action, RewindJob) or action.reason not in ("NodeLost", "WaitingForNode", "NoNodeWithRoom"):
        return False
    moved = {(i, r, p) for i, r, p, _ in action.moves}
    return any(s.key in moved and _is_lost(s, nodes, job, now) for s in job.stages)


def _was_held(job: JobView) -> bool:
    """Whether `job`'s Placed condition says its lost stages waited (`Moves.hold`): cleared once nothing is lost and
    nothing else is to do (`_supervise`)."""
    placed = get_condition(job.conditions, "Placed")
    return placed is not None and placed["reason"] in (MOVES_DEFERRED, NODES_DISRUPTED)


def _take(free: list[NodeView], taken: set[str | None]) -> None:
    """`free` less the nodes of `taken`, in place. Those taken are mostly among the fastest, `free`'s head: the scan
    stops once it found them all, where a new list of the other 10,000 cost ~3 ms for each job placed."""
    left = taken - {None}
    i = 0
    while left and i < len(free):
        if free[i].id in left:
            left.discard(free.pop(i).id)
        else:
            i += 1


def _supervise(
    job: JobView, observed: Observed, nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime,
    roomiest: Roomiest, moves: Moves,
) -> Action | None:
    """A placed job's stages and driver watched: lost or draining nodes, stages building, the driver's lease. A job
    with a stage on a lost node that the pass may move no more (`moves.hold`) waits without a search for nodes: its
    rewind would be held anyway, and thousands of such jobs would make the pass long."""
    free = _not_fenced_out(job, _heard_since_released(job, free), now)
    if job.replicated:
        replicas = _replicas(job, observed, nodes, free, now)
        if replicas is not None:
            return replicas
    lost = [s for s in job.stages if _is_lost(s, nodes, job, now)]
    draining = [s for s in job.stages if s not in lost and nodes[s.node_id].paused]
    hold = moves.hold
    if hold is not None and any(s.node_id is not None for s in lost):
        moves.held += 1
        return _condition(job, hold, now)
    if draining and not lost and job.status == RUNNING and _driver_live(job, now):
        return None if job.handover_requested else _request_handover(job, draining, nodes, now)
    if lost or draining or not job.stages:
        return _replace_lost(job, lost + draining, nodes, free, now, roomiest)
    action = None
    if job.status == PLACING:
        action = _check_stages(job, observed, nodes, free, now)
    elif job.status == RUNNING:
        action = _check_driver(job, nodes, now)
    if action is None and _was_held(job):
        back = Condition("Placed", TRUE, "NodesBack", "the nodes of its stages answer again: its stages stay there")
        return _condition(job, back, now)
    return action


def _recorded_facts(job: JobView, nodes: Mapping[str, NodeView]) -> Action | None:
    """What the facts recorded at the job's generation decide, in order: spot checks that caught a node wrong
    roll the job back past its work; the driver's last word ends the job; a node whose agent restarted while
    hosting a stage rewinds it. Each action starts a new generation (or ends the job), so the same facts decide
    nothing again at the next pass."""
    caught = [c for c in job.failed_checks if c.generation == job.generation]
    if caught:
        first: dict[str, str] = {}
        for c in caught:
            first.setdefault(c.node_id, f"{c.node_label} failed a spot check ({c.detail})")
        return RollBackJob(job.id, job.generation, tuple(sorted(first)), "; ".join(first.values()))
    outcome = job.driver_outcome
    if job.status == RUNNING and outcome is not None and outcome.generation == job.generation:
        if outcome.status == SUCCEEDED:
            return SucceedJob(job.id, job.generation, outcome.message)
        return FailJob(job.id, job.generation, outcome.reason, outcome.message)
    return _restarted(job, nodes)


def _restarted(job: JobView, nodes: Mapping[str, NodeView]) -> Action | None:
    """A stage whose node's agent came back as a fresh process lost its state: the job rewinds to its last
    checkpoint as a restart (failing once its restarts without a checkpoint run out), the node losing its credit
    for the replayed steps; a stage on a node that may not work (flagged for restarting too often) is unplaced."""
    restarted = [s for s in job.stages if s.restarted_generation == job.generation and s.node_id is not None]
    fresh = {s.index for s in job.stages if s.restarted_generation != job.generation}
    if job.replicated:  # a replica whose stage has another is dropped instead (`_replicas`)
        restarted = [s for s in restarted if s.index not in fresh]
    if not restarted:
        return None
    message = "; ".join(
        f"{_node_label(job, nodes, s.node_id)} restarted while hosting stage "
        f"{s.index}"
        for s in restarted
    )
    culprits = tuple(sorted({s.node_id for s in restarted if s.node_id is not None}))
    if job.restarts >= job.max_restarts:
        message += f"; the job was restarted {job.restarts} times without saving a checkpoint in between"
        return FailJob(job.id, job.generation, "BackoffLimitExceeded", message, culprits)
    unplace = tuple(sorted((*s.key, None) for s in restarted if s.node_id not in nodes or nodes[s.node_id].paused))
    return RewindJob(job.id, job.generation, PLACING, unplace, True, "NodeRestarted", message, culprits)


def _limits(job: JobView, nodes: Mapping[str, NodeView], now: datetime) -> Action | None:
    """A job past its deadline, or that could not stop before its charges reach its `max_total_usd`, stops: a live
    driver checkpoints first (its model is then the job's newest checkpoint, to download), then the job fails saying
    which limit it met."""
    met = _limit_met(job, nodes, now)
    if met is None:
        return None
    reason, message = met
    if job.status == RUNNING and _driver_live(job, now):
        if job.handover_requested:
            return None  # checkpointing already; the lease let go decides the next pass
        stopping = Condition("Stopping", TRUE, reason, f"{message}: checkpointing the current step to stop")
        return RequestHandover(job.id, job.generation, tuple(set_conditions(job.conditions, stopping, now=now)))
    return FailJob(job.id, job.generation, reason, f"{message}; stopped at its newest checkpoint")


def _limit_met(job: JobView, nodes: Mapping[str, NodeView], now: datetime) -> tuple[str, str] | None:
    if job.deadline is not None and now >= job.deadline:
        return "DeadlineExceeded", f"its deadline {job.deadline.isoformat()} passed"
    if job.max_total_micros is None:
        return None
    stop_by = now + timedelta(seconds=job.stop_seconds)
    # The nodes' time held since their last entries, until it could stop, at their prices: billed with the next ones.
    dollar_seconds_per_hour = sum(
        max(0.0, (stop_by - s.held_from).total_seconds()) * nodes[s.node_id].price_per_hour
        for s in job.stages
        if s.held_from is not None and s.node_id in nodes
    )
    held = dollar_seconds_per_hour / 3600 * MICROS_PER_DOLLAR
    if job.charged_micros + held < job.max_total_micros:
        return None
    return "BudgetExhausted", (
        f"charged ${job.charged_micros / MICROS_PER_DOLLAR:.6f}, and ${held / MICROS_PER_DOLLAR:.6f} more for its "
        f"devices until it could stop ({job.stop_seconds:g} s), would reach its max_total_usd "
        f"${job.max_total_micros / MICROS_PER_DOLLAR:.6f}"
    )


def _replicas(
    job: JobView, observed: Observed, nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime
) -> Action | None:
    """A replicated job's replicas: those gone (lost, paused, restarted or failed) dropped where their stage keeps
    a replica that holds its state; where it keeps none (a joiner still copying holds none), every row but one, the
    lowest live joiner, else the lowest gone replica, which a rewind then rebuilds from the checkpoint: in place
    (`_stage_lost`), or moved as an unreplicated stage is. With none to drop, a running job whose driver lives grows
    (`_grow`). None: nothing to do here."""
    gone = [s for s in job.stages if _replica_gone(job, s, observed, nodes, now)]
    drop: list[PlacedStage] = []
    fenced_out: list[PlacedStage] = []
    for index in sorted({s.index for s in job.stages}):
        rows = sorted((s for s in job.stages if s.index == index), key=lambda s: s.replica)
        if any(s not in gone and not s.joining for s in rows):
            drop += [s for s in rows if s in gone]
            if any(s not in gone and not s.joining and not s.fenced for s in rows):  # one trains on: never the last
                fenced_out += [s for s in rows if s not in gone and _fenced_too_often(job, s)]
        else:  # the stage lost every replica that held its state, whichever passes found them gone
            kept = next((s for s in rows if s not in gone), rows[0])
            drop += [s for s in rows if s is not kept]
    drop = sorted([*drop, *fenced_out], key=lambda s: (s.index, s.replica))
    if drop:
        message = "; ".join(
            f"stage {s.index} replica {s.replica} on {_node_label(job, nodes, s.node_id)} left: "
            + (_why_gone(job, s, observed, nodes, now) if s in gone else
               f"the driver fenced it {s.fences} times (steps failed between live replicas): its link or host keeps "
               f"failing, and its node takes no replica of the job for {job.fenced_out_seconds:g} s"
               if s in fenced_out else
               "its stage lost every replica that held its state, and one joiner stays for the rewind")
            for s in drop
        )
        reason = "ReplicaFencedOut" if all(s in fenced_out for s in drop) else "ReplicaLost"
        conditions = set_conditions(job.conditions, Condition("Replicas", FALSE, reason, message), now=now)
        return DropReplicas(job.id, job.generation, job.status, tuple((s.index, s.replica) for s in drop),
                            tuple(conditions), tuple((s.index, s.replica, s.fences) for s in drop if s in fenced_out))
    if gone:
        return None  # a stage's last replica: moved or rebuilt by the rules any stage follows
    holding = {s.index for s in job.stages if not s.joining}
    orphans = [s for s in job.stages if s.index not in holding]  # each its stage's only row now (see above)
    if orphans:
        return _stage_lost(job, orphans, nodes)
    if job.status == RUNNING and _driver_live(job, now):  # a dead driver's rewind comes first
        return _grow(job, nodes, free, now)
    return None


def _stage_lost(job: JobView, joiners: list[PlacedStage], nodes: Mapping[str, NodeView]) -> RewindJob:
    """The stages of `joiners` lost every replica that held their state while the joiners copied it: the job
    rewinds, each joiner rebuilding its stage from the checkpoint where it is (no move: its node lives)."""
    message = "; ".join(
        f"stage {s.index} lost every replica that held its state; replica {s.replica} on "
        f"{_node_label(job, nodes, s.node_id)}, which was still copying it, rebuilds it from the checkpoint"
        for s in joiners
    )
    return RewindJob(job.id, job.generation, PLACING, (), False, "ReplicasLost", message)


def _fenced_too_often(job: JobView, stage: PlacedStage) -> bool:
    """Whether the driver fenced `stage`'s replica (now, so it takes no micro-batch) `max_fences` times or more within
    its window: failed steps between live replicas keep coming back to it, each fence keeps it out twice as long as
    the one before, and its slot is better given to another node."""
    return stage.fenced and stage.fences >= job.max_fences


def _replica_gone(
    job: JobView, stage: PlacedStage, observed: Observed, nodes: Mapping[str, NodeView], now: datetime
) -> bool:
    if _is_lost(stage, nodes, job, now) or nodes[stage.node_id].paused or stage.restarted_generation == job.generation:
        return True
    report = observed.stages.get((job.id, *stage.key))
    return report is not None and report.generation == job.generation and report.state == FAILED


def _why_gone(
    job: JobView, stage: PlacedStage, observed: Observed, nodes: Mapping[str, NodeView], now: datetime
) -> str:
    if _is_lost(stage, nodes, job, now):
        return "its node was lost"
    if nodes[stage.node_id].paused:
        return nodes[stage.node_id].pause_reason
    if stage.restarted_generation == job.generation:
        return "its agent restarted"
    report = observed.stages[(job.id, *stage.key)]
    return f"it failed: {report.message or 'no message'}"


def _heard_since_released(job: JobView, free: list[NodeView]) -> list[NodeView]:
    """`free` without the nodes a replica of `job` was taken off (`JobView.released`) that have not heartbeat since:
    such a node's agent may be dead though its lease has not run out yet (a lost replica is dropped after the job's
    shorter `node_grace_seconds`), so a stage of the job placed there would fail again, its replica id spent and the
    spare kept waiting. One heartbeat after the drop (the agent alive, or a new one) makes it a candidate again."""
    if not job.released:
        return free
    released = dict(job.released)
    return [n for n in free if n.id not in released or (
        n.lease_renewed_at is not None and n.lease_renewed_at > released[n.id])]


def _not_fenced_out(job: JobView, free: list[NodeView], now: datetime) -> list[NodeView]:
    """`free` without the nodes a replica of `job` was dropped from for its fences (`JobView.fenced_out`) less than
    `fenced_out_seconds` ago: their link or host kept failing the job's steps, and a heartbeat says nothing of that."""
    if not job.fenced_out:
        return free
    barred = {node_id for node_id, at in job.fenced_out if (now - at).total_seconds() < job.fenced_out_seconds}
    return [n for n in free if n.id not in barred] if barred else free


def _grow(job: JobView, nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime) -> Action | None:
    """One more replica for each stage below its most (`replicas_max`, at most one per micro-batch) on a free node
    with room that hands no owner a replica of every stage: below `replicas_min`, the fastest within the job's price
    cap; beyond it, the cheapest whose replica is worth its price within the cap (`_cheapest_worth`)."""
    candidates = _candidates(job, free, now)
    by_price = sorted(candidates, key=lambda n: (n.price_per_hour, -n.flops, n.id))
    owners = {n.id: n.owner for n in nodes.values()}
    most = min(job.replicas_max, job.workload.micro_batches)
    added: list[PlannedStage] = []
    spent = sum(nodes[s.node_id].price_per_hour for s in job.stages if s.node_id in nodes)
    for index in sorted({s.index for s in job.stages}):
        rows = [s for s in job.stages if s.index == index]
        if len(rows) >= most:
            continue
        need = _stage_memory(job, rows[0])
        taken = {s.node_id for s in added}
        below_min = len(rows) < job.replicas_min
        fits = (n for n in (candidates if below_min else by_price) if n.id not in taken and n.memory_bytes >= need
                and _keeps_owners_apart(job.requirements, [*job.stages, *added, PlannedStage(
                    index, 0, 0, n.id, replica=job.next_replica + len(added))], owners))
        cap = job.requirements.max_price_per_hour
        node = (next((n for n in fits if cap is None or spent + n.price_per_hour <= cap + PRICE_ROUNDING), None)
                if below_min else _cheapest_worth(job, index, fits, nodes, spent))
        if node is None:
            continue
        spent += node.price_per_hour
        added.append(PlannedStage(index, rows[0].layer_start, rows[0].layer_end, node.id,
                                  replica=job.next_replica + len(added)))
    if not added:
        return None
    message = "; ".join(
        f"stage {s.index} replica {s.replica} placed on {_node_label(job, nodes, s.node_id)}, joining from a peer"
        for s in added
    )
    conditions = set_conditions(job.conditions, Condition("Replicas", TRUE, "ReplicaAdded", message), now=now)
    return AddReplicas(job.id, job.generation, job.next_replica, tuple(added), tuple(conditions))


def replicas_grown(job: JobView, nodes: Mapping[str, NodeView], free: Sequence[NodeView], now: datetime) -> JobView:
    """`job` (running, every replica Ready) as its growth would leave it if `free` stayed free and no replica left:
    `_grow`'s replicas added round after round until none is worth adding or every stage is at its most. What an
    estimate expects a job with `replicas.max` above its min to reach. `nodes`: every node by id, the job's too."""
    free = list(free)
    while (action := _grow(job, nodes, free, now)) is not None:
        added = tuple(PlacedStage(s.index, s.layer_start, s.layer_end, s.node_id, job.generation, replica=s.replica)
                      for s in action.stages)
        job = replace(job, stages=(*job.stages, *added), next_replica=job.next_replica + len(added))
        taken = {s.node_id for s in added}
        free = [n for n in free if n.id not in taken]
    return job


def _cheapest_worth(
    job: JobView, index: int, by_price: Iterable[NodeView], nodes: Mapping[str, NodeView], spent: float
) -> NodeView | None:
    """The first of `by_price` (cheapest first) within the job's price cap, with `spent` an hour already, whose
    replica of stage `index` `replica_gain` predicts to add at least MIN_REPLICA_GAIN more samples/s. A node no
    faster (as the job's calibration sees it) and no better linked than one found not worth it is not modelled: it
    would gain no more."""
    cap = job.requirements.max_price_per_hour
    speeds = calibration(job, nodes)
    refused: list[tuple[float, NodeView]] = []
    for node in by_price:
        if cap is not None and spent + node.price_per_hour > cap + PRICE_ROUNDING:
            return None  # every later node costs as much or more
        flops = speeds.flops(node, index)
        if any(flops <= f and node.latency_s >= r.latency_s
               and node.bandwidth_bytes_per_s <= r.bandwidth_bytes_per_s for f, r in refused):
            continue
        if _gains(job, index, node, nodes, speeds):
            return node
        refused.append((flops, node))
    return None


def _gains(job: JobView, index: int, node: NodeView, nodes: Mapping[str, NodeView], speeds: Calibration) -> bool:
    """Whether `replica_gain` predicts at least MIN_REPLICA_GAIN more samples/s from one more replica of stage
    `index` on `node`, every node at its speed for the job (`speeds`: measured where the driver timed it, else its
    benchmark calibrated by the job's timed nodes)."""
    indices = sorted({s.index for s in job.stages})
    if indices != list(range(len(indices))):
        return False
    bounds = {s.index: (s.layer_start, s.layer_end) for s in job.stages}
    layers = [job.layers[start:end] for start, end in (bounds[i] for i in indices)]
    stages = [[speeds.replica(nodes[s.node_id], i, layers[i]) for s in job.stages
               if s.index == i and s.node_id in nodes] for i in indices]
    if any(not s for s in stages):
        return False
    gain = replica_gain(stages, swarm_workload(layers, job.workload, job.replica_sync_every), index,
                        speeds.replica(node, index, layers[index]))
    return gain.after >= gain.before * (1 + MIN_REPLICA_GAIN)


def swarm_workload(
    layers: Sequence[Sequence[LayerProfile]], workload: Workload, sync_every: int = 1
) -> SwarmWorkload:
    """A step of a pipeline of these stages' layers, as the swarm model sees it: what crosses each boundary and
    what each stage's replicas exchange: fp32 gradients every step, or every `sync_every` steps (the job's
    replica_sync) the weight deltas and the optimizer's state (`SYNC_VALUES_PER_PARAMETER`)."""
    values = 1 if sync_every == 1 else SYNC_VALUES_PER_PARAMETER
    return SwarmWorkload(
        micro_batches=workload.micro_batches,
        batch_size=workload.micro_batch_size * workload.micro_batches,
        boundary_bytes_per_sample=tuple(float(stage[-1].output_bytes_per_sample) for stage in layers[:-1]),
        gradient_bytes=tuple(4.0 * values * sum(layer.params for layer in stage) for stage in layers),
        schedule=workload.schedule,
        sync_every=sync_every,
    )


def _is_lost(stage: PlacedStage, nodes: Mapping[str, NodeView], job: JobView, now: datetime) -> bool:
    """The stage has no node, or its node is gone: deregistered, or silent past the job's tolerance (by
    default the node's lease)."""
    node = nodes.get(stage.node_id) if stage.node_id is not None else None
    return node is None or _silent(node, job, now)


def _candidates(job: JobView, free: Iterable[NodeView], now: datetime) -> list[NodeView]:
    """The free nodes that may take `job`'s stages: those meeting its requirements that it would not count gone at
    once. A free node is Ready, within its lease, but a job's tolerance may be shorter: the node a lost stage just
    moved off, its agent dead, stays Ready until its lease runs out, and a stage placed there would be lost again."""
    return [n for n in free if _takes(job, n) and not _silent(n, job, now)]


def _takes(job: JobView, node: NodeView) -> bool:
    """Whether `node` may host `job`'s stages: it meets the job's requirements, and where the job's stages are
    replicated, siblings can open its exchange (a node whose registered exchange listener did not answer the
    dial-back could take part in no exchange, and each step would lose it)."""
    return job.requirements.allows(node) and (node.exchange_reachable or not job.replicated)


def _silent(node: NodeView, job: JobView, now: datetime) -> bool:
    """Whether `job` counts `node` gone: never registered, not Ready, or silent past the job's tolerance."""
    if node.lease_renewed_at is None:
        return True
    grace = job.node_grace_seconds if job.node_grace_seconds is not None else node.lease_duration_seconds
    return (now - node.lease_renewed_at).total_seconds() > grace or node.ready_status == FALSE


def _replace_lost(
    job: JobView, lost: list[PlacedStage], nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime,
    roomiest: Roomiest,
) -> Action | None:
    """Move only the lost stage ranks, each to the fastest free node with memory for it; if any cannot
    move, unplace the lost ranks (releasing dead nodes) and wait as pending."""
    if not job.stages:  # e.g. deleted by hand in the admin
        return RequeueJob(job.id, job.generation, "StagesMissing", "the placement has no stages")
    moved_to: set[str] = set()

    def spare() -> Iterator[NodeView]:
        """`_candidates` not taken by a move yet, looked at as needed: a move takes one of the first few of 10,000
        free nodes, and listing the candidates among them all cost ~6 ms for each job with a lost stage."""
        return (n for n in free if n.id not in moved_to and _takes(job, n) and not _silent(n, job, now))

    moves: list[tuple[int, int, int, str | None]] = []
    unplaceable: list[str] = []
    nowhere: list[str] = []  # lost stages Ready nodes are, free or busy, all too small for
    for stage in sorted(lost, key=lambda s: (-_stage_memory(job, s), s.index, s.rank)):
        need = _stage_memory(job, stage)
        node = next((n for n in spare() if n.memory_bytes >= need), None)
        if node is None:
            layers = f"layers {stage.layer_start}-{stage.layer_end - 1}"
            unplaceable.append(
                f"{_stage_label(job, stage)} ({layers}, needs {need:,} bytes{_shortfall(job, need, list(spare()))})"
            )
            if _too_small_everywhere(job, need, lost, roomiest):
                nowhere.append(_stage_label(job, stage))
        else:
            moved_to.add(node.id)
            moves.append((*stage.key, node.id))
    if not unplaceable and job.requirements.owner_diversity:
        unplaceable += _owners_apart(job, lost, moves, nodes, spare)
    by_key = {s.key: s for s in lost}
    old = {key: _node_label(job, nodes, s.node_id) for key, s in by_key.items()}
    paused = {
        key: nodes[s.node_id].pause_reason
        for key, s in by_key.items()
        if s.node_id in nodes and nodes[s.node_id].paused
    }
    if not unplaceable:
        moves.sort()
        message = "; ".join(
            f"{_stage_label(job, by_key[i, r, p])} moved from {old[i, r, p]}"
            f"{f' ({paused[i, r, p]})' if (i, r, p) in paused else ''} to {_node_label(job, nodes, n)}"
            for i, r, p, n in moves
        )
        reason = "NodeDrained" if {(i, r, p) for i, r, p, _ in moves} <= paused.keys() else "NodeLost"
        return RewindJob(job.id, job.generation, PLACING, tuple(moves), False, reason, message)
    message = (
        f"waiting for a Ready node with room for {', '.join(unplaceable)} "
        f"({len(free)} free Ready node{'s' if len(free) != 1 else ''} now)"
    )
    reason = "WaitingForNode"
    if nowhere:  # no node that frees up would place it either: say what would
        reason = "NoNodeWithRoom"
        message += (
            f"; every Ready node, busy or free, is too small for {', '.join(nowhere)}: it waits until a node's owner "
            "raises its max_memory_bytes or a node with more memory joins (with fewer or smaller micro-batches, "
            "or activation checkpointing, a job's stages need less)"
        )
    if job.status != PENDING or any(s.node_id is not None for s in lost):
        unplace = tuple(sorted((*s.key, None) for s in lost))
        return RewindJob(job.id, job.generation, PENDING, unplace, False, reason, message)
    return _condition(job, Condition("Placed", FALSE, reason, message), now)


def _shortfall(job: JobView, need: int, candidates: Sequence[NodeView]) -> str:
    """"; the roomiest free node ... short" for a stage needing `need` bytes that none of `candidates` has room
    for (else nothing): a node's room is its memory, or its owner's max_memory_bytes below that, less what its
    agent holds (controlplane/controller/snapshot.py)."""
    roomiest = max(candidates, key=lambda n: (n.memory_bytes, n.id), default=None)
    if roomiest is None:
        return ""
    return (
        f"; the roomiest free node, {_node_label(job, {roomiest.id: roomiest}, roomiest.id)}, has "
        f"{roomiest.memory_bytes:,} for stages: {need - roomiest.memory_bytes:,} short"
    )


def _too_small_everywhere(job: JobView, need: int, lost: Sequence[PlacedStage], roomiest: Roomiest) -> bool:
    """Whether there are Ready nodes that may take `job`'s stages, free or busy with another job, and none has `need`
    bytes of room: none that frees up would place the stage. The job's own nodes are not counted (they hold its
    other stages), nor those it counts absent (`_heard_since_released`); those of `lost` are (a paused one may
    resume). The roomiest such node decides it."""
    own = {s.node_id for s in job.stages if s not in lost}
    for node in roomiest.of(job):
        if node.id not in own and _heard_since_released(job, [node]):
            return node.memory_bytes < need
    return False


class Roomiest:
    """A pass's Ready nodes that a job may take, free or busy, not silent by its tolerance, roomiest first: sorted
    once per kind of job (its requirements, whether it is replicated, its tolerance) at its first use in the pass.
    `_too_small_everywhere` asks this of every stage that finds no free node; walking all the nodes for each such
    stage made a pass with many lost stages over 10,000 nodes cost seconds."""

    def __init__(self, nodes: Mapping[str, NodeView], now: datetime) -> None:
        self._nodes, self._now = nodes, now
        self._sorted: dict[tuple[Requirements, bool, float | None], list[NodeView]] = {}

    def of(self, job: JobView) -> list[NodeView]:
        key = (job.requirements, job.replicated, job.node_grace_seconds)
        if key not in self._sorted:
            self._sorted[key] = sorted(
                (n for n in self._nodes.values()
                 if n.ready_status == TRUE and _takes(job, n) and not _silent(n, job, self._now)),
                key=lambda n: -n.memory_bytes,
            )
        return self._sorted[key]


def _owners_apart(
    job: JobView, lost: list[PlacedStage], moves: list[tuple[int, int, int, str | None]],
    nodes: Mapping[str, NodeView],
    spare: Callable[[], Iterable[NodeView]],
) -> list[str]:
    """When `moves` would leave one owner holding (a replica of) every stage, one of them goes to another owner's
    free node with room instead (`spare()`: the candidates no move took); with none, what the job waits for."""
    def holder(moved: list[tuple[int, int, int, str | None]]) -> str | None:
        target = {(i, r, p): n for i, r, p, n in moved}
        rows = [(s.index, s.replica, target.get(s.key, s.node_id)) for s in job.stages]
        return None if any(n not in nodes for _, _, n in rows) else owner_of_every_stage(rows, owners)

    owners = {n.id: n.owner for n in nodes.values()}
    owner = holder(moves)
    if owner is None:
        return []
    lost_by_key = {s.key: s for s in lost}
    for k, (index, rank, replica, _) in enumerate(moves):
        need = _stage_memory(job, lost_by_key[index, rank, replica])
        for other in (n for n in spare() if n.owner != owner and n.memory_bytes >= need):
            if holder(moved := [*moves[:k], (index, rank, replica, other.id), *moves[k + 1:]]) is None:
                moves[:] = moved
                return []
    return ["a stage on another owner's node (no single owner may hold every stage of the job)"]


def _keeps_owners_apart(
    requirements: Requirements, rows: Sequence[PlannedStage | PlacedStage], owners: Mapping[str, str]
) -> bool:
    """Whether `rows` (a job's placement, or one planned) leave no single owner holding a replica of every stage, or
    the job opted out."""
    return not requirements.owner_diversity or owner_of_every_stage(
        [(s.index, s.replica, s.node_id) for s in rows if s.node_id is not None], owners
    ) is None


def _driver_live(job: JobView, now: datetime) -> bool:
    return job.driver_lease_expires_at is not None and job.driver_lease_expires_at >= now


def _request_handover(
    job: JobView, draining: list[PlacedStage], nodes: Mapping[str, NodeView], now: datetime
) -> RequestHandover:
    names = "; ".join(
        f"{_stage_label(job, s)} on {_node_label(job, nodes, s.node_id)} ({nodes[s.node_id].pause_reason})"
        for s in draining
    )
    message = f"{names}: checkpointing the current step to hand it back"
    conditions = set_conditions(job.conditions, Condition("Draining", TRUE, "NodeUnavailable", message), now=now)
    return RequestHandover(job.id, job.generation, tuple(conditions))


def _stage_memory(job: JobView, stage: PlacedStage) -> int:
    """Bytes each of the stage's nodes needs (a tensor-parallel rank: its share of the split weights), as the solver
    placed it: with the micro-batches in flight at its place in the pipeline, not all of a step's."""
    layers = job.layers[stage.layer_start : stage.layer_end]
    num_stages = 1 + max(s.index for s in job.stages)
    return placed_stage_memory(layers, job.workload, stage.index, num_stages, job.tensor_parallel.ranks(stage.index))


def _stage_label(job: JobView, stage: PlacedStage) -> str:
    return f"stage {stage.index}" + (f" rank {stage.rank}" if job.tensor_parallel.ranks(stage.index) > 1 else "")


def _node_label(job: JobView, nodes: Mapping[str, NodeView], node_id: str | None) -> str:
    """A node as the job's conditions name it: the job's owner sees their own nodes by name, others' by their id."""
    node = nodes.get(node_id) if node_id is not None else None
    if node is None:
        return "no node" if node_id is None else f"node {node_id}"
    return node_label(node_id=node_id, name=node.name or node_id, owner_id=node.owner, viewer_id=job.owner)


def _place(
    job: JobView, free: list[NodeView], nodes: Mapping[str, NodeView], now: datetime, budget: Budget | None
) -> Action | None:
    if job.spec_error is not None:
        return FailJob(job.id, job.generation, "InvalidModel", job.spec_error)
    req = job.requirements
    fewest, most = stage_bounds(job.stages_requested, req, job.tensor_parallel)
    needed = job.tensor_parallel.nodes(fewest) * job.replicas_min
    # The solver searches only the fastest few (cheaper first among equals: `free`'s order is its own), so only
    # those are handed to it: with 10,000 free nodes, building and sorting them all per job cost more than the
    # search. Enough for its candidate units: groups of the split size, then singles, and what the job needs.
    # A node without room for even the smallest layer (as a rank of a split stage, the least) can hold no stage: it is
    # passed over before the few are taken, or a market of small fast nodes would crowd out the big ones.
    # Where a stage would not fit, its activations are recomputed (`_recomputing`): nodes with room for a stage that
    # recomputes are candidates too.
    recomputing = _recomputing(job)
    room = smallest_stage_memory(job.layers, recomputing or job.workload, job.tensor_parallel.size)
    offered = MAX_CANDIDATES * (job.tensor_parallel.size + 1) + needed
    candidates = list(itertools.islice((n for n in free if _takes(job, n) and n.memory_bytes >= room), offered))
    if req.owner_diversity and len({n.owner for n in candidates}) == 1:  # another owner's fastest, past the few
        other = next((n for n in free if _takes(job, n) and n.memory_bytes >= room
                      and n.owner != candidates[0].owner), None)
        candidates += [other] if other is not None else []
    if len(candidates) < needed:  # the whole of `free` was looked at: the count is exact
        meeting = (" meeting its requirements" if any(not req.allows(n) for n in free) else "") + (
            " with room for a stage" if any(req.allows(n) and n.memory_bytes < room for n in free) else "") + (
            " whose replicas' exchange answers" if any(not _takes(job, n) and req.allows(n) for n in free) else "")
        message = f"needs {needed} Ready node{'s' if needed != 1 else ''}{meeting}, {len(candidates)} available"
        return _condition(job, Condition("Placed", FALSE, "WaitingForNodes", message), now)

    def placed_with(workload: Workload) -> Placement:
        def solve_on(nodes: Sequence[NodeView], least: int) -> Placement:
            return solve(
                job.layers,
                [n.device() for n in nodes],
                workload,
                min_stages=least,
                max_stages=most,
                max_price_per_hour=replica_share(req, job.replicas_min),
                tensor_parallel=job.tensor_parallel.size,
                split_stages=job.tensor_parallel.stages,
                budget=budget,
            )

        return (diverse_placement(candidates, fewest, most, solve_on) if req.owner_diversity
                else solve_on(candidates, fewest))

    workload = job.workload
    try:
        try:
            placement = placed_with(workload)
        except PlacementError:
            if recomputing is None:
                raise
            placement, workload = placed_with(recomputing), recomputing
    except OwnerDiversityError as exc:
        return _condition(job, Condition("Placed", FALSE, "WaitingForOwners", str(exc)), now)
    except PlacementError as exc:
        message = str(exc) + share_note(req, job.replicas_min)
        return _condition(job, Condition("Placed", FALSE, "NoFeasiblePlacement", message), now)
    stages = tuple(
        PlannedStage(index=i, layer_start=s.layer_start, layer_end=s.layer_end, node_id=node_id, rank=rank)
        for i, s in enumerate(placement.stages)
        for rank, node_id in enumerate(s.device_ids)
    )
    if job.replicas_min > 1:
        replicated = replicas_placed(
            stages, [n for n in free if n.exchange_reachable], layers=job.layers, workload=workload,
            requirements=req, count=job.replicas_min,
        )
        if isinstance(replicated, str):
            return _condition(job, Condition("Placed", FALSE, "WaitingForNodes", replicated), now)
        stages = replicated
    placed = {s.node_id: nodes[s.node_id] for s in stages}  # each of `free`: by id, not a scan of 10,000
    names = {node_id: _node_label(job, placed, node_id) for node_id in placed}
    message = (
        f"{len(placement.stages)} stage{'s' if len(placement.stages) != 1 else ''} on "
        + ", ".join(
            f"{' + '.join(names[n] for n in s.device_ids)} (layers {s.layer_start}-{s.layer_end - 1}"
            + (f", tensor-parallel over {len(s.device_ids)}" if len(s.device_ids) > 1 else "")
            + ")"
            for s in placement.stages
        )
        + (f"; {job.replicas_min} replicas each on "
           + ", ".join(names[s.node_id] for s in stages if s.replica) if job.replicas_min > 1 else "")
        + f"; ${placement.price_per_hour:.4f}/hour"
        + ("; the search was cut short at its time limit, so only the fastest nodes were tried"
           if placement.cut_short else "")
        + ("; its stages recompute their activations (activation checkpointing): without, a stage would not fit"
           if workload is recomputing else "")
    )
    conditions = set_conditions(
        job.conditions,
        Condition("Placed", TRUE, "Placed", message),
        Condition("StagesReady", FALSE, "WaitingForStages", f"0/{len(stages)} {_parts(stages)} ready"),
        now=now,
    )
    return PlaceJob(job.id, job.generation, stages, tuple(conditions), activation_checkpointing=workload is recomputing)


def _recomputing(job: JobView) -> Workload | None:
    """The job's workload with activation checkpointing, where placement may choose it for a job whose stages would
    not fit otherwise: None for a job that already recomputes, and for a tensor-parallel one (its recomputed forward
    would run its all-reduces again)."""
    if job.workload.activation_checkpointing or job.tensor_parallel.size > 1:
        return None
    return replace(job.workload, activation_checkpointing=True)


def replicas_placed(
    stages: Sequence[PlannedStage], free: Sequence[NodeView], *, layers: Sequence[LayerProfile], workload: Workload,
    requirements: Requirements, count: int,
) -> tuple[PlannedStage, ...] | str:
    """The solver's one node per stage as replica 0, and replicas 1 .. `count` - 1 of each stage on the fastest
    other free nodes with room (`free`'s order; the stages needing most memory first; none handing one owner a
    replica of every stage), every node's price together within the job's `max_price_per_hour`: a node is taken
    only where the cheapest free nodes could still fill the replicas left after it; what is missing, if some
    cannot be placed. Placement and estimates alike."""
    used = {s.node_id for s in stages}
    candidates = [n for n in free if n.id not in used and requirements.allows(n)]
    placed = [replace(s, replica=0) for s in stages]
    owners = {n.id: n.owner for n in free}
    price = {n.id: n.price_per_hour for n in free}
    cap = requirements.max_price_per_hour
    spent = sum(price[node_id] for node_id in used)
    left = len(stages) * (count - 1)  # replicas still to place

    def affordable(node: NodeView, cheapest: list[float]) -> bool:
        """Within the cap, with the cheapest other candidates (`cheapest`: the `left` lowest prices of all) for the
        replicas left after this one."""
        if cap is None:
            return True
        others = sum(cheapest) - node.price_per_hour if node.price_per_hour <= cheapest[-1] else sum(cheapest[:-1])
        return spent + node.price_per_hour + others <= cap + PRICE_ROUNDING

    num_stages = 1 + max(s.index for s in stages)

    def need_of(stage: PlannedStage) -> int:
        return placed_stage_memory(layers[stage.layer_start : stage.layer_end], workload, stage.index, num_stages)

    for stage in sorted(stages, key=lambda s: (-need_of(s), s.index)):
        need = need_of(stage)
        for replica in range(1, count):
            cheapest = heapq.nsmallest(left, (n.price_per_hour for n in candidates)) if cap is not None else []
            fitting = (n for n in candidates if n.memory_bytes >= need and _keeps_owners_apart(
                requirements, [*placed, replace(stage, node_id=n.id, replica=replica)], owners))
            node, priced_out = None, False
            for n in fitting:
                if affordable(n, cheapest):
                    node = n
                    break
                priced_out = True
            if node is None and priced_out:
                return (f"needs {count} replicas of each of {len(stages)} stages within the price cap of "
                        f"${cap:.4f}/hour; the nodes free now cost more (${spent:.4f}/hour placed, replica {replica} "
                        f"of stage {stage.index} next); raise the cap, ask for fewer replicas, or wait for cheaper "
                        "nodes")
            if node is None:
                return (f"needs {count} replicas of each of {len(stages)} stages on distinct Ready nodes; "
                        f"no free node has room ({need:,} bytes) for replica {replica} of stage {stage.index}")
            candidates.remove(node)
            spent += node.price_per_hour
            left -= 1
            placed.append(replace(stage, node_id=node.id, replica=replica))
    return tuple(sorted(placed, key=lambda s: (s.index, s.rank, s.replica)))


def replica_share(requirements: Requirements, count: int) -> float | None:
    """The price cap the solver places one copy of the pipeline (replica 0 of every stage) under when a job asks
    for `count` replicas of each: its equal share of `max_price_per_hour`, so the cap leaves room for the others
    (`replicas_placed` keeps the whole within it)."""
    cap = requirements.max_price_per_hour
    return None if cap is None else cap / count


def share_note(requirements: Requirements, count: int) -> str:
    """What a solver's refusal under `replica_share` adds: whose budget it was."""
    cap = requirements.max_price_per_hour
    if cap is None or count == 1:
        return ""
    return (f" (the budget of one copy of the pipeline: its share of the job's ${cap:.4f}/hour cap over {count} "
            "replicas of each stage)")


def _parts(stages: Sequence[PlannedStage | PlacedStage]) -> str:
    """What the ready count counts: stages, or stage ranks where some stage is a group."""
    return "stage ranks" if any(s.rank for s in stages) else "stages"


def _check_stages(
    job: JobView, observed: Observed, nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime
) -> Action | None:
    current = [observed.stages.get((job.id, *s.key)) for s in job.stages]
    current = [r if r is not None and r.generation == job.generation else None for r in current]
    for stage, report in zip(job.stages, current, strict=True):
        if report is not None and report.state == FAILED:
            return _move_failed(job, stage, report, nodes, free, now)
    ready_count = sum(1 for r in current if r is not None and r.state == READY)
    total, parts = len(job.stages), _parts(job.stages)
    if total and ready_count == total:
        conditions = set_conditions(
            job.conditions,
            Condition("StagesReady", TRUE, "AllStagesReady", f"{total}/{total} {parts} ready"),
            Condition("Training", TRUE, "DriverStarting", "a training driver was enqueued"),
            now=now,
        )
        return StartDriver(job.id, job.generation, PLACING, job.driver_lease_expires_at, tuple(conditions))
    waiting = Condition("StagesReady", FALSE, "WaitingForStages", f"{ready_count}/{total} {parts} ready")
    return _condition(job, waiting, now)


def _move_failed(
    job: JobView, stage: PlacedStage, report: StageReport, nodes: Mapping[str, NodeView], free: list[NodeView],
    now: datetime,
) -> Action:
    """A stage its node could not build moves to the fastest free node with room, as a restart: a failure
    that follows the stage from node to node fails the job once the restarts run out; with no other node
    for it, the job fails at once with the node's reason."""
    failure = f"{_stage_label(job, stage)} on node {stage.node_id} failed: {report.message or 'no message'}"
    need = _stage_memory(job, stage)
    owners = {**{n.id: n.owner for n in nodes.values()}, **{n.id: n.owner for n in free}}

    def keeps_owners_apart(target: NodeView) -> bool:
        rows = [(s.index, s.replica, target.id if s.key == stage.key else s.node_id) for s in job.stages]
        if not job.requirements.owner_diversity or any(node_id not in owners for _, _, node_id in rows):
            return True
        return owner_of_every_stage(rows, owners) is None

    fitting = [n for n in _candidates(job, free, now) if n.memory_bytes >= need]
    target = next((n for n in fitting if keeps_owners_apart(n)), None)
    if target is None:
        reason = "" if not fitting else " (no single owner may hold every stage of the job; " + OPT_OUT + ")"
        return FailJob(job.id, job.generation, "StageFailed", failure + reason)
    if job.restarts >= job.max_restarts:
        return FailJob(
            job.id, job.generation, "BackoffLimitExceeded",
            f"{failure}; the job was restarted {job.restarts} times without saving a checkpoint in between",
        )
    message = f"{failure}; moved from {_node_label(job, nodes, stage.node_id)} to {_node_label(job, nodes, target.id)}"
    return RewindJob(job.id, job.generation, PLACING, ((*stage.key, target.id),), True, "StageFailed", message)


def _check_driver(job: JobView, nodes: Mapping[str, NodeView], now: datetime) -> Action | None:
    if job.driver_lease_expires_at is not None and job.driver_lease_expires_at >= now:
        return None
    if job.driver_claimed:
        if _unheard_since(job, nodes, job.driver_lease_expires_at):
            # A driver interrupted by a stage call gives its lease back at once, often because that stage's agent
            # died: its node stays Ready until its lease runs out. Rewinding in place now would rebuild the stage
            # there, and rule 3 would rewind again once the node counts lost (two rewinds for one loss). Wait
            # until every stage's node is heard from since (alive: rewind in place) or counts lost (rule 3 moves
            # its stage: one rewind); bounded by the job's tolerance for silent nodes.
            return None
        if job.restarts >= job.max_restarts:
            return FailJob(
                job.id,
                job.generation,
                "BackoffLimitExceeded",
                f"the training driver stopped {job.restarts + 1} times without saving a checkpoint in between; "
                "see the Training condition for the last error",
            )
        return RewindJob(
            job.id,
            job.generation,
            PLACING,
            (),
            True,
            "DriverLost",
            "the training driver stopped (see the Training condition) and every stage's node was heard from since: "
            "the stages rebuild where they are, resuming from the last checkpoint",
        )
    conditions = set_conditions(
        job.conditions,
        Condition("Training", TRUE, "DriverRestarted", "the driver's lease expired; a new driver was enqueued"),
        now=now,
    )
    return StartDriver(job.id, job.generation, RUNNING, job.driver_lease_expires_at, tuple(conditions))


def _unheard_since(job: JobView, nodes: Mapping[str, NodeView], since: datetime | None) -> bool:
    """Whether a node of `job`'s stages has not heartbeated since `since` (the driver let go); the stages are placed
    and their nodes not lost (`_supervise` moved them first)."""
    if since is None:
        return False
    heard = (nodes[s.node_id].lease_renewed_at for s in job.stages if s.node_id in nodes)
    return any(at is None or at < since for at in heard)


def _condition(job: JobView, condition: Condition, now: datetime) -> SetCondition | None:
    """Set one condition unless it already reads exactly so (a steady state writes nothing)."""
    if has_condition(job.conditions, condition):
        return None
    return SetCondition(job.id, job.generation, job.status, tuple(set_conditions(job.conditions, condition, now=now)))


# --- serving --------------------------------------------------------------------------------------
def _serve(
    job: JobView, observed: Observed, nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime
) -> Action | None:
    """A succeeded job: its served stages placed, moved, watched or released, as its owner asks."""
    if not job.serving:
        if not job.stages:
            return None
        stopped = Condition("Serving", FALSE, "Stopped", "serving stopped by its owner; its nodes were released")
        return _stop_serving(job, stopped, serving=False, now=now)
    if job.spec_error is not None:
        return _stop_serving(job, Condition("Serving", FALSE, "InvalidModel", job.spec_error), serving=False, now=now)
    lost = [s for s in job.stages if _is_lost(s, nodes, job, now) or nodes[s.node_id].paused]
    if lost or not job.stages:
        return _place_served(job, lost, nodes, free, now)
    current = [observed.stages.get((job.id, *s.key)) for s in job.stages]
    current = [r if r is not None and r.generation == job.generation else None for r in current]
    for stage, report in zip(job.stages, current, strict=True):
        if report is not None and report.state == FAILED:
            failure = (
                f"stage {stage.index} on {_node_label(job, nodes, stage.node_id)} could not be built: "
                f"{report.message or 'no message'}; serving stopped (ask for it again to retry)"
            )
            return _stop_serving(job, Condition("Serving", FALSE, "StageFailed", failure), serving=False, now=now)
    ready, total = sum(1 for r in current if r is not None and r.state == READY), len(job.stages)
    if ready == total:
        return _condition(job, Condition("Serving", TRUE, "Ready", f"{total}/{total} stages ready to decode"), now)
    return _condition(job, Condition("Serving", FALSE, "WaitingForStages", f"{ready}/{total} stages ready"), now)


def _place_served(
    job: JobView, lost: list[PlacedStage], nodes: Mapping[str, NodeView], free: list[NodeView], now: datetime
) -> Action | None:
    """Every stage of the final checkpoint on a node: kept where it is unless `lost`, else on the fastest free
    node meeting the job's requirements with room for its weights and decoding caches (the largest first)."""
    kept = {s.index: s.node_id for s in job.stages if s not in lost and s.node_id is not None}
    candidates = [n for n in free if job.requirements.allows(n)]
    placed: dict[int, str] = dict(kept)
    unplaceable: list[str] = []
    layers = {index: job.layers[start:end] for index, start, end in job.served_layers}
    owners = {**{n.id: n.owner for n in nodes.values()}, **{n.id: n.owner for n in free}}
    pending = sorted(
        (s for s in job.served_layers if s[0] not in kept), key=lambda s: (-_served_memory(layers[s[0]]), s[0])
    )
    apart: str | None = None  # why owner diversity keeps the last stage off the nodes that fit it
    for k, (index, start, end) in enumerate(pending):
        need = _served_memory(layers[index])
        fitting = [n for n in candidates if n.memory_bytes >= need]
        # The last stage placed decides whether one owner would hold the whole model: not that owner's node.
        held = {owners.get(node_id) for node_id in placed.values()}
        if job.requirements.owner_diversity and k == len(pending) - 1 and len(held) <= 1 and fitting:
            if not placed:
                apart = f"a model served as one stage is held whole by one owner ({OPT_OUT})"
                fitting = []
            elif not (fitting := [n for n in fitting if n.owner not in held]):
                apart = (f"stage {index} needs another owner's node: no single owner may hold every stage of the job "
                         f"(waiting for one, {OPT_OUT})")
        node = fitting[0] if fitting else None
        if node is None:
            unplaceable.append(f"stage {index} (layers {start}-{end - 1}, needs {need:,} bytes)")
        else:
            candidates.remove(node)
            placed[index] = node.id
    if not job.served_layers:
        unplaceable.append("its final checkpoint, which has no stages")
    if unplaceable:
        waiting = Condition("Serving", FALSE, "WaitingForOwners", apart) if apart else Condition(
            "Serving", FALSE, "WaitingForNodes",
            f"waiting for a Ready node with room for {', '.join(unplaceable)} "
            f"({len(free)} free Ready node{'s' if len(free) != 1 else ''} now)",
        )
        return _stop_serving(job, waiting, serving=True, now=now) if job.stages else _condition(job, waiting, now)
    moved = {s.index: s for s in lost}

    def label(node_id: str | None) -> str:
        return _node_label(job, nodes, node_id)

    message = "; ".join(
        f"stage {index} moved from {label(moved[index].node_id)} to {label(node_id)}"
        if index in moved
        else f"stage {index} on {label(node_id)}"
        for index, node_id in sorted(placed.items())
        if index not in kept
    )
    stages = tuple(
        PlannedStage(index=index, layer_start=start, layer_end=end, node_id=placed[index])
        for index, start, end in job.served_layers
    )
    conditions = set_conditions(job.conditions, Condition("Serving", FALSE, "Placed", message), now=now)
    return ServeJob(job.id, job.generation, stages, tuple(conditions))


def _served_memory(layers: Sequence[LayerProfile]) -> int:
    return stage_inference_memory(layers, DECODE_SESSIONS)


def _stop_serving(job: JobView, condition: Condition, *, serving: bool, now: datetime) -> StopServing:
    return StopServing(job.id, job.generation, serving, tuple(set_conditions(job.conditions, condition, now=now)))
