"""The agents' routes under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.agents.api import (
    AgentChallengeApi,
    AgentCheckpointApi,
    AgentCheckpointPartsApi,
    AgentCheckpointPartsCompleteApi,
    AgentCheckpointUploadApi,
    AgentDatasetReadApi,
    AgentHeartbeatApi,
    AgentInitialWeightsApi,
    AgentLeaveApi,
    AgentProbeApi,
    AgentProgramApi,
    AgentRegisterApi,
)

urlpatterns = [
    re_path(r"^agent/challenge/?$", AgentChallengeApi.as_view(), name="agent-challenge"),
    re_path(r"^agent/register/?$", AgentRegisterApi.as_view(), name="agent-register"),
    re_path(r"^agent/heartbeat/?$", AgentHeartbeatApi.as_view(), name="agent-heartbeat"),
    re_path(r"^agent/leave/?$", AgentLeaveApi.as_view(), name="agent-leave"),
    re_path(r"^agent/probe/?$", AgentProbeApi.as_view(), name="agent-probe"),
    re_path(r"^agent/checkpoints/(?P<checkpoint_id>[^/]+)/?$", AgentCheckpointApi.as_view(), name="agent-checkpoint"),
    re_path(
        r"^agent/jobs/(?P<job_id>[^/]+)/initial-weights/?$",
        AgentInitialWeightsApi.as_view(),
        name="agent-initial-weights",
    ),
    re_path(r"^agent/jobs/(?P<job_id>[^/]+)/program/?$", AgentProgramApi.as_view(), name="agent-program"),
    re_path(
        r"^agent/jobs/(?P<job_id>[^/]+)/dataset-reads/?$", AgentDatasetReadApi.as_view(), name="agent-dataset-reads"
    ),
    re_path(
        r"^agent/checkpoint-uploads/(?P<upload_id>[^/]+)/parts/?$",
        AgentCheckpointPartsApi.as_view(),
        name="agent-checkpoint-upload-parts",
    ),
    re_path(
        r"^agent/checkpoint-uploads/(?P<upload_id>[^/]+)/parts/complete/?$",
        AgentCheckpointPartsCompleteApi.as_view(),
        name="agent-checkpoint-upload-parts-complete",
    ),
    re_path(
        r"^agent/checkpoint-uploads/(?P<upload_id>[^/]+)/?$",
        AgentCheckpointUploadApi.as_view(),
        name="agent-checkpoint-upload",
    ),
]
