"""Static assignments (like Kubernetes static pods): run stages from a JSON file, no control plane.

The file is a JSON list of Assignment objects (docs/architecture.md); `devtools.pipeline` writes such a
list for a model cut into consecutive stages, for tests and benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path

from arceus.checkpoint import StateFile
from arceus.contracts.assignment import Assignment, CheckpointRef
from arceus.errors import SpecError


def load_static_assignments(path: Path) -> list[Assignment]:
    """Parse the file; raises SpecError naming the file and the bad assignment."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SpecError("static_assignment", f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise SpecError("static_assignment", f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise SpecError(
            "static_assignment", f"{path} must hold a JSON list of assignments, got {type(data).__name__}"
        )
    assignments = []
    for index, item in enumerate(data):
        try:
            assignments.append(Assignment.from_json(item))
        except SpecError as exc:
            raise SpecError(
                f"static_assignment[{index}].{exc.field.removeprefix('assignment.')}",
                f"{exc.message} (in {path})",
            ) from exc
    return assignments


def load_local_checkpoint(ref: CheckpointRef) -> StateFile:
    """Static assignments name checkpoints by a local file path in `url`; its tensors load one at a time."""
    return StateFile(Path(ref.url), sha256=ref.sha256)
