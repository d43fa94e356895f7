"""Building the shared Kubernetes client from a kubeconfig or the in-cluster service account."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.kube import errors
from api.kube.client import KubeClient
from scheduler_plugins.devtools.cluster import errors as devcluster_errors


def test_in_cluster_needs_the_service_env() -> None:
    with pytest.raises(errors.KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        KubeClient.in_cluster({})


def test_in_cluster_reports_a_missing_token(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(errors.KubeConfigError, match="service account token"):
        KubeClient.in_cluster(env, sa_dir=tmp_path)


def test_kubeconfig_without_credentials_is_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "current-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {}}]\n"
    )
    with pytest.raises(errors.KubeConfigError, match="neither a token"):
        KubeClient.from_kubeconfig(cfg)


def test_plain_http_server_is_rejected() -> None:
    with pytest.raises(errors.KubeConfigError, match="https"):
        KubeClient("http://127.0.0.1:8080", "t")


def test_error_kinds_say_what_to_do() -> None:
    assert issubclass(errors.ServerError, errors.TemporaryError)
    assert issubclass(errors.UnreachableError, errors.TemporaryError)
    assert not issubclass(errors.ConflictError, errors.TemporaryError)
    # the dev cluster's names are the same classes
    assert devcluster_errors.NotFoundError is errors.NotFoundError
    assert devcluster_errors.ConflictError is errors.ConflictError
