"""The owners' node routes under /api/ (each with or without a trailing slash); the agents' are
controlplane/agents/urls.py."""

from django.urls import re_path

from controlplane.nodes.api import (
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
]
