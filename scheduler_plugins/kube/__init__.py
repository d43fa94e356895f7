"""Kubernetes API access: the only package that talks to the kube-apiserver."""

from __future__ import annotations

from scheduler_plugins.kube.client import KubeClient, Watch
from scheduler_plugins.kube.errors import (
    ApiError,
    ConflictError,
    GoneError,
    InvalidResponseError,
    KubeConfigError,
    KubeError,
    NotFoundError,
    ServerError,
    TemporaryError,
    UnreachableError,
)

__all__ = [
    "ApiError",
    "ConflictError",
    "GoneError",
    "InvalidResponseError",
    "KubeClient",
    "KubeConfigError",
    "KubeError",
    "NotFoundError",
    "ServerError",
    "TemporaryError",
    "UnreachableError",
    "Watch",
]
