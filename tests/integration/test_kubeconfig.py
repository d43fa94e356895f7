"""Kubeconfigs as kind and cloud providers write them, against the real dev kube-apiserver:
inline CA and client-certificate data, exec credential plugins (run again near their
token's expiry), and a refused token surfacing as the apiserver's 401 after one reload."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from api.kube.client import REFRESH_S, KubeClient
from api.kube.errors import ApiError
from scheduler_plugins.devtools.cluster.certs import ADMIN_USER
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from tests.kube_exec import b64, exec_plugin, write_kubeconfig

pytestmark = pytest.mark.integration

NAMESPACES = "/api/v1/namespaces"
SELF_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kubeconfig(dev_cluster: ClusterClient, tmp_path: Path, user: dict[str, Any]) -> Path:
    return write_kubeconfig(
        tmp_path / "kubeconfig", dev_cluster.server, user, ca_file=dev_cluster.ca_file
    )


def namespaces(api: KubeClient) -> set[str]:
    return {ns["metadata"]["name"] for ns in api.list(NAMESPACES)["items"]}


def test_inline_client_certificate_data(dev_cluster: ClusterClient, tmp_path: Path) -> None:
    pki = dev_cluster.settings.pki_dir
    user = {
        "client-certificate-data": b64(pki / "admin.crt"),
        "client-key-data": b64(pki / "admin.key"),
    }
    with KubeClient.from_kubeconfig(kubeconfig(dev_cluster, tmp_path, user), timeout_s=15) as api:
        assert "default" in namespaces(api)
        # The apiserver took the certificate (there is no token) as the admin.
        review = api.post(
            SELF_REVIEW, {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
        info = review["status"]["userInfo"]
        assert info["username"] == ADMIN_USER
        assert "system:masters" in info["groups"]


def test_exec_plugin_runs_again_near_expiry(dev_cluster: ClusterClient, tmp_path: Path) -> None:
    plugin = exec_plugin(tmp_path, [dev_cluster.token], expires_in=dt.timedelta(minutes=1))
    clock = FakeClock()
    cfg = kubeconfig(dev_cluster, tmp_path, plugin.user)
    with KubeClient.from_kubeconfig(cfg, timeout_s=15, clock=clock) as api:
        assert "default" in namespaces(api)
        assert plugin.runs == 1
        clock.now += REFRESH_S  # the next request re-checks: the token expires within 5 min
        assert "default" in namespaces(api)
        assert plugin.runs == 2


def test_token_refused_after_the_reload_is_a_401(
    dev_cluster: ClusterClient, tmp_path: Path
) -> None:
    plugin = exec_plugin(tmp_path, ["not-a-valid-token"], expires_in=dt.timedelta(hours=1))
    with KubeClient.from_kubeconfig(kubeconfig(dev_cluster, tmp_path, plugin.user)) as api:
        with pytest.raises(ApiError) as err:
            api.list(NAMESPACES)
        assert err.value.status == 401
    assert plugin.runs == 2  # loaded, then reloaded once after the first 401


def test_token_refused_once_is_replaced_by_the_reload(
    dev_cluster: ClusterClient, tmp_path: Path
) -> None:
    # A token revoked before its expiry: the 401 makes the plugin run again, and the retry
    # with its new token succeeds.
    plugin = exec_plugin(
        tmp_path, ["revoked-token", dev_cluster.token], expires_in=dt.timedelta(hours=1)
    )
    with KubeClient.from_kubeconfig(kubeconfig(dev_cluster, tmp_path, plugin.user)) as api:
        assert "default" in namespaces(api)
    assert plugin.runs == 2
