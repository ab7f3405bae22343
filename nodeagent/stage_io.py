"""What a hosted stage accepts (`StageIO`): everything a tensor that arrives is checked against (nodeagent.validation)
before torch sees it."""

from __future__ import annotations

from dataclasses import dataclass

from arceus.model.layout import TensorLayout


@dataclass(frozen=True)
class StageIO:
    """What this stage accepts: everything a pushed tensor is checked against before torch sees it.
    Layouts are per sample, as the model spec gives them."""

    input_layout: TensorLayout  # the activations (or, on the first stage, the model's inputs) it takes
    output_layout: TensorLayout  # what it sends on, and so the shape of the gradient it gets back
    label_layout: TensorLayout
    max_micro_batch_size: int
    micro_batches: int
    # Its assignment's schedule: a step may follow one that holds no more micro-batches at once (the
    # memory budget was checked for this one).
    schedule: str
    stage_index: int
    num_stages: int
    is_first: bool
    is_last: bool
