"""The one-process run a pipeline test compares with: `devtools.reference.reference_run` of the job whose stages
were assigned the test's optimizer."""

from __future__ import annotations

from typing import Any

from devtools.reference import ReferenceRun, reference_run


def reference_of(
    model: dict[str, Any],
    dataset: dict[str, Any],
    optimizer: dict[str, Any],
    *,
    epochs: int,
    seed: int,
    max_steps: int,
) -> ReferenceRun:
    """`optimizer` as an assignment names it (`name`, `lr`, optional `momentum` and `weight_decay`)."""
    job = {
        "model_config": model,
        "dataset_config": dataset,
        "epochs": epochs,
        "learning_rate": optimizer["lr"],
        "optimizer": optimizer["name"],
        "momentum": optimizer.get("momentum", 0.0),
        "weight_decay": optimizer.get("weight_decay", 0.0),
        "seed": seed,
    }
    return reference_run(job, max_steps=max_steps)
