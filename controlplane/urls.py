"""Routes: the REST API under /api/, its schema and docs, the admin, the sign-up page, the dashboard under
/dashboard/ (the site's root leads there), /healthz, and Prometheus's /metrics and /metrics/agents. Static files
are WhiteNoise's (controlplane.settings, STATIC_ROOT)."""

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.accounts.pages import signup_page
from controlplane.common.health import healthz
from controlplane.monitoring.views import agent_targets, metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    re_path(r"^healthz/?$", healthz, name="healthz"),
    re_path(r"^signup/?$", signup_page, name="signup"),
    re_path(r"^metrics/?$", metrics, name="metrics"),
    re_path(r"^metrics/agents/?$", agent_targets, name="metrics-agents"),
    path("", RedirectView.as_view(pattern_name="dashboard-jobs"), name="home"),
    path("dashboard/", include("controlplane.dashboard.urls")),
    re_path(r"^api/schema/?$", SpectacularAPIView.as_view(), name="schema"),
    re_path(r"^api/docs/?$", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("api/", include("controlplane.accounts.urls")),
    path("api/", include("controlplane.nodes.urls")),
    path("api/", include("controlplane.agents.urls")),
    path("api/", include("controlplane.jobs_api.urls")),
    path("api/", include("controlplane.datasets.urls")),
    path("api/", include("controlplane.market.urls")),
]


handler404 = "controlplane.common.exception_handler.page_not_found"  # JSON under /api/
