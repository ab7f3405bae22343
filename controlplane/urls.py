"""Routes: the REST API under /api/, its schema and docs, the admin, the sign-up page, and /healthz."""

from django.conf import settings
from django.contrib import admin
from django.contrib.staticfiles.views import serve
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.accounts.pages import signup_page
from controlplane.common.health import healthz

urlpatterns = [
    path("admin/", admin.site.urls),
    re_path(r"^healthz/?$", healthz, name="healthz"),
    re_path(r"^signup/?$", signup_page, name="signup"),
    re_path(r"^api/schema/?$", SpectacularAPIView.as_view(), name="schema"),
    re_path(r"^api/docs/?$", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("api/", include("controlplane.accounts.urls")),
    path("api/", include("controlplane.nodes.urls")),
    path("api/", include("controlplane.jobs.urls")),
    path("api/", include("controlplane.market.urls")),
]

if settings.ARCEUS_SERVE_STATIC:
    # The admin's CSS and JS, straight from the apps (no collectstatic); for production put them behind
    # a web server or whitenoise instead.
    urlpatterns.append(re_path(rf"^{settings.STATIC_URL.lstrip('/')}(?P<path>.*)$", serve, {"insecure": True}))
