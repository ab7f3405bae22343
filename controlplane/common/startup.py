"""Checks a serving process (the web server, a Celery worker or beat) runs before it serves."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def refuse_development_secret() -> None:
    """ImproperlyConfigured where the process would serve on the public development SECRET_KEY outside debug:
    anyone who read the repository could forge sessions and every data-plane credential."""
    if settings.SECRET_KEY == settings.DEVELOPMENT_SECRET_KEY and not settings.DEBUG:
        raise ImproperlyConfigured(
            "ARCEUS_SECRET_KEY is not set, so this process would run on the public development key; set it to a "
            "long random secret shared by the web server and the Celery processes (for example the output of "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))'), or set ARCEUS_DEBUG=1 for development"
        )
