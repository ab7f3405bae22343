"""`GET /healthz`: 200 once the web process can reach its database (for load balancers and the local
cluster launcher); 503 with the reason otherwise. No authentication, no DRF."""

from __future__ import annotations

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        return JsonResponse({"status": "unavailable", "detail": f"database: {exc}"}, status=503)
    return JsonResponse({"status": "ok"})
