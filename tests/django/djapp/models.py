"""A row of the project's own, written in the same transaction as a transition."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    instance_id: models.TextField[str, str] = models.TextField()
    note: models.TextField[str, str] = models.TextField(default="")

    class Meta:
        app_label = "djapp"
