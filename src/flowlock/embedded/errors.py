"""The error of the embedded servers."""

from __future__ import annotations

from flowlock.core.errors import FlowlockError

__all__ = ["EmbeddedServerError"]


class EmbeddedServerError(FlowlockError):
    """An embedded PostgreSQL or Redis server could not be started or stopped, or is not running.

    `server` names it, `problem` says what went wrong in one line, `details` holds what
    the server said, and `advice` what to do. The problem comes first in the message, so a
    one-line error report shows it.
    """

    def __init__(
        self,
        server: str,
        problem: str,
        *,
        details: str = "",
        advice: str = "read the server output above, or point flowlock at a server of your own",
    ) -> None:
        self.server = server
        self.problem = problem
        self.details = details.strip()
        self.advice = advice
        parts = [f"embedded {server}: {problem}"]
        if self.details:
            parts.append(self.details)
        parts.append(f"What to do: {advice}")
        super().__init__("\n".join(parts))
