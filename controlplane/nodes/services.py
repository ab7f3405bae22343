"""Nodes: tokens (minting, the owner's rotation), the Ready transition, flags, and the owner's pause and controls.
What an agent's own requests change (registration, heartbeats, leaving) reads the stages it hosts:
controlplane/agents/services.py."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from arceus.contracts.credentials import token_digest
from controlplane.common import metrics
from controlplane.common.conditions import TRUE
from controlplane.common.dispatch import reconcile_soon
from controlplane.common.errors import ApplicationError
from controlplane.nodes.models import Node, ReadyStatus

NODE_TOKEN_PREFIX = "arceus_node_"


def node_token_hash(token: str) -> str:
    """What a node's row keeps of its agent token (the token itself is shown once and never stored)."""
    return token_digest(token)


def _node_token_new() -> str:
    # The prefix makes tokens recognisable to secret scanners, and keeps a token from starting with "-",
    # which a command line (`--token -abc...`) would read as an option.
    return NODE_TOKEN_PREFIX + secrets.token_urlsafe(32)


def node_create(*, owner: AbstractBaseUser, name: str) -> tuple[Node, str]:
    """A new node and its agent token; only the token's hash is stored, so this is the one chance to
    see it."""
    token = _node_token_new()
    node = Node.objects.create(owner=owner, name=name, token_hash=node_token_hash(token))
    return node, token


@transaction.atomic
def node_token_rotate(*, node: Node, user: AbstractBaseUser) -> str:
    """A new agent token for the owner's node (shown once, like the first); the old one stops authenticating
    the agent API when this commits. An agent still running with the old token is refused from its next
    heartbeat on, and the node is lost after its grace period until the agent is restarted with the new one."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can rotate its token")
    token = _node_token_new()
    node.token_hash = node_token_hash(token)
    node.save(update_fields=["token_hash"])
    return token


def nodes_mark_ready(*, node_ids: Sequence[object], now: datetime) -> int:
    """Ready for these registered nodes, whose agents heartbeat: the ones not Ready yet change (the others keep
    their transition time), and the reconciler is nudged when any did. How many changed. Both heartbeat paths
    call it (`node_heartbeat`, and the quiet one for many nodes at once: controlplane/agents/heartbeat.py)."""
    changed = (
        Node.objects.filter(pk__in=node_ids, registered_at__isnull=False)
        .exclude(ready_status=ReadyStatus.TRUE)
        .update(ready_status=ReadyStatus.TRUE, ready_reason="AgentReady",
                ready_message="the node agent is heartbeating", ready_transition_at=now)
    )
    if changed:
        metrics.NODE_READY_TRANSITIONS.labels(ready=TRUE).inc(changed)
        reconcile_soon()
    return changed


def node_flag(*, node: Node, reason: str, now: datetime) -> bool:
    """Flag the node (a spot check caught its work wrong, or its agent restarts too often): it takes no new
    stage and the stages it hosts move away, like a paused node's. The first reason is kept. Returns whether
    it was newly flagged."""
    flagged = Node.objects.filter(pk=node.pk, flagged_at__isnull=True).update(flagged_at=now, flag_reason=reason)
    if flagged:
        node.flagged_at, node.flag_reason = now, reason
        reconcile_soon()
    return bool(flagged)


@transaction.atomic
def node_flag_clear(*, node: Node, now: datetime, reason: str, by: AbstractBaseUser | None = None) -> bool:
    """An operator's decision that the flagged node may work again: it can be placed on again, and its
    restarts so far no longer count towards a new flag. Withheld credit stays withheld. The operator and
    their reason are recorded with the flag it replaces. Returns whether the node was flagged."""
    reason = reason.strip()
    if not reason:
        raise ApplicationError.invalid("reason", "say why the node may work again (it is recorded on the node)")
    flagged = Node.objects.select_for_update().filter(pk=node.pk, flagged_at__isnull=False).first()
    if flagged is None:
        return False
    record = f"{flagged.flag_reason} -- cleared: {reason}"
    Node.objects.filter(pk=node.pk).update(
        flagged_at=None, flag_reason="", flag_cleared_at=now, flag_clear_reason=record, flag_cleared_by=by
    )
    node.flagged_at, node.flag_reason, node.flag_cleared_at = None, "", now
    node.flag_clear_reason, node.flag_cleared_by = record, by
    reconcile_soon()
    return True


@transaction.atomic
def node_set_paused(*, node: Node, user: AbstractBaseUser, paused: bool, now: datetime) -> Node:
    """Pause (drain) or resume the node. A paused node gets no new stage; a stage it hosts is handed back:
    a running job checkpoints where it is and the stage moves to another node, so no work is lost. Only
    the node's owner, or an operator (staff, through the admin), may do this."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk and not user.is_staff:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can pause it")
    if node.paused != paused:
        node.paused, node.paused_at = paused, now if paused else None
        node.save(update_fields=["paused", "paused_at"])
        reconcile_soon()
    return node


@transaction.atomic
def node_set_controls(*, node: Node, user: AbstractBaseUser, controls: dict[str, Any]) -> Node:
    """Replace the owner's controls (working hours, idle-only, memory and thread caps); validated by the
    API. Outside its working hours, or while its owner is busy with an idle-only node, the node drains
    like a paused one."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.owner_id != user.pk:
        raise ApplicationError.forbidden(f"node {node.id} belongs to another user; only its owner can change it")
    for field, value in controls.items():
        setattr(node, field, value)
    node.save(update_fields=list(controls))
    reconcile_soon()
    return node
