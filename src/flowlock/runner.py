"""The former name of :mod:`flowlock.jobs`, kept so existing imports keep working.

``from flowlock.runner import RunOnce`` is the same class as ``flowlock.jobs.RunOnce`` (and
``flowlock.RunOnce``); new code should import from ``flowlock.jobs``.
"""

from __future__ import annotations

from flowlock.jobs import JobContext, RunOnce, RunResult, RunStatus

__all__ = ["JobContext", "RunOnce", "RunResult", "RunStatus"]
