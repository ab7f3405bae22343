"""Node routes under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.nodes.api import (
    AgentChallengeApi,
    AgentHeartbeatApi,
    AgentLeaveApi,
    AgentProbeApi,
    AgentRegisterApi,
    NodeControlsApi,
    NodeDetailApi,
    NodeListCreateApi,
    NodePauseApi,
    NodeResumeApi,
    NodeTokenRotateApi,
)

urlpatterns = [
    re_path(r"^nodes/?$", NodeListCreateApi.as_view(), name="node-list"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/?$", NodeDetailApi.as_view(), name="node-detail"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/pause/?$", NodePauseApi.as_view(), name="node-pause"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/resume/?$", NodeResumeApi.as_view(), name="node-resume"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/controls/?$", NodeControlsApi.as_view(), name="node-controls"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/token/rotate/?$", NodeTokenRotateApi.as_view(), name="node-token-rotate"),
    re_path(r"^agent/challenge/?$", AgentChallengeApi.as_view(), name="agent-challenge"),
    re_path(r"^agent/register/?$", AgentRegisterApi.as_view(), name="agent-register"),
    re_path(r"^agent/heartbeat/?$", AgentHeartbeatApi.as_view(), name="agent-heartbeat"),
    re_path(r"^agent/leave/?$", AgentLeaveApi.as_view(), name="agent-leave"),
    re_path(r"^agent/probe/?$", AgentProbeApi.as_view(), name="agent-probe"),
]
