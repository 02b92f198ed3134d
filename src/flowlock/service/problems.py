"""The service's own refusals as problems; errors map through `flowlock.http`, the one mapping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowlock.http import PROBLEM_JSON, TYPE_PREFIX, Problem, etag, from_error, type_uri

__all__ = ["PROBLEM_JSON", "TYPE_PREFIX", "Problem", "etag", "from_error", "problem", "type_uri"]


def problem(
    status: int,
    slug: str,
    title: str,
    detail: str,
    headers: Mapping[str, str] | None = None,
    **members: Any,
) -> Problem:
    """A refusal of the service's own (a bad header, a body too deep...)."""
    return Problem(status, slug, title, detail, members, headers)
