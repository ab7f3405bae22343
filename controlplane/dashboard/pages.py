"""The dashboard's pages and the small JSON documents their scripts poll. Each page or document is its user's
own (login required; another user's job or node is a 404, as in the API); forms are CSRF-protected and
validated by the API's input serializers, then handed to the same service the API calls."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django import forms
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from rest_framework.serializers import Serializer
from rest_framework.throttling import ScopedRateThrottle

from controlplane.accounts.api import TokenObtainApi
from controlplane.common.db import consistent_snapshot
from controlplane.common.errors import ApplicationError
from controlplane.dashboard.forms import JobSubmitForm, NodeControlsForm
from controlplane.dashboard.selectors import dashboard_job, dashboard_jobs, dashboard_market, dashboard_nodes
from controlplane.jobs.selectors import job_get_for_user
from controlplane.jobs.services import job_cancel, job_start, job_submit
from controlplane.jobs_api.serializers import JobSubmitInput
from controlplane.nodes.selectors import node_get_for_user
from controlplane.nodes.serializers import NodeControlsInput
from controlplane.nodes.services import node_set_controls, node_set_paused

View = Callable[..., HttpResponseBase]


def _not_found_as_404(view: View) -> View:
    """The selectors' "not found" (a malformed id, or another user's) as Django's 404 page."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        try:
            return view(request, *args, **kwargs)
        except ApplicationError as exc:
            if exc.status == 404:
                raise Http404(exc.message) from None
            raise

    return wrapped


class DashboardLoginView(LoginView):
    """Django's login, counted in the same per-address bucket as POST /api/auth/token: guessing passwords
    here is no faster than through the API."""

    template_name = "dashboard/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        throttle = ScopedRateThrottle()
        if not throttle.allow_request(request, TokenObtainApi):
            form = self.get_form()
            form.add_error(None, f"Too many attempts from your address; try again in {int(throttle.wait() or 1)} s.")
            return self.render_to_response(self.get_context_data(form=form), status=429)
        return super().post(request, *args, **kwargs)


def _api_errors(form: forms.Form, errors: dict[str, Any]) -> None:
    """An API serializer's (or service's) errors onto the form's fields, nested ones named by their path."""
    for field, messages in errors.items():
        if isinstance(messages, dict):
            _api_errors(form, {f"{field}.{k}": v for k, v in messages.items()})
            continue
        top = field.split(".", 1)[0]
        for message in messages if isinstance(messages, list) else [messages]:
            if top in form.fields:  # "model_config.layer_sizes" goes under model_config, naming its key
                form.add_error(top, str(message) if top == field else f"{field}: {message}")
            elif field in ("__all__", "non_field_errors"):
                form.add_error(None, str(message))
            else:
                form.add_error(None, f"{field}: {message}")


def _validated(form: forms.Form, serializer: Serializer) -> dict[str, Any] | None:
    if serializer.is_valid():
        return dict(serializer.validated_data)
    _api_errors(form, serializer.errors)
    return None


@login_required
@require_http_methods(["GET", "POST"])
def jobs_page(request: HttpRequest) -> HttpResponse:
    """GET: the user's jobs and the submit form. POST: submit (and start) a job, then its live page."""
    form = JobSubmitForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        data = _validated(form, JobSubmitInput(data=form.api_input()))
        if data is not None:
            try:
                job = job_submit(owner=request.user, **data)
                if form.cleaned_data["start"]:
                    job = job_start(job=job)
            except ApplicationError as exc:
                _api_errors(form, exc.errors or {"__all__": [exc.message]})
            else:
                return redirect("dashboard-job", job_id=job.id)
    status = 400 if request.method == "POST" else 200
    return render(request, "dashboard/jobs.html", {"form": form, "jobs": dashboard_jobs(user=request.user)},
                  status=status)


@login_required
@require_GET
def jobs_live(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"jobs": dashboard_jobs(user=request.user)})


@login_required
@require_GET
@_not_found_as_404
def job_page(request: HttpRequest, job_id: str) -> HttpResponse:
    job = job_get_for_user(user=request.user, job_id=job_id)
    return render(request, "dashboard/job.html", {"job": job, "live": dashboard_job(job=job)})


@login_required
@require_GET
@_not_found_as_404
def job_live(request: HttpRequest, job_id: str) -> JsonResponse:
    with consistent_snapshot():
        return JsonResponse(dashboard_job(job=job_get_for_user(user=request.user, job_id=job_id)))


@login_required
@require_POST
@_not_found_as_404
def job_cancel_page(request: HttpRequest, job_id: str) -> HttpResponse:
    """Cancel one's job, as POST /api/jobs/<id>/cancel does; a job that already ended is a 409 saying so."""
    job = job_get_for_user(user=request.user, job_id=job_id)
    try:
        job_cancel(job=job)
    except ApplicationError as exc:
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain; charset=utf-8")
    return redirect("dashboard-job", job_id=job.id)


@login_required
@require_GET
def nodes_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/nodes.html", {"nodes": _with_controls_forms(dashboard_nodes(user=request.user))})


def _with_controls_forms(nodes: list[dict[str, Any]], bound: NodeControlsForm | None = None) -> list[dict[str, Any]]:
    """Each node with the form of its controls: as they are, or, for the node `bound` was posted for, as posted
    (with its errors)."""
    for node in nodes:
        controls = node["controls"]
        node["controls_form"] = bound if bound is not None and bound.prefix == str(node["id"]) else NodeControlsForm(
            initial={**controls, "work_windows": ", ".join(controls["work_windows"])}, prefix=str(node["id"])
        )
    return nodes


@login_required
@require_GET
def nodes_live(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"nodes": dashboard_nodes(user=request.user)})


@login_required
@require_POST
@_not_found_as_404
def node_pause(request: HttpRequest, node_id: str, *, paused: bool) -> HttpResponse:
    """Pause (drain) or resume one's node, as POST /api/nodes/<id>/pause and /resume do."""
    node = node_get_for_user(user=request.user, node_id=node_id)
    node_set_paused(node=node, user=request.user, paused=paused, now=timezone.now())
    return redirect("dashboard-nodes")


@login_required
@require_POST
@_not_found_as_404
def node_controls(request: HttpRequest, node_id: str) -> HttpResponse:
    """Replace one's node's controls, as PUT /api/nodes/<id>/controls does; the page again with the errors."""
    node = node_get_for_user(user=request.user, node_id=node_id)
    form = NodeControlsForm(request.POST, prefix=str(node.id))
    if form.is_valid():
        data = _validated(form, NodeControlsInput(data=form.api_input()))
        if data is not None:
            node_set_controls(node=node, user=request.user, controls=data)
            return redirect("dashboard-nodes")
    nodes = _with_controls_forms(dashboard_nodes(user=request.user), bound=form)
    return render(request, "dashboard/nodes.html", {"nodes": nodes}, status=400)


@login_required
@require_GET
def market_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/market.html", {"market": dashboard_market()})


@login_required
@require_GET
def market_live(request: HttpRequest) -> JsonResponse:
    return JsonResponse(dashboard_market())
