"""`manage.py bootstrap_demo_user --username U --password P`: ensure the user; print its API token last."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from controlplane.accounts.services import user_ensure, user_token_get_or_create


class Command(BaseCommand):
    help = "Create (or reset the password of) a user and print its API token as the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", required=True)
        parser.add_argument("--password", required=True)

    def handle(self, *args: Any, username: str, password: str, **options: Any) -> None:
        user = user_ensure(username=username, password=password)
        self.stdout.write(user_token_get_or_create(user=user))
