"""``flowlock serve``: the engine as an HTTP service (FastAPI on uvicorn).

``create_app(settings)`` builds the app; ``ServiceSettings`` says what it runs with (flags or
``FLOWLOCK_*`` variables). See docs/service.md.
"""

from flowlock.core.extras import require

require("fastapi", "service", "flowlock serve")
require("uvicorn", "service", "flowlock serve")

from flowlock.service.app import create_app, default_workflows
from flowlock.service.problems import Problem
from flowlock.service.settings import ServiceSettings

__all__ = ["Problem", "ServiceSettings", "create_app", "default_workflows"]
