"""Static assignments (like Kubernetes static pods): run stages from a JSON file, no control plane.

The file is a JSON list of Assignment objects (docs/architecture.md). `pipeline_assignments` writes
such a list for a model cut into consecutive stages, for tests and benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from arceus.checkpoint import decode_checkpoint
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


def load_local_checkpoint(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """Static assignments name checkpoints by a local file path in `url`."""
    return decode_checkpoint(Path(ref.url).read_bytes(), sha256=ref.sha256)


def pipeline_assignments(
    *,
    job_id: str,
    model_config: dict[str, Any],
    boundaries: Sequence[int],
    addresses: Sequence[str],
    optimizer: dict[str, Any],
    seed: int,
    micro_batches: int,
    max_micro_batch_size: int,
    generation: int = 1,
    transfer: dict[str, Any] | None = None,
    precision: str = "fp32",
) -> list[dict[str, Any]]:
    """Assignments for stages [boundaries[i], boundaries[i+1]) hosted at addresses[i]."""
    if len(boundaries) != len(addresses) + 1:
        raise ValueError(
            f"{len(addresses)} stages need {len(addresses) + 1} boundaries, got {len(boundaries)}"
        )
    n = len(addresses)
    return [
        {
            "stage_id": f"{job_id}-stage-{i}",
            "job_id": job_id,
            "stage_index": i,
            "num_stages": n,
            "generation": generation,
            "model": model_config,
            "layer_start": boundaries[i],
            "layer_end": boundaries[i + 1],
            "seed": seed,
            "optimizer": optimizer,
            "micro_batches": micro_batches,
            "max_micro_batch_size": max_micro_batch_size,
            "prev_address": addresses[i - 1] if i > 0 else None,
            "next_address": addresses[i + 1] if i < n - 1 else None,
            **({} if transfer is None else {"transfer": transfer}),
            "precision": precision,
        }
        for i in range(n)
    ]
