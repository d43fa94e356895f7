"""Tessera's admission webhook behind the dev cluster's real kube-apiserver.

The pods stay Pending (no scheduler runs here); each test deletes what it created.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from api.hami import keys as ann
from api.kube.errors import ApiError, NotFoundError
from scheduler_plugins.devtools.cluster.certs import ADMIN_USER
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from scheduler_plugins.devtools.cluster.webhook import WEBHOOK, start_webhook
from scheduler_plugins.webhook.manifest import WEBHOOK_NAME

pytestmark = pytest.mark.integration

GPU, MEM, CORES = "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores"


def pod(
    name: str,
    limits: dict[str, Any],
    *,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
    **spec: Any,
) -> dict[str, Any]:
    container = {"name": "main", "image": "busybox", "resources": {"limits": limits}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"containers": [container], **spec},
    }


@pytest.fixture
def created(dev_cluster: ClusterClient, webhook: str) -> Iterator[list[dict[str, Any]]]:
    """Pods to create; whatever the apiserver accepted is deleted afterwards."""
    made: list[dict[str, Any]] = []
    yield made
    for p in made:
        meta = p["metadata"]
        with contextlib.suppress(NotFoundError):
            dev_cluster.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")


def create(c: ClusterClient, made: list[dict[str, Any]], obj: dict[str, Any]) -> dict[str, Any]:
    ns = obj["metadata"]["namespace"]
    out: dict[str, Any] = c.api.post(f"/api/v1/namespaces/{ns}/pods", obj)
    made.append(out)
    return out


def refused(c: ClusterClient, made: list[dict[str, Any]], obj: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        create(c, made, obj)
    assert f'admission webhook "{WEBHOOK_NAME}" denied the request' in info.value.message
    return info.value


def test_memory_only_pod_gets_tessera_scheduler_and_one_gpu(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    out = create(dev_cluster, created, pod("wh-mem-only", {MEM: "3000"}))
    assert out["spec"]["schedulerName"] == "hami-scheduler"
    resources = out["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {MEM: "3k", GPU: "1"}
    assert resources["requests"] == {MEM: "3k", GPU: "1"}
    # The webhook logged its decision as one JSON line naming the pod.
    lines = dev_cluster.settings.log_file(WEBHOOK).read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    (entry,) = [e for e in entries if e.get("pod") == "default/wh-mem-only"]
    assert entry["allowed"] is True and entry["facts_known"] is True


def test_pod_without_gpus_is_left_alone(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    out = create(dev_cluster, created, pod("wh-plain", {"cpu": "1"}))
    assert out["spec"]["schedulerName"] == "default-scheduler"
    assert GPU not in out["spec"]["containers"][0]["resources"]["limits"]


def test_preset_internal_annotation_is_refused(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    preset = {ann.DEVICES_ALLOCATED: "GPU-0,NVIDIA,1000,0:;"}
    e = refused(dev_cluster, created, pod("wh-forged", {GPU: "1"}, annotations=preset))
    assert e.status == 403
    assert f"annotation {ann.DEVICES_ALLOCATED} is written only by Tessera" in e.message
    assert "remove it" in e.message


def test_preset_node_name_is_refused(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    obj = pod("wh-pinned", {GPU: "1"}, nodeName=dev_cluster.nodes[0])
    e = refused(dev_cluster, created, obj)
    assert e.status == 403
    assert f"spec.nodeName is preset ('{dev_cluster.nodes[0]}')" in e.message
    assert "nodeSelector or node affinity" in e.message


@pytest.mark.parametrize(
    ("limits", "mode", "expected"),
    [
        # The largest device on the cluster: an H100 80GB's 7g.80gb MIG profile.
        ({GPU: "1", MEM: "90000"}, None, "more than the largest GPU in the cluster has (81152"),
        ({GPU: "1", CORES: "150"}, None, f"{CORES} = 150 must be between 0 and 100"),
        # The hami-core nodes have 4 A100s.
        ({GPU: "5"}, "hami-core", "more than 4 hami-core GPU device(s)"),
    ],
    ids=["memory", "cores", "count"],
)
def test_impossible_request_is_refused(
    dev_cluster: ClusterClient,
    created: list[dict[str, Any]],
    limits: dict[str, str],
    mode: str | None,
    expected: str,
) -> None:
    annotations = {ann.VGPU_MODE: mode} if mode else None
    e = refused(dev_cluster, created, pod("wh-impossible", limits, annotations=annotations))
    assert e.status == 400
    assert expected in e.message


def test_kube_system_is_not_sent_to_the_webhook(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    preset = {ann.BIND_PHASE: "success"}
    obj = pod("wh-system", {GPU: "1"}, annotations=preset, namespace="kube-system")
    out = create(dev_cluster, created, obj)
    assert out["metadata"]["annotations"] == preset
    assert out["spec"]["schedulerName"] == "default-scheduler"


def _judged(c: ClusterClient, pod_key: str, operation: str) -> list[dict[str, Any]]:
    lines = c.settings.log_file(WEBHOOK).read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in entries if e.get("pod") == pod_key and e.get("operation") == operation]


@pytest.mark.parametrize("subresource", ["", "/status"], ids=["pod", "pods/status"])
def test_internal_annotations_of_an_existing_pod_cannot_be_forged_or_altered(
    dev_cluster: ClusterClient, created: list[dict[str, Any]], subresource: str
) -> None:
    name = f"wh-existing{subresource.replace('/', '-')}"
    create(dev_cluster, created, pod(name, {GPU: "1"}))
    path = f"/api/v1/namespaces/default/pods/{name}{subresource}"
    forged = {ann.DEVICES_ALLOCATED: "GPU-0,NVIDIA,80000,100:;", ann.BIND_PHASE: "success"}
    with pytest.raises(ApiError) as info:
        dev_cluster.api.merge_patch(path, {"metadata": {"annotations": forged}})
    e = info.value
    assert e.status == 403
    assert f'admission webhook "{WEBHOOK_NAME}" denied the request' in e.message
    assert f"annotation {ann.DEVICES_ALLOCATED} is written only by Tessera" in e.message
    assert "may not add it on an existing pod" in e.message
    current = dev_cluster.api.get(f"/api/v1/namespaces/default/pods/{name}")
    assert not set(forged) & set(current["metadata"].get("annotations") or {})


def test_other_updates_do_not_reach_the_webhook(
    dev_cluster: ClusterClient, created: list[dict[str, Any]]
) -> None:
    create(dev_cluster, created, pod("wh-relabel", {GPU: "1"}))
    path = "/api/v1/namespaces/default/pods/wh-relabel"
    dev_cluster.api.merge_patch(path, {"metadata": {"annotations": {"team": "a"}}})
    with pytest.raises(ApiError):
        dev_cluster.api.merge_patch(path, {"metadata": {"annotations": {ann.VGPU_NODE: "n"}}})
    # The apiserver's matchCondition sent only the update that touched an internal
    # annotation; the other never waited on the webhook. When admission refuses an update
    # the apiserver applied to its cached copy of the pod, it reads the pod from etcd and
    # judges once more, so the forged update may be judged twice: each time refused.
    ours = [
        e for e in _judged(dev_cluster, "default/wh-relabel", "UPDATE") if e["user"] == ADMIN_USER
    ]
    assert ours
    for judged in ours:
        assert judged["allowed"] is False
        assert f"annotation {ann.VGPU_NODE} is written only by Tessera" in judged["message"]


@pytest.fixture
def routing(dev_cluster: ClusterClient, webhook: str) -> Iterator[None]:
    """The module's webhook (started first) restarted with ``--host-only-pods``; restarted
    without after."""

    def restart(*flags: str) -> None:
        start_webhook(
            dev_cluster.settings,
            scheduler_name=SCHEDULER_NAME,
            trusted_users=(),
            timeout_s=60,
            extra_args=flags,
        )

    restart("--host-only-pods", "--host-only-exclude-namespace=gpu-system")
    try:
        yield
    finally:
        restart()


def test_pods_without_a_gpu_are_routed_to_tessera_when_asked(
    dev_cluster: ClusterClient, created: list[dict[str, Any]], routing: None
) -> None:
    out = create(dev_cluster, created, pod("wh-cpu-routed", {"cpu": "1"}))
    assert out["spec"]["schedulerName"] == "hami-scheduler"
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "1"}
    assert "runtimeClassName" not in out["spec"]
    other = create(dev_cluster, created, pod("wh-cpu-other", {"cpu": "1"}, schedulerName="volcano"))
    assert other["spec"]["schedulerName"] == "volcano"
