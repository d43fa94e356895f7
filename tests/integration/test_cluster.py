"""The dev cluster through the real API: fake GPU nodes, pods, RBAC, crash cleanup."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from api.hami.catalog import find_model
from api.hami.keys import NODE_REGISTER
from api.hami.register import decode, registered_type
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.certs import ensure_tokens
from scheduler_plugins.devtools.cluster.cluster import APISERVER, ETCD, KWOK, Cluster
from scheduler_plugins.devtools.cluster.errors import ApiError, NotFoundError
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import ClusterSettings
from scheduler_plugins.devtools.cluster.nodes import add_nodes, node_ready, wait_ready
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from tests.waiting import eventually

pytestmark = pytest.mark.integration


def make_pod(name: str, *, node: str | None = None, gpus: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/cuda:latest",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_fake_nodes_are_ready_with_expected_gpus(dev_cluster: ClusterClient) -> None:
    cycle = dev_cluster.profile.schedule()
    for i, name in enumerate(dev_cluster.nodes):
        group = cycle[i % len(cycle)]
        node = dev_cluster.api.get(f"/api/v1/nodes/{name}")
        assert node_ready(node), f"{name} not Ready: {node['status'].get('conditions')}"
        assert node["metadata"]["labels"]["type"] == "kwok"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        # Schedulable: no controller-manager would lift a not-ready taint.
        assert not node["spec"].get("taints"), node["spec"]
        # deviceSplitCount slots per GPU; in mig mode HAMi's count, the most instances of one
        # profile (seven 1g on every MIG model of the profile)
        slots = 7 if group.mode == "mig" else 10
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(group.gpus_per_node * slots)
        devices = decode(node["metadata"]["annotations"][NODE_REGISTER], obj=name)
        assert len(devices) == group.gpus_per_node
        assert {d.type for d in devices} == {registered_type(find_model(group.model).name)}
        assert {d.mode for d in devices} == {group.mode}
        assert all(d.count == slots and d.health for d in devices)
        assert all(bool(d.mig_profiles) == (group.mode == "mig") for d in devices)


def test_pod_on_fake_node_is_run_by_kwok_and_deleted(dev_cluster: ClusterClient) -> None:
    api, node = dev_cluster.api, dev_cluster.nodes[0]
    api.post("/api/v1/namespaces/default/pods", make_pod("bound", node=node))

    def running() -> bool:
        pod = api.get("/api/v1/namespaces/default/pods/bound")
        return bool(pod["status"].get("phase") == "Running")

    eventually(running)
    listed = api.get(
        "/api/v1/namespaces/default/pods", query={"fieldSelector": f"spec.nodeName={node}"}
    )
    assert [p["metadata"]["name"] for p in listed["items"]] == ["bound"]

    api.delete("/api/v1/namespaces/default/pods/bound")

    def gone() -> bool:
        try:
            api.get("/api/v1/namespaces/default/pods/bound")
        except NotFoundError:
            return True
        return False

    eventually(gone)


def test_unscheduled_pod_is_listed_pending(dev_cluster: ClusterClient) -> None:
    api = dev_cluster.api
    api.post("/api/v1/namespaces/default/pods", make_pod("waiting", gpus=2))
    try:
        pods = api.get("/api/v1/namespaces/default/pods")["items"]
        pod = next(p for p in pods if p["metadata"]["name"] == "waiting")
        assert pod["status"]["phase"] == "Pending"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    finally:
        api.delete("/api/v1/namespaces/default/pods/waiting")


def test_kubectl_sees_ready_nodes(dev_cluster: ClusterClient) -> None:
    proc = dev_cluster.kubectl("get", "nodes", "-l", "type=kwok", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    items = json.loads(proc.stdout)["items"]
    assert {n["metadata"]["name"] for n in items} >= set(dev_cluster.nodes)
    assert all(node_ready(n) for n in items)
    version = dev_cluster.kubectl("version", "-o", "json")
    assert version.returncode == 0, version.stderr
    assert json.loads(version.stdout)["serverVersion"]["gitVersion"].startswith("v1.36.")


def test_rbac_limits_the_kwok_user(dev_cluster: ClusterClient) -> None:
    tokens = ensure_tokens(dev_cluster.settings.token_file)
    with KubeApi(dev_cluster.server, tokens.kwok, dev_cluster.ca_file) as kwok_api:
        assert kwok_api.get("/api/v1/nodes")["items"]  # allowed by kwok's ClusterRole
        with pytest.raises(ApiError) as err:
            kwok_api.post("/api/v1/namespaces", {"metadata": {"name": "nope"}})
    assert err.value.status == 403


def test_add_nodes_continues_numbering(dev_cluster: ClusterClient) -> None:
    names = add_nodes(dev_cluster.api, dev_cluster.profile, 2)
    last = max(int(n.rsplit("-", 1)[1]) for n in dev_cluster.nodes)
    assert names == [f"it-gpu-{last + 1:04d}", f"it-gpu-{last + 2:04d}"]
    wait_ready(dev_cluster.api, names, timeout_s=60)


@pytest.mark.parametrize("victim", [ETCD, APISERVER, KWOK])
def test_down_after_a_crash_leaves_nothing_running(
    victim: str, dev_cluster: ClusterClient, spare_settings: ClusterSettings
) -> None:
    # A second cluster beside the session one: also shows two clusters can run side by side.
    cluster = Cluster(spare_settings)
    try:
        cluster.up(timeout_s=120)
        record = processes.read_record(cluster.settings.pid_file(victim))
        assert record is not None
        os.kill(record.pid, signal.SIGKILL)
        eventually(lambda: not processes.is_running(record), timeout_s=10)
        states = {s.component: s for s in cluster.status()}
        assert not states[victim].running
        assert "stale pid file" in states[victim].detail
    finally:
        cluster.down()
    assert cluster.running_pids() == []
    assert not any(cluster.settings.pid_file(c).exists() for c in (ETCD, APISERVER, KWOK))
    # The session cluster is untouched.
    assert dev_cluster.api.get("/api/v1/nodes")["items"]
