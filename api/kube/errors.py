"""Errors of the Kubernetes API client, named by what the caller should do.

- ``TemporaryError``: the apiserver could not be reached or answered 5xx/429; retry later.
- ``ConflictError`` (409): the object changed under a resourceVersion precondition (or
  exists already); re-read it and try again.
- ``NotFoundError`` (404): the object is gone; stop working on it.
- ``GoneError`` (410): a watch's resourceVersion is too old; list again and watch from there.
- ``KubeConfigError``: the kubeconfig / service-account material is unusable; fix the input.
"""

from __future__ import annotations

from api.errors import InvalidInputError, TesseraError
from api.errors import TemporaryError as _Temporary


class KubeError(TesseraError):
    """Base of every error the Kubernetes client raises."""


class KubeConfigError(KubeError, InvalidInputError):
    """The credentials or server address cannot be used; the message says which file/field."""


class TemporaryError(KubeError, _Temporary):
    """The apiserver is unreachable or overloaded; the same call may succeed later."""


class UnreachableError(TemporaryError):
    """The connection failed (refused, reset, timed out, TLS)."""


class InvalidResponseError(TemporaryError):
    """The apiserver's answer was not the JSON it should be (a proxy in between?)."""


class ApiError(KubeError):
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
    """HTTP 409: the object exists already or was changed concurrently (stale resourceVersion)."""


class GoneError(ApiError):
    """HTTP 410: the requested resourceVersion is compacted; list again."""


class ServerError(ApiError, TemporaryError):
    """HTTP 5xx or 429: the apiserver cannot serve now."""
