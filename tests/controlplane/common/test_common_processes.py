"""The web server and the control worker, started for real as deployed, load neither torch nor gRPC: what needs
them (the training driver, sampling through agents, the dial-backs) runs in the training and reachability
workers, which alone import those task modules. Nor numpy or Hugging Face's tokenizers (~18 MiB in each process):
reading an uploaded dataset's arrays or training a tokenizer imports them where it happens."""

from __future__ import annotations

import os

import pytest

from bench.process_memory import ROOT, control_worker, web_server


@pytest.mark.slow
@pytest.mark.parametrize("start", [web_server, control_worker], ids=["web server", "control worker"])
def test_a_started_control_plane_process_maps_neither_torch_grpc_numpy_nor_tokenizers(start) -> None:  # noqa: ANN001
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARCEUS_DEBUG": "1"}
    found = start(env)  # read from /proc/PID/maps once it serves: each library's extension mapped, or not
    assert not any(found[name] for name in ("torch", "grpc", "numpy", "tokenizers")), found
