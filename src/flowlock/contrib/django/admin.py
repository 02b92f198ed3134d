"""Read-only admin pages for flowlock's instances, with their history inline, and two actions
on the selected instances: fire an event, force a state (with a reason).

Nothing here writes a row through Django's ORM: the actions call the engine, so every change is
a compare-and-swap with a history row, as from any other caller. Each action's form carries a
request id made when the form is shown; the engine applies each instance's call once per id,
so a form submitted twice (a double click, a resent POST) applies once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from django import forms
from flowlock.contrib.django.conf import config
from flowlock.contrib.django.models import History, Instance, WorkflowPause
from flowlock.core.errors import FlowlockError
from flowlock.core.models import Outcome
from flowlock.sync import Engine

__all__ = ["FireForm", "ForceForm", "HistoryInline", "InstanceAdmin", "WorkflowPauseAdmin"]

MAX_SELECTED = 500
"""The most instances one action takes (each is one call; a larger set is a bulk operation)."""


def _alias() -> str:
    return config().alias


def new_request_id() -> str:
    """A form's request id: one per form shown, so that submitting it again replays."""
    return f"django-admin-{uuid.uuid4().hex}"


class _ActionForm(forms.Form):
    request_id = forms.CharField(widget=forms.HiddenInput, max_length=100)

    def clean_request_id(self) -> str:
        value: str = self.cleaned_data["request_id"]
        if not value.startswith("django-admin-"):
            raise forms.ValidationError("not a request id of this form; open the form again")
        return value


class FireForm(_ActionForm):
    """Fire an event at each selected instance."""

    event = forms.CharField(max_length=200, help_text="The event's name, as the workflow has it.")
    payload = forms.JSONField(
        required=False,
        initial=dict,
        help_text="A JSON object passed to the guard and effect, kept in the history row.",
    )

    def clean_payload(self) -> dict[str, Any]:
        value = self.cleaned_data.get("payload")
        if value in (None, ""):
            return {}
        if not isinstance(value, dict):
            raise forms.ValidationError("the payload must be a JSON object")
        return value


