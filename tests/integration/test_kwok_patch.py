"""kwok mode's annotation-guarded patch against a real kube-apiserver: a status update
between read and write does not fail it, a change of what the allocator read does (as a
409 the allocator already handles), and the answer lands in the pod index."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from api.kube.client import KubeClient
from api.kube.errors import ConflictError, NotFoundError
from node_agent.kwok_mode import IndexedPodApi, PodIndex
from scheduler_plugins.devtools.cluster.testing import ClusterClient

PODS = "/api/v1/namespaces/default/pods"
PHASE = "hami.io/bind-phase"
TODO = "hami.io/vgpu-devices-to-allocate"


@pytest.fixture
def api(dev_cluster: ClusterClient) -> Iterator[KubeClient]:
    with KubeClient.from_kubeconfig(dev_cluster.kubeconfig, timeout_s=15) as client:
        yield client


@pytest.fixture
def pod(api: KubeClient, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    name = f"guarded-{request.node.name.replace('_', '-')[-40:]}".lower()
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {PHASE: "allocating", TODO: "a;"}},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/x"}]},
    }
    created: dict[str, Any] = api.post(PODS, body)
    yield created
    with contextlib.suppress(NotFoundError):
        api.delete(f"{PODS}/{name}")


def _patch(
    papi: IndexedPodApi, pod: dict[str, Any], annotations: dict[str, str], rv: str
) -> dict[str, Any]:
    path = f"{PODS}/{pod['metadata']['name']}"
    out: dict[str, Any] = papi.merge_patch(
        path, {"metadata": {"annotations": annotations}}, resource_version=rv
    )
    return out


def test_a_status_update_in_between_does_not_conflict(api: KubeClient, pod: dict[str, Any]) -> None:
    index = PodIndex()
    index.offer(pod)
    papi = IndexedPodApi(api, index)
    rv = pod["metadata"]["resourceVersion"]
    path = f"{PODS}/{pod['metadata']['name']}"
    api.merge_patch(f"{path}/status", {"status": {"phase": "Running"}})  # kwok's pod-ready
    out = _patch(papi, pod, {TODO: ";", PHASE: "success"}, rv)
    assert out["metadata"]["annotations"] == {PHASE: "success", TODO: ";"}
    indexed = index.get(f"default/{pod['metadata']['name']}")
    assert (
        indexed is not None
        and indexed["metadata"]["resourceVersion"] == out["metadata"]["resourceVersion"]
    )


def test_a_change_of_what_was_read_conflicts(api: KubeClient, pod: dict[str, Any]) -> None:
    index = PodIndex()
    index.offer(pod)
    papi = IndexedPodApi(api, index)
    rv = pod["metadata"]["resourceVersion"]
    path = f"{PODS}/{pod['metadata']['name']}"
    api.merge_patch(path, {"metadata": {"annotations": {TODO: "b;"}}})  # someone else wrote
    with pytest.raises(ConflictError):
        _patch(papi, pod, {TODO: ";", PHASE: "success"}, rv)
    assert api.get(path)["metadata"]["annotations"][PHASE] == "allocating"


def test_an_unknown_version_falls_back_to_the_whole_object_precondition(
    api: KubeClient, pod: dict[str, Any]
) -> None:
    papi = IndexedPodApi(api, PodIndex())  # nothing indexed: a plain merge patch with rv
    path = f"{PODS}/{pod['metadata']['name']}"
    api.merge_patch(f"{path}/status", {"status": {"phase": "Running"}})
    with pytest.raises(ConflictError):
        _patch(papi, pod, {PHASE: "success"}, pod["metadata"]["resourceVersion"])


def test_the_watch_echo_of_its_own_patch_is_not_decoded(
    api: KubeClient, pod: dict[str, Any]
) -> None:
    """The agents' watch reads the head of each event as this apiserver writes it: the
    MODIFIED event of the version the patch answer put in the index is skipped, and so is
    kwok's status write marking the allocated pod running; the write that ends it is
    decoded."""
    index = PodIndex()
    index.offer(pod)
    papi = IndexedPodApi(api, index)
    name = pod["metadata"]["name"]
    ours = _patch(papi, pod, {TODO: ";", PHASE: "success"}, pod["metadata"]["resourceVersion"])
    running = api.merge_patch(f"{PODS}/{name}/status", {"status": {"phase": "Running"}})
    theirs = api.merge_patch(f"{PODS}/{name}/status", {"status": {"phase": "Succeeded"}})
    with api.watch(
        PODS,
        pod["metadata"]["resourceVersion"],
        field_selector=f"metadata.name={name}",
        timeout_s=10,
        skip=index.holds,
    ) as w:
        first = next(e for e in w if e["type"] != "BOOKMARK")
        skipped = w.skipped
    assert first["type"] == "MODIFIED"
    assert first["object"]["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
    assert skipped == 2 and index.echoes == 1 and index.settled == 1
    assert ours["metadata"]["resourceVersion"] != running["metadata"]["resourceVersion"]
