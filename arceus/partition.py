"""A `DistributedTrainer`'s partition strategy as job fields (pure): how many pipeline stages, and which of
them a tensor-parallel pair splits, for the devices ready now. The placement solver still decides which
layers each stage holds and which devices host them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from arceus.errors import SpecError

PARTITION_STRATEGIES = ("pipeline", "hybrid")
TENSOR_PARALLEL_WIDTH = 2  # a split stage's ranks: the narrowest split, so the most stages stay pipelined
MIN_HYBRID_DEVICES = 3  # below this a split would leave no pipeline


@dataclass(frozen=True)
class Partition:
    stages: int
    split_stages: tuple[int, ...]  # each on TENSOR_PARALLEL_WIDTH devices

    @property
    def devices(self) -> int:
        return self.stages + (TENSOR_PARALLEL_WIDTH - 1) * len(self.split_stages)

    def job_fields(self) -> dict[str, Any]:
        split = {"size": TENSOR_PARALLEL_WIDTH, "stages": list(self.split_stages)} if self.split_stages else {}
        return {"stages": self.stages, "tensor_parallel": split}


def partition_for(strategy: str, *, num_layers: int, splits: bool, ready_devices: int) -> Partition:
    """`pipeline`: one stage per ready device, at most one per layer. `hybrid`: where the model `splits` in two
    (its architecture has tensor-parallel layers whose sizes 2 divides) and at least 3 devices are ready, about
    half as many stages, the last ones (the blocks and the head, not the embedding) each split over a pair, so
    every ready device works; otherwise as `pipeline`. Never more devices than are ready."""
    if strategy not in PARTITION_STRATEGIES:
        raise SpecError("partition_strategy", f"must be one of {', '.join(PARTITION_STRATEGIES)}, got {strategy!r}")
    if ready_devices < 1 or num_layers < 1:
        raise ValueError(f"a partition needs a device and a layer, got {ready_devices} and {num_layers}")
    if strategy == "pipeline" or not splits or ready_devices < MIN_HYBRID_DEVICES:
        return Partition(stages=min(num_layers, ready_devices), split_stages=())
    stages = min(num_layers, math.ceil(ready_devices / TENSOR_PARALLEL_WIDTH))
    split = min(stages, (ready_devices - stages) // (TENSOR_PARALLEL_WIDTH - 1))
    return Partition(stages=stages, split_stages=tuple(range(stages - split, stages)))
