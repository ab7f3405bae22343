"""The admin is a window and a set of buttons: pages show state, actions call the services. Nothing is edited
by form (a saved form would skip the services' checks, the reconciler's optimistic concurrency and the ledger)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import BaseModelAdmin
from django.http import HttpRequest

from controlplane.common.errors import ApplicationError


class ReadOnlyAdminMixin(BaseModelAdmin):
    """Pages are view-only (every field shown, none editable; a POST to a change form is refused); no add or
    delete. Actions that declare `permissions=["operate"]` need the model's change permission: they are how
    state changes."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        """Every field but the excluded ones, shown: the ones a form would not hold (ids, timestamps) too."""
        return [f.name for f in self.model._meta.fields if f.name not in (self.exclude or ())]

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")


class ReadOnlyInline(admin.TabularInline):
    """Rows shown, none added, changed or deleted."""

    can_delete = False
    extra = 0
    max_num = 0

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return list(self.fields or [f.name for f in self.model._meta.fields])

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def act_on_each(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    objects: Iterable[Any],
    act: Callable[[Any], str],
) -> None:
    """Run `act` on each object and report what happened to it: its sentence, or the service's refusal. One
    refusal stops nothing else; every success is written to the object's admin history."""
    for obj in objects:
        try:
            done = act(obj)
        except ApplicationError as exc:
            model_admin.message_user(request, f"{obj}: {exc.message}", messages.ERROR)
            continue
        model_admin.log_change(request, obj, done)
        model_admin.message_user(request, f"{obj}: {done}", messages.SUCCESS)
