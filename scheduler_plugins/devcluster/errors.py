"""Errors of the dev cluster, named by what the caller should do."""

from __future__ import annotations

from scheduler_plugins.errors import InvalidInputError, TesseraError


class ClusterError(TesseraError):
    """The dev cluster could not be built, started, reached or stopped; the message says why."""


class ToolsMissingError(ClusterError):
    """A binary is missing from the tools bin dir: run ``make tools``."""


class PortInUseError(ClusterError):
    """A port the cluster needs is taken: stop the other user or pick other ports."""


class ComponentFailedError(ClusterError):
    """A component exited or did not become ready in time; the message holds its log tail."""


class ApiError(ClusterError):
    """The kube-apiserver answered with an error status."""

    def __init__(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status} {reason}: {message}")


class NotFoundError(ApiError):
    """HTTP 404."""


class ConflictError(ApiError):
    """HTTP 409: the object exists already or was changed concurrently."""


class ProfileError(InvalidInputError):
    """The node profile file is invalid; ``path`` is the dotted path of the bad field."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"node profile: {path}: {problem}" if path else f"node profile: {problem}")
