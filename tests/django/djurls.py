"""The URLs of tests/django's project: the admin, and a view that writes a row of its own and
fires a transition in one transaction."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path
from djapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/<str:order_id>/approve", views.approve),
]
