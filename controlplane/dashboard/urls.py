"""Dashboard routes under /dashboard/: pages, and the JSON documents their scripts poll (`live.json`)."""

from django.contrib.auth.views import LogoutView
from django.urls import path

from controlplane.dashboard import pages

urlpatterns = [
    path("", pages.jobs_page, name="dashboard-jobs"),
    path("login/", pages.DashboardLoginView.as_view(), name="dashboard-login"),
    path("logout/", LogoutView.as_view(next_page="dashboard-login"), name="dashboard-logout"),
    path("jobs/live.json", pages.jobs_live, name="dashboard-jobs-live"),
    path("jobs/<str:job_id>/", pages.job_page, name="dashboard-job"),
    path("jobs/<str:job_id>/live.json", pages.job_live, name="dashboard-job-live"),
    path("jobs/<str:job_id>/cancel", pages.job_cancel_page, name="dashboard-job-cancel"),
    path("nodes/", pages.nodes_page, name="dashboard-nodes"),
    path("nodes/live.json", pages.nodes_live, name="dashboard-nodes-live"),
    path("nodes/<str:node_id>/pause", pages.node_pause, {"paused": True}, name="dashboard-node-pause"),
    path("nodes/<str:node_id>/resume", pages.node_pause, {"paused": False}, name="dashboard-node-resume"),
    path("nodes/<str:node_id>/controls", pages.node_controls, name="dashboard-node-controls"),
    path("market/", pages.market_page, name="dashboard-market"),
    path("market/live.json", pages.market_live, name="dashboard-market-live"),
]
