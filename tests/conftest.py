"""Fixtures shared across the test tree."""

from __future__ import annotations

import pytest

from devtools.agent_wheel import InstalledAgent, install_agent


@pytest.fixture(scope="session")
def installed_agent(tmp_path_factory: pytest.TempPathFactory) -> InstalledAgent:
    """The agent as a contributor installs it (devtools.agent_wheel), built once per session."""
    return install_agent(tmp_path_factory.mktemp("agent-wheel"))
