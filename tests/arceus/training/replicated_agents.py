"""Agents in the test process hosting a replicated job (the in-process setup of the replica audit and repair tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from arceus.contracts.assignment import Assignment
from devtools.pipeline import remember_identity, replicated_pipeline_assignments
from nodeagent.agent import Agent


@contextmanager
def agents_hosting(
    placement: list[list[int]], *, agent: Mapping[str, Any] | None = None,
    adapt: Callable[[Assignment], Assignment] = lambda assignment: assignment, **job: Any,
) -> Iterator[list[Agent]]:
    """Agents on CPU, started here, stage i's replica r on agent `placement[i][r]`; `job`: the other arguments of
    devtools.pipeline.replicated_pipeline_assignments. `agent`: the agents' other arguments (an exported model's
    loaders), `adapt`: what each assignment becomes before it is applied. Those still serving are stopped afterwards."""
    hosts = 1 + max(a for stage in placement for a in stage)
    started = [Agent(device=torch.device("cpu"), **(agent or {})) for _ in range(hosts)]
    for agent in started:
        agent.start()
        remember_identity(agent.advertise_address, agent.identity)
    stages = replicated_pipeline_assignments(
        addresses=[[started[a].advertise_address for a in stage] for stage in placement], **job
    )
    for stage, hosts in zip(stages, placement, strict=True):
        for assignment, host in zip(stage, hosts, strict=True):
            started[host].apply_assignments([adapt(Assignment.from_json(assignment))])
    try:
        yield started
    finally:
        for agent in started:
            if agent.registry.stages():  # a test may have stopped one already
                agent.stop(0)
