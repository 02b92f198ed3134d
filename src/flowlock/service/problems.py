"""The service's problems: errors map through `flowlock.http`, the one mapping; the service's
own refusals (a bad header, a body too deep...) are built with the same `problem` builder."""

from __future__ import annotations

from flowlock.http import PROBLEM_JSON, TYPE_PREFIX, Problem, etag, from_error, type_uri
from flowlock.http import make_problem as problem

__all__ = ["PROBLEM_JSON", "TYPE_PREFIX", "Problem", "etag", "from_error", "problem", "type_uri"]
