"""How a user sees a node that is not theirs: a node's name is its owner's to share (it may name a person or a
place), so jobs, conditions and pages show another contributor's node by the start of its opaque id."""

from __future__ import annotations

from typing import Any

OTHERS_NODE = "another contributor's node"


def node_label(*, node_id: Any, name: str, owner_id: Any, viewer_id: Any) -> str:
    """A node as `viewer_id` may name it: one of theirs by its name, another contributor's by the start of its id,
    enough to tell a job's nodes apart."""
    return name if owner_id == viewer_id else f"{OTHERS_NODE} {str(node_id)[:8]}"
