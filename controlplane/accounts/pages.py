"""The sign-up page: a server-rendered form (CSRF-protected) over the same service and limit as
POST /api/auth/register."""

from __future__ import annotations

from django import forms
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_protect
from rest_framework.throttling import ScopedRateThrottle

from controlplane.accounts.api import RegisterApi
from controlplane.accounts.services import user_register, user_token_get_or_create
from controlplane.common.errors import ApplicationError


class SignupForm(forms.Form):
    username = forms.CharField(max_length=150, validators=[UnicodeUsernameValidator()])
    email = forms.EmailField(max_length=254)
    password = forms.CharField(max_length=128, strip=False, widget=forms.PasswordInput)


@csrf_protect
def signup_page(request: HttpRequest) -> HttpResponse:
    """GET: the form. POST: the account, and its API token shown on the page (or the form with its errors)."""
    form = SignupForm(request.POST if request.method == "POST" else None)
    if request.method != "POST" or not form.is_valid():
        return render(request, "accounts/signup.html", {"form": form})
    throttle = ScopedRateThrottle()
    if not throttle.allow_request(request, RegisterApi):  # the API's bucket: one limit per address for both
        form.add_error(None, f"Too many sign-ups from your address; try again in {int(throttle.wait() or 1)} s.")
        return render(request, "accounts/signup.html", {"form": form}, status=429)
    try:
        user = user_register(**form.cleaned_data)
    except ApplicationError as exc:
        for field, messages in exc.errors.items():
            for message in messages:
                form.add_error(field if field in form.fields else None, message)
        return render(request, "accounts/signup.html", {"form": form}, status=exc.status)
    token = user_token_get_or_create(user=user)
    return render(request, "accounts/signup.html", {"user_created": user, "token": token}, status=201)
