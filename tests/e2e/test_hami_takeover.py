"""Taking over a cluster HAMi v2.10 ran: what HAMi left is read as HAMi meant it, new pods are
placed by HAMi's rules around it, and nothing is allocated twice.

Before Tessera starts, the cluster holds what HAMi's scheduler and device plugin write (in
their bytes): registers (one node in ``mps`` mode), HAMi's handshake and node-lock leftovers,
an operator's ``hami.io/device-cordon``, and running pods with HAMi's allocation annotations,
among them a pod on a MIG GPU laid out by HAMi <= v2.9 (a legacy ``GPU-…[1-1]`` device string).
Then Tessera's stack starts (plugin server, ``tessera-scheduler``, kwok node agent) and new
pods arrive. ``tessera check`` ends the test: no GPU over capacity, no device held twice.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from api.hami.devices import decode_devices
from api.hami.register import GpuDevice, decode, encode
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.stack import metrics_address
from scheduler_plugins.server.events import LEGACY_MIG_REASON
from tests.e2e.harness import (
    EVENTS_PATH,
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    PODS_PATH,
    E2ECluster,
    annots,
    node_of,
    pod_manifest,
    tessera_cluster,
    wait_for,
)
from tests.e2e.invariants import cluster_report

CORE, MIG, MPS = "hami-0000", "hami-0001", "hami-0002"
LEFT: Final = {"tessera.dev/e2e-app": "hami-left"}
NEW: Final = {"tessera.dev/e2e-app": "after-takeover"}


def _register(api: KubeApi, node: str) -> tuple[GpuDevice, ...]:
    raw = api.get(f"/api/v1/nodes/{node}")["metadata"]["annotations"][ann.NODE_REGISTER]
    return tuple(sorted(decode(raw), key=lambda d: d.index))


def _hami_pod(name: str, node: str, devices: str, mem: int, cores: int = 0) -> dict[str, Any]:
    """A running pod as HAMi v2.10's scheduler and device plugin leave it."""
    limits = {GPU: 1, GPUMEM: mem, GPUCORES: cores}
    pod = pod_manifest(name, limits, labels={**LEFT, ann.VGPU_NODE_LABEL: node})
    pod["spec"]["nodeName"] = node
    pod["metadata"]["annotations"] = {
        ann.VGPU_NODE: node,
        "hami.io/vgpu-time": "1764650000",
        ann.BIND_TIME: "1764650000",
        ann.BIND_PHASE: "success",
        ann.DEVICES_ALLOCATED: devices,
        ann.DEVICES_TO_ALLOCATE: ";",
    }
    return pod


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    def hami_left(api: KubeApi, names: list[str]) -> None:
        assert names == [CORE, MIG, MPS]
        core, mig, mps = (_register(api, n) for n in names)
        annotations: dict[str, dict[str, str | None]] = {
            CORE: {
                ann.DEVICE_CORDON: f" {core[3].id} ,",  # an operator's, as kubectl writes it
                "hami.io/node-handshake": "Requesting_2026-12-01 10:00:00",
                "hami.io/mutex.lock": "2026-12-01T10:00:00Z,default,hami-core-a",
            },
            # HAMi's device plugin in mps operating mode: the same GPUs, mode "mps"
            MPS: {ann.NODE_REGISTER: encode(tuple(replace(d, mode="mps") for d in mps))},
        }
        for node, values in annotations.items():
            api.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": values}})
        for pod in (
            _hami_pod("hami-core-a", CORE, f"{core[0].id},NVIDIA,20000,50:;", 20000, 50),
            _hami_pod("hami-on-cordoned", CORE, f"{core[3].id},NVIDIA,10000,0:;", 10000),
            # asked 15000 MiB; v2.9 wrote its geometry template's 19968 MiB and 28% cores
            _hami_pod("hami-legacy-mig", MIG, f"{mig[0].id}[1-1],NVIDIA,19968,28:;", 15000),
            _hami_pod("hami-on-mps", MPS, f"{mps[0].id},NVIDIA,4000,0:;", 4000),
        ):
            api.post(PODS_PATH, pod)

    state = tmp_path_factory.mktemp("e2e-hami")
    with tessera_cluster(state, "e2e-hami", HERE / "nodes-hami.yaml", 3, prepare=hami_left) as c:
        yield c


def _gpus(pod: dict[str, Any]) -> list[str]:
    return [d.uuid for ctr in decode_devices(annots(pod)[ann.DEVICES_ALLOCATED]) for d in ctr]


def _place(
    c: E2ECluster, name: str, annotations: dict[str, str], mem: int = 10000
) -> dict[str, Any]:
    c.create(pod_manifest(name, {GPU: 1, GPUMEM: mem}, annotations=annotations, labels=NEW))
    return c.wait_bound(name)


