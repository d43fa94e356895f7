"""Errors of the dev cluster, named by what the caller should do."""

from __future__ import annotations

from api.errors import InvalidInputError, TesseraError
from api.kube import errors as kube_errors


class ClusterError(TesseraError):
    """The dev cluster could not be built, started, reached or stopped; the message says why."""


class ToolsMissingError(ClusterError):
    """A binary is missing from the tools bin dir: run ``make tools``."""


class PortInUseError(ClusterError):
    """A port the cluster needs is taken: stop the other user or pick other ports."""


class ComponentFailedError(ClusterError):
    """A component exited or did not become ready in time; the message holds its log tail."""


# The API errors are the shared client's (api.kube); aliased so dev-cluster
# code and tests keep importing them from here.
ApiError = kube_errors.ApiError
NotFoundError = kube_errors.NotFoundError
ConflictError = kube_errors.ConflictError


class ProfileError(InvalidInputError):
    """The node profile file is invalid; ``path`` is the dotted path of the bad field."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"node profile: {path}: {problem}" if path else f"node profile: {problem}")
