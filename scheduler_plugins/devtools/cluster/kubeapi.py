"""The dev cluster's kube-apiserver client: ``api.kube.KubeClient``.

Kept as a re-export so dev-cluster code and its tests keep their imports.
"""

from __future__ import annotations

from api.kube.client import APPLY_PATCH, JSON, MERGE_PATCH, TABLE, KubeClient

KubeApi = KubeClient

__all__ = ["APPLY_PATCH", "JSON", "MERGE_PATCH", "TABLE", "KubeApi"]
