"""A view as a project writes one: its own row and the transition, in one transaction."""

from __future__ import annotations

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from djapp.models import Order
from flowlock import FlowlockError
from flowlock.contrib.django import engine


@csrf_exempt
@require_POST
def approve(request: HttpRequest, order_id: str) -> HttpResponse:
    """Record the order's note and approve its instance together; `?fail=1` raises after both,
    so neither is kept."""
    try:
        with transaction.atomic():
            Order.objects.create(instance_id=order_id, note=request.POST.get("note", ""))
            outcome = engine().fire(
                order_id,
                "approve",
                actor="web",
                request_id=request.headers.get("Idempotency-Key"),
                connection=connection,
            )
            if request.GET.get("fail"):
                raise RuntimeError("the view failed after writing")
    except FlowlockError as exc:
        return JsonResponse({"error": type(exc).__name__, "detail": str(exc)}, status=409)
    except RuntimeError as exc:
        return JsonResponse({"error": "RuntimeError", "detail": str(exc)}, status=500)
    return JsonResponse(
        {
            "applied": outcome.applied,
            "state": outcome.instance.state,
            "version": outcome.instance.version,
        }
    )
