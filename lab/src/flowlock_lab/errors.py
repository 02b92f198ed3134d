"""The lab's own errors. Both are FlowlockErrors, so the CLI prints them as one line."""

from __future__ import annotations

from flowlock.core.errors import FlowlockError

__all__ = ["HostsError", "HostsUnavailable"]


class HostsError(FlowlockError):
    """The namespaced hosts of `flowlock bench --hosts` could not be set up or removed.

    `problem` says what went wrong, `advice` what to do about it.
    """

    def __init__(self, problem: str, *, advice: str) -> None:
        self.problem = problem
        self.advice = advice
        super().__init__(f"namespaced hosts: {problem}\nWhat to do: {advice}")


class HostsUnavailable(HostsError):
    """This machine cannot make namespaced hosts at all.

    Causes: not Linux, not root, or no `ip` command or network namespaces.
    With a delay, a missing `tc` or kernel netem also counts.
    `reason` is that one fact, for a test's skip message.
    """

    def __init__(self, reason: str, *, advice: str) -> None:
        self.reason = reason
        super().__init__(reason, advice=advice)
