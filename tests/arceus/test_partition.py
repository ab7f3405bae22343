"""The partition strategies as job fields (arceus.partition): never more devices than are ready, never more
stages than layers, tensor parallelism only in "hybrid" for a model that splits, every device used when it can."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arceus.errors import SpecError
from arceus.partition import MIN_HYBRID_DEVICES, TENSOR_PARALLEL_WIDTH, Partition, partition_for

layers = st.integers(min_value=1, max_value=200)
devices = st.integers(min_value=1, max_value=500)


@given(num_layers=layers, ready=devices, splits=st.booleans())
def test_pipeline_is_one_stage_per_device_up_to_the_layers(num_layers: int, ready: int, splits: bool) -> None:
    plan = partition_for("pipeline", num_layers=num_layers, splits=splits, ready_devices=ready)
    assert plan == Partition(stages=min(num_layers, ready), split_stages=())
    assert plan.job_fields() == {"stages": min(num_layers, ready), "tensor_parallel": {}}


@given(num_layers=layers, ready=devices, splits=st.booleans())
def test_hybrid_fits_the_devices_and_splits_only_where_it_can(num_layers: int, ready: int, splits: bool) -> None:
    plan = partition_for("hybrid", num_layers=num_layers, splits=splits, ready_devices=ready)
    assert 1 <= plan.stages <= num_layers
    assert plan.devices <= ready
    split = plan.split_stages
    assert list(split) == list(range(plan.stages - len(split), plan.stages))  # the last stages, each once
    if not splits or ready < MIN_HYBRID_DEVICES:
        assert split == ()
        assert plan.stages == min(num_layers, ready)
    else:
        assert split  # a model that splits, on enough devices, is split
        if num_layers * TENSOR_PARALLEL_WIDTH >= ready:  # enough layers: no device idles
            assert plan.devices == ready
        fields = plan.job_fields()
        assert fields["tensor_parallel"] == {"size": TENSOR_PARALLEL_WIDTH, "stages": list(split)}


def test_the_tested_shape_three_devices_two_stages_the_second_a_pair() -> None:
    plan = partition_for("hybrid", num_layers=4, splits=True, ready_devices=3)
    assert plan.job_fields() == {"stages": 2, "tensor_parallel": {"size": 2, "stages": [1]}}


def test_an_unknown_strategy_is_named() -> None:
    with pytest.raises(SpecError, match="partition_strategy.*pipeline, hybrid.*'data'"):
        partition_for("data", num_layers=4, splits=True, ready_devices=3)