def test_new_pods_are_placed_by_hamis_rules_around_what_hami_left(cluster: E2ECluster) -> None:
    core = cluster.registers[CORE]
    # spread (the default): the least used GPU that is not cordoned; GPU 1 and 2 are idle,
    # the higher index first
    spread = _place(cluster, "spread", {ann.VGPU_MODE: "hami-core"})
    assert (node_of(spread), _gpus(spread)) == (CORE, [core[2].id])
    # a chain, as HAMi v2.10 writes it: binpack decides, the most used GPU (hami-core-a's)
    packed = _place(cluster, "packed", {ann.GPU_POLICY: "binpack,numa"})
    assert (node_of(packed), _gpus(packed)) == (CORE, [core[0].id])
    # the pod label HAMi's monitor selects by, on every pod Tessera placed
    for pod in (spread, packed):
        assert pod["metadata"]["labels"][ann.VGPU_NODE_LABEL] == CORE


@pytest.mark.parametrize(
    ("name", "annotations", "reason"),
    [
        # every MIG GPU holds a HAMi <= v2.9 slot whose placement is unknown: no new work
        ("mig-pod", {ann.VGPU_MODE: "mig"}, "MIG instances HAMi <= v2.9 placed"),
    ],
)
def test_what_hami_left_keeps_new_pods_off_and_says_why(
    cluster: E2ECluster, name: str, annotations: dict[str, str], reason: str
) -> None:
    cluster.create(pod_manifest(name, {GPU: 1, GPUMEM: 8000}, annotations=annotations, labels=NEW))
    assert any(reason in m for m in cluster.wait_event(name)), cluster.tessera_events()[name]
    assert node_of(cluster.pod(name)) == ""


def test_a_cordoned_gpu_takes_no_new_pod(cluster: E2ECluster) -> None:
    cordoned = cluster.registers[CORE][3].id
    name = "wants-cordoned"
    cluster.create(
        pod_manifest(
            name, {GPU: 1, GPUMEM: 1000}, annotations={ann.USE_GPUUUID: cordoned}, labels=NEW
        )
    )
    assert any("cordoned" in m for m in cluster.wait_event(name))


def test_the_legacy_mig_pod_is_reported_and_its_gpu_exported_unavailable(
    cluster: E2ECluster,
) -> None:
    def events() -> list[dict[str, Any]]:
        found = cluster.api.list(EVENTS_PATH, field_selector=f"reason={LEGACY_MIG_REASON}")
        return list(found.get("items") or [])

    wait_for("a legacy MIG event", lambda: bool(events()), 60, interval_s=0.5)
    (event,) = events()
    assert event["involvedObject"]["name"] == "hami-legacy-mig"
    assert "[1-1]" in event["message"] and "Delete the pod" in event["message"]

    mig_gpu = cluster.registers[MIG][0].id
    with urllib.request.urlopen(f"http://{metrics_address(cluster.settings)}/metrics") as r:
        text = r.read().decode()
    unavailable = [ln for ln in text.splitlines() if ln.startswith("tessera_gpu_unavailable{")]
    assert any(mig_gpu in ln and 'reason="legacy_mig"' in ln for ln in unavailable), unavailable
    cordoned = cluster.registers[CORE][3].id
    assert any(cordoned in ln and 'reason="cordoned"' in ln for ln in unavailable), unavailable


def test_nothing_hami_left_is_lost_or_allocated_twice(cluster: E2ECluster) -> None:
    # Tessera's stack has been running and placing pods: HAMi's pods are as HAMi left them.
    left = {p["metadata"]["name"]: p for p in cluster.pods("tessera.dev/e2e-app=hami-left")}
    assert sorted(left) == ["hami-core-a", "hami-legacy-mig", "hami-on-cordoned", "hami-on-mps"]
    assert annots(left["hami-legacy-mig"])[ann.DEVICES_ALLOCATED].endswith(
        "[1-1],NVIDIA,19968,28:;"
    )
    # GPU 0 holds hami-core-a's 20000 MiB and "packed"'s 10000 of 40960: 30000 more do not fit
    name = "over-hami-core-a"
    gpu0 = cluster.registers[CORE][0].id
    cluster.create(
        pod_manifest(name, {GPU: 1, GPUMEM: 30000}, annotations={ann.USE_GPUUUID: gpu0}, labels=NEW)
    )
    assert any("insufficient GPU memory" in m for m in cluster.wait_event(name))
    assert node_of(cluster.pod(name)) == ""
    report = cluster_report(cluster)
    assert report.ok, str(report)


def test_an_mps_pod_joins_what_hami_left_on_its_mps_node(cluster: E2ECluster) -> None:
    """HAMi's mps registration is served by Tessera's agent: an MPS pod lands there, counted
    beside the pod HAMi placed (spread: not on the GPU that pod holds)."""
    mps = cluster.registers[MPS]
    pod = _place(cluster, "mps-pod", {ann.VGPU_MODE: "mps"})
    assert node_of(pod) == MPS
    [gpu] = _gpus(pod)
    assert gpu in {d.id for d in mps} and gpu != mps[0].id
