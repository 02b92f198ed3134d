"""flowlock's tables as Django sees them, for the admin: read-only, never migrated by Django
(`managed = False`; flowlock's own migrations make them). Writes go through the engine."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models

from flowlock.contrib.django.conf import config


def _table(name: str) -> str:
    """`name`, qualified with the engine's schema when OPTIONS has one (Django leaves a name
    already in double quotes as it is)."""
    schema = config().schema
    return name if schema is None else f'"{schema}"."{name}"'


class Instance(models.Model):
    """A row of `flowlock_instances`."""

    id: models.TextField[str, str] = models.TextField(primary_key=True)
    workflow: models.TextField[str, str] = models.TextField()
    state: models.TextField[str, str] = models.TextField()
    version: models.BigIntegerField[int, int] = models.BigIntegerField()
    data: models.JSONField[Any, Any] = models.JSONField(default=dict)
    last_event: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    created_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    updated_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    stay_version: models.BigIntegerField[int, int] = models.BigIntegerField()
    # The instance's own pause (engine.pause); its workflow's is a row of flowlock_workflow_pauses.
    paused: models.BooleanField[bool, bool] = models.BooleanField(default=False)

    class Meta:
        managed = False
        db_table = _table("flowlock_instances")
        ordering = ("id",)
        verbose_name = "instance"
        verbose_name_plural = "instances"

    def __str__(self) -> str:
        return str(self.id)


class WorkflowPause(models.Model):
    """A row of `flowlock_workflow_pauses`: a whole workflow paused (engine.pause(workflow=))."""

    workflow: models.TextField[str, str] = models.TextField(primary_key=True)
    reason: models.TextField[str, str] = models.TextField()
    actor: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    at: models.DateTimeField[datetime, datetime] = models.DateTimeField()

    class Meta:
        managed = False
        db_table = _table("flowlock_workflow_pauses")
        verbose_name = "paused workflow"
        verbose_name_plural = "paused workflows"

    def __str__(self) -> str:
        return str(self.workflow)


class History(models.Model):
    """A row of `flowlock_history`. Its key is (instance, version); Django models have one
    column of key, so `version` stands in for it. It is unique within one instance's history,
    the only way the admin reads these rows (inline, by instance); never look one up by pk
    alone."""

    instance: models.ForeignKey[Instance, Instance] = models.ForeignKey(
        Instance,
        on_delete=models.DO_NOTHING,
        db_column="instance_id",
        db_constraint=False,
        related_name="history",
    )
    version: models.BigIntegerField[int, int] = models.BigIntegerField(primary_key=True)
    event: models.TextField[str, str] = models.TextField()
    from_state: models.TextField[str, str] = models.TextField()
    to_state: models.TextField[str, str] = models.TextField()
    actor: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    request_id: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    strategy: models.TextField[str, str] = models.TextField()
    data: models.JSONField[Any, Any] = models.JSONField(default=dict)
    payload: models.JSONField[Any, Any] = models.JSONField(default=dict)
    at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    fencing_token: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True, blank=True
    )

    class Meta:
        managed = False
        db_table = _table("flowlock_history")
        ordering = ("version",)
        verbose_name = "history entry"
        verbose_name_plural = "history"

    def __str__(self) -> str:
        return f"{self.event} {self.from_state} -> {self.to_state} (v{self.version})"
