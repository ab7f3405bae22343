"""`GET /metrics` (the control plane's own metrics, Prometheus text format) and `GET /metrics/agents` (the agents'
/metrics as Prometheus http_sd targets). Anyone can reach the web server's port, so both answer only the bearer
token the operator set (ARCEUS_METRICS_TOKEN): 401 without it or with another, 403 while none is set."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client.exposition import choose_encoder

from controlplane.monitoring.collector import scrape_registry
from controlplane.nodes.selectors import node_metrics_targets


def _refusal(request: HttpRequest) -> JsonResponse | None:
    """The error answer for a caller without the metrics token, or None for one with it."""
    expected = settings.ARCEUS_METRICS_TOKEN
    if not expected:
        return JsonResponse(
            {"detail": "metrics are off: the operator has not set ARCEUS_METRICS_TOKEN on the control plane"},
            status=403,
        )
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        response = JsonResponse(
            {"detail": "send the metrics token: Authorization: Bearer <ARCEUS_METRICS_TOKEN>"}, status=401
        )
        response["WWW-Authenticate"] = 'Bearer realm="arceus-metrics"'
        return response
    return None


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))  # text, or OpenMetrics if asked
    return HttpResponse(encode(scrape_registry()), content_type=content_type)


@require_GET
def agent_targets(request: HttpRequest) -> JsonResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    return JsonResponse(node_metrics_targets(now=timezone.now()), safe=False)
