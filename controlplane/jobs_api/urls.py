"""Job routes under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.jobs_api.api import (
    JobCancelApi,
    JobDetailApi,
    JobEstimateApi,
    JobEstimateDetailApi,
    JobInitialWeightsApi,
    JobListCreateApi,
    JobModelApi,
    JobProgramApi,
    JobSampleApi,
    JobServeApi,
    JobTrainApi,
    NetworkInitializeApi,
    NetworkTrainApi,
)

urlpatterns = [
    re_path(r"^jobs/?$", JobListCreateApi.as_view(), name="job-list"),
    re_path(r"^jobs/estimate/?$", JobEstimateApi.as_view(), name="job-estimate"),
    # An estimate's id is a UUID: a job's routes with the job id "estimates" (/api/jobs/estimates/sample/) stay
    # theirs (a 404 for that job) instead of reaching the estimate's GET-only view (a 405).
    re_path(
        r"^jobs/estimates/(?P<estimate_id>[0-9a-fA-F-]{32,36})/?$", JobEstimateDetailApi.as_view(),
        name="job-estimate-detail",
    ),
    re_path(r"^jobs/(?P<job_id>[^/]+)/?$", JobDetailApi.as_view(), name="job-detail"),
    re_path(r"^jobs/(?P<job_id>[^/]+)/train/?$", JobTrainApi.as_view(), name="job-train"),
    re_path(r"^jobs/(?P<job_id>[^/]+)/cancel/?$", JobCancelApi.as_view(), name="job-cancel"),
    re_path(r"^jobs/(?P<job_id>[^/]+)/model(?:\.safetensors)?/?$", JobModelApi.as_view(), name="job-model"),
    re_path(r"^jobs/(?P<job_id>[^/]+)/sample/?$", JobSampleApi.as_view(), name="job-sample"),
    re_path(r"^jobs/(?P<job_id>[^/]+)/serve/?$", JobServeApi.as_view(), name="job-serve"),
    re_path(
        r"^jobs/(?P<job_id>[^/]+)/initial-weights/?$", JobInitialWeightsApi.as_view(), name="job-initial-weights"
    ),
    re_path(r"^jobs/(?P<job_id>[^/]+)/program/?$", JobProgramApi.as_view(), name="job-program"),
    # The original prototype's paths (its README's flow: submit, initialize, train).
    re_path(r"^network/initialize/(?P<job_id>[^/]+)/?$", NetworkInitializeApi.as_view(), name="network-initialize"),
    re_path(r"^network/train/(?P<job_id>[^/]+)/?$", NetworkTrainApi.as_view(), name="network-train"),
]
