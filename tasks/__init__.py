"""Celery tasks for Arceus; `celery -A tasks` finds the app here."""

from tasks.celery import app

__all__ = ["app"]