class ForceForm(_ActionForm):
    """Move each selected instance to a state, with a reason."""

    state = forms.ChoiceField(help_text="Any state of the instance's workflow.")
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}),
        max_length=2000,
        help_text="Why: kept in the history row with your user name.",
    )

    def __init__(self, *args: Any, states: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["state"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [(s, s) for s in states]


class HistoryInline(admin.TabularInline):  # type: ignore[type-arg]
    """The instance's history, oldest first, read-only."""

    model = History
    fk_name = "instance"
    extra = 0
    max_num = 0
    can_delete = False
    fields = ("version", "event", "from_state", "to_state", "actor", "at", "payload", "request_id")
    readonly_fields = fields
    ordering = ("version",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[History]:
        return super().get_queryset(request).using(_alias())

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Instance)
class InstanceAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Instances: list filters by workflow and state, search by id (exact or prefix), the
    history inline; nothing editable, no add or delete. The actions need the permission to
    change instances (`flowlock.change_instance`; a superuser has it)."""

    list_display = (
        "id",
        "workflow",
        "state",
        "version",
        "paused",
        "workflow_paused",
        "last_event",
        "updated_at",
    )
    list_filter = ("workflow", "state", "paused")
    search_fields = ("id",)
    search_help_text = "An instance id, or the start of one."
    readonly_fields = (
        "id",
        "workflow",
        "state",
        "version",
        "data",
        "last_event",
        "created_at",
        "updated_at",
        "stay_version",
        "paused",
    )
    inlines = (HistoryInline,)
    actions = ("fire_event", "force_state")
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Instance]:
        # Open (idempotent): flowlock's own migrations make and update the tables read here.
        _engine().open()
        paused = WorkflowPause.objects.using(_alias()).filter(workflow=OuterRef("workflow"))
        found: QuerySet[Instance] = super().get_queryset(request).using(_alias())
        return found.annotate(workflow_paused=Exists(paused))

    @admin.display(boolean=True, description="workflow paused")
    def workflow_paused(self, obj: Instance) -> bool:
        """Whether the instance's whole workflow is paused (one row for all its instances)."""
        return bool(getattr(obj, "workflow_paused", False))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Instance], search_term: str
    ) -> tuple[QuerySet[Instance], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # Case-sensitive, as ids are: the ids that start with the term (the exact id included).
        return queryset.filter(id__startswith=term), False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Who may run the actions: whoever may change instances (flowlock's operators)."""
        return bool(request.user.has_perm("flowlock.change_instance"))  # type: ignore[union-attr]

    # -- the actions --------------------------------------------------------------------------

    @admin.action(description="Fire an event at the selected instances", permissions=["operate"])
    def fire_event(self, request: HttpRequest, queryset: QuerySet[Instance]) -> HttpResponse | None:
        ids = self._selected(queryset)
        if "apply" in request.POST:
            form = FireForm(request.POST)
            if form.is_valid():
                event, payload = form.cleaned_data["event"], form.cleaned_data["payload"]
                self._apply(
                    request,
                    ids,
                    form.cleaned_data["request_id"],
                    f"fire {event!r}",
                    lambda iid, rid, actor: _engine().fire(
                        iid, event, actor=actor, request_id=rid, payload=payload
                    ),
                )
                return None
        else:
            form = FireForm(initial={"request_id": new_request_id(), "payload": {}})
        return self._form_page(request, ids, form, "fire_event", "Fire an event")

    @admin.action(description="Force a state on the selected instances", permissions=["operate"])
    def force_state(
        self, request: HttpRequest, queryset: QuerySet[Instance]
    ) -> HttpResponse | None:
        ids = self._selected(queryset)
        states = _states_of(queryset)
        if "apply" in request.POST:
            form = ForceForm(request.POST, states=states)
            if form.is_valid():
                state, reason = form.cleaned_data["state"], form.cleaned_data["reason"]
                self._apply(
                    request,
                    ids,
                    form.cleaned_data["request_id"],
                    f"force {state!r}",
                    lambda iid, rid, actor: _engine().force(
                        iid, state, reason=reason, actor=actor, request_id=rid
                    ),
                )
                return None
        else:
            form = ForceForm(initial={"request_id": new_request_id()}, states=states)
        return self._form_page(request, ids, form, "force_state", "Force a state")

    def _selected(self, queryset: QuerySet[Instance]) -> list[str]:
        return [str(i) for i in queryset.order_by("id").values_list("id", flat=True)[:MAX_SELECTED]]

    def _form_page(
        self, request: HttpRequest, ids: list[str], form: forms.Form, action: str, title: str
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "form": form,
            "ids": ids,
            "action": action,
            "opts": self.model._meta,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "limit": MAX_SELECTED,
            "media": self.media + form.media,
        }
        return TemplateResponse(request, "flowlock/admin/action.html", context)

    def _apply(
        self,
        request: HttpRequest,
        ids: list[str],
        form_request_id: str,
        what: str,
        call: Callable[[str, str, str], Outcome],
    ) -> None:
        """`call` on each instance under the form's request id (one per instance), then one
        message saying what was applied, replayed (this form was submitted before) or
        refused, and why."""
        actor = request.user.get_username()
        applied: list[str] = []
        replayed: list[str] = []
        refused: list[str] = []
        for iid in ids:
            try:
                outcome = call(iid, f"{form_request_id}:{iid}", actor)
            except FlowlockError as exc:
                refused.append(f"{iid}: {exc}")
                continue
            (applied if outcome.applied else replayed).append(iid)
        parts = [f"{what}: {len(applied)} applied"]
        if replayed:
            parts.append(
                f"{len(replayed)} already done by this form (submitted before; not applied "
                "again) or a no-op"
            )
        if refused:
            parts.append(f"{len(refused)} refused ({'; '.join(refused[:10])})")
        level = messages.WARNING if refused else messages.SUCCESS
        self.message_user(request, ", ".join(parts), level)


@admin.register(WorkflowPause)
class WorkflowPauseAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The paused workflows, read-only: pause and resume them with the engine (or
    `flowlock admin`), so each is recorded with its reason and actor."""

    list_display = ("workflow", "reason", "actor", "at")
    readonly_fields = ("workflow", "reason", "actor", "at")

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowPause]:
        _engine().open()
        return super().get_queryset(request).using(_alias())

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _engine() -> Engine:
    from flowlock.contrib.django import engine

    return engine()


def _states_of(queryset: QuerySet[Instance]) -> list[str]:
    """The states of the selected instances' workflows, as registered with the engine."""
    workflows = _engine().workflows
    names = sorted(set(queryset.values_list("workflow", flat=True)))
    states: list[str] = []
    for name in names:
        found = workflows.get(name)
        for state in found.states if found is not None else ():
            if state not in states:
                states.append(state)
    return states
