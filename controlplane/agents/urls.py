"""Agent routes for a job's files under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.agents.api import (
    AgentCheckpointApi,
    AgentCheckpointUploadApi,
    AgentInitialWeightsApi,
    AgentProgramApi,
)

urlpatterns = [
    re_path(r"^agent/checkpoints/(?P<checkpoint_id>[^/]+)/?$", AgentCheckpointApi.as_view(), name="agent-checkpoint"),
    re_path(
        r"^agent/jobs/(?P<job_id>[^/]+)/initial-weights/?$",
        AgentInitialWeightsApi.as_view(),
        name="agent-initial-weights",
    ),
    re_path(r"^agent/jobs/(?P<job_id>[^/]+)/program/?$", AgentProgramApi.as_view(), name="agent-program"),
    re_path(
        r"^agent/checkpoint-uploads/(?P<upload_id>[^/]+)/?$",
        AgentCheckpointUploadApi.as_view(),
        name="agent-checkpoint-upload",
    ),
]
