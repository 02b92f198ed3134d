"""The error of the embedded servers."""

from __future__ import annotations

from flowlock.core.errors import FlowlockError

__all__ = ["EmbeddedServerError"]


class EmbeddedServerError(FlowlockError):
    """An embedded server (PostgreSQL or Redis) could not be started or stopped, or is not running.

    ``server`` names it ("PostgreSQL", "Redis"), ``problem`` says what went wrong in one line,
    ``details`` holds what the server said (command output, the tail of its log), and ``advice``
    what to do about it. The message puts the problem on its first line, so a command line
    that prints one line per error shows that, with the details below it.
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
