"""Kubernetes API access: the only package that talks to the kube-apiserver."""

from __future__ import annotations

from api.kube.client import KubeClient, Watch
from api.kube.errors import (
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
