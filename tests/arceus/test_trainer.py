"""What `DistributedTrainer` refuses before it talks to anyone (arceus.trainer); training through it against real
agents, discovered by mDNS, is tests/e2e/test_sdk_discovery.py."""

from __future__ import annotations

import signal

import pytest
import torch

from arceus import DistributedTrainer
from arceus.sdk import TOKEN_ENV, URL_ENV
from arceus.trainer import _layer_plan, interrupted_by_ctrl_c

MLP = {"type": "mlp", "layer_sizes": [64, 32, 10]}


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"partition_strategy": "data"}, ValueError, "partition_strategy must be one of pipeline, hybrid, got 'data'"),
    ({"discovery_method": "bonjour"}, ValueError, "discovery_method must be one of auto, mdns, url"),
])
def test_unknown_choices_are_named(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DistributedTrainer(model=MLP, **kwargs)


def test_a_model_it_cannot_take_says_what_it_takes() -> None:
    with pytest.raises(TypeError, match="model must be an nn.Module or an Arceus model config .* got list"):
        DistributedTrainer(model=[64, 10])


def test_a_module_without_an_example_batch_is_captured_on_its_data_or_says_how() -> None:
    trainer = DistributedTrainer(model=torch.nn.Linear(4, 2), url="http://127.0.0.1:9", token="t")
    with pytest.raises(ValueError, match="pass example_input= to DistributedTrainer"):
        trainer.partition()


def test_without_a_token_it_says_where_one_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(URL_ENV, "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=f"no API token: pass token=... or set {TOKEN_ENV}"):
        DistributedTrainer(model=MLP).discover_peers()


def test_train_keeps_its_own_fields_and_checkpoints_only_with_fault_tolerance() -> None:
    trainer = DistributedTrainer(model=MLP, url="http://127.0.0.1:9", token="t")
    with pytest.raises(TypeError, match="train\\(\\) sets stages, tensor_parallel itself"):
        trainer.train({"name": "digits"}, stages=3, tensor_parallel={"size": 2})
    fragile = DistributedTrainer(model=MLP, url="http://127.0.0.1:9", token="t", fault_tolerance=False)
    with pytest.raises(ValueError, match="checkpoint_interval needs fault_tolerance=True"):
        fragile.train({"name": "digits"}, checkpoint_interval=10)


def test_a_text_model_is_partitioned_before_submission_fills_in_its_vocabulary() -> None:
    spec = _layer_plan({"type": "transformer", "n_layer": 3, "n_head": 4, "d_model": 32, "block_size": 16})
    assert spec.num_layers == 5  # embedding, three blocks, head


def test_ctrl_c_interrupts_also_where_sigint_was_inherited_ignored() -> None:
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), interrupted_by_ctrl_c():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # ignored again after the job
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_sigint_handler_of_the_programs_own_is_kept() -> None:
    seen: list[int] = []
    inherited = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with interrupted_by_ctrl_c():
            signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, inherited)
