"""The node agent against the real apiserver: the shared client, registration, kwok mode."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from api.hami.catalog import simulated_register_json
from api.hami.config import DeviceConfig
from api.hami.devices import decode_mig_allocations
from api.hami.keys import (
    BIND_PHASE,
    BIND_TIME,
    DEVICES_ALLOCATED,
    DEVICES_TO_ALLOCATE,
    MIG_ALLOCATIONS,
    NODE_REGISTER,
    VGPU_NODE,
)
from api.hami.register import Placement, decode
from api.kube.client import KubeClient
from api.kube.errors import ConflictError, NotFoundError
from node_agent.kwok_mode import KwokAgents
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from node_agent.registration import HANDSHAKE, Registrar
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from tests.waiting import eventually

pytestmark = pytest.mark.integration

PODS = "/api/v1/namespaces/default/pods"


def gone(api: KubeClient, path: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            api.get(path)
        except NotFoundError:
            return True
        return False

    return check


def plain_pod(
    name: str,
    node: str | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.invalid/cuda:latest"}],
        "terminationGracePeriodSeconds": 0,
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}},
        "spec": spec,
    }


def node_devices(api: KubeClient, name: str) -> Any:
    node = api.get(f"/api/v1/nodes/{name}")
    return decode(node["metadata"]["annotations"][NODE_REGISTER])


@pytest.fixture
def api(dev_cluster: ClusterClient) -> Iterator[KubeClient]:
    with KubeClient.from_kubeconfig(dev_cluster.kubeconfig, timeout_s=15) as client:
        yield client


# The shared client ------------------------------------------------------------------------


def test_list_selectors_watch_and_conflict(api: KubeClient) -> None:
    listed = api.list(PODS, label_selector="suite=kubeclient")
    rv = listed["metadata"]["resourceVersion"]
    try:
        api.post(PODS, plain_pod("kc-a", labels={"suite": "kubeclient"}))
        api.post(PODS, plain_pod("kc-b", labels={"suite": "other"}))
        names = [
            p["metadata"]["name"]
            for p in api.list(PODS, label_selector="suite=kubeclient")["items"]
        ]
        assert names == ["kc-a"]
        by_field = api.list(PODS, field_selector="metadata.name=kc-b")["items"]
        assert [p["metadata"]["name"] for p in by_field] == ["kc-b"]

        with api.watch(PODS, rv, label_selector="suite=kubeclient", timeout_s=5) as w:
            first = next(iter(w))
        assert first["type"] == "ADDED" and first["object"]["metadata"]["name"] == "kc-a"

        pod = api.get(f"{PODS}/kc-a")
        stale = pod["metadata"]["resourceVersion"]
        api.merge_patch(
            f"{PODS}/kc-a", {"metadata": {"annotations": {"x": "1"}}}, resource_version=stale
        )
        with pytest.raises(ConflictError):
            api.merge_patch(
                f"{PODS}/kc-a", {"metadata": {"annotations": {"x": "2"}}}, resource_version=stale
            )
        assert api.get(f"{PODS}/kc-a")["metadata"]["annotations"]["x"] == "1"
    finally:
        for n in ("kc-a", "kc-b"):
            api.delete(f"{PODS}/{n}")


def test_watch_ends_at_its_timeout_and_closes_from_another_thread(api: KubeClient) -> None:
    rv = api.list(PODS, field_selector="metadata.name=nothing-here")["metadata"]["resourceVersion"]
    t0 = time.monotonic()
    with api.watch(PODS, rv, field_selector="metadata.name=nothing-here", timeout_s=1) as w:
        assert [e for e in w if e["type"] != "BOOKMARK"] == []
    assert time.monotonic() - t0 < 10

    w = api.watch(PODS, rv, field_selector="metadata.name=nothing-here", timeout_s=60)
    seen: list[Any] = []
    reader = threading.Thread(target=lambda: seen.extend(w))
    reader.start()
    time.sleep(0.3)
    w.close()
    reader.join(5)
    assert not reader.is_alive()


# Registration -----------------------------------------------------------------------------


def test_registrar_patch_lands_and_decodes(api: KubeClient) -> None:
    name = "it-registrar"
    api.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    backend = SimulatedNvml([SimulatedGpuSpec("A100-PCIE-40GB")] * 2, None, node_name=name)
    backend.init()
    try:
        r = Registrar(name, api, backend, DeviceConfig())
        assert r.sync()
        assert not r.sync()
        node = api.get(f"/api/v1/nodes/{name}")
        assert decode(node["metadata"]["annotations"][NODE_REGISTER]) == r.devices()
        assert node["metadata"]["annotations"][HANDSHAKE].startswith("Reported ")
    finally:
        backend.shutdown()
        api.delete(f"/api/v1/nodes/{name}")


# kwok mode --------------------------------------------------------------------------------


def fake_node(api: KubeClient, dev_cluster: ClusterClient, mode: str) -> str:
    for name in dev_cluster.nodes:
        if node_devices(api, name)[0].mode == mode:
            return name
    raise AssertionError(f"no {mode} node in the dev cluster profile")


def scheduled_pod(name: str, node: str, entry: str, mig: str | None = None) -> dict[str, Any]:
    ann = {
        VGPU_NODE: node,
        BIND_TIME: str(int(time.time())),
        BIND_PHASE: "allocating",
        DEVICES_ALLOCATED: entry,
        DEVICES_TO_ALLOCATE: entry,
    }
    if mig is not None:
        ann[MIG_ALLOCATIONS] = mig
    return plain_pod(name, node, ann)


@pytest.fixture
def agents(api: KubeClient) -> Iterator[KwokAgents]:
    with KwokAgents(api, DeviceConfig(), watch_timeout_s=2) as a:
        yield a


def test_kwok_mode_realizes_and_reclaims_a_mig_reservation(
    api: KubeClient, dev_cluster: ClusterClient, agents: KwokAgents
) -> None:
    node = fake_node(api, dev_cluster, "mig")
    gpu = node_devices(api, node)[0]
    profile = next(p for p in gpu.mig_profiles if p.slice_count == 2)
    placement = profile.placements[1]
    mig = (
        f'[{{"containerIndex":0,"deviceIndex":0,"gpuUUID":"{gpu.id}","profile":"{profile.name}",'
        f'"placement":{{"start":{placement.start},"size":{placement.size}}}}}]'
    )
    entry = f"{gpu.id},NVIDIA,{profile.memory_mb},{profile.core}:;"
    path = f"{PODS}/kwok-mig"
    api.post(PODS, scheduled_pod("kwok-mig", node, entry, mig))
    try:

        def done() -> dict[str, str] | None:
            ann: dict[str, str] = api.get(path)["metadata"]["annotations"]
            return ann if ann.get(BIND_PHASE) != "allocating" else None

        ann = eventually(done)
        assert ann[BIND_PHASE] == "success", ann
        assert ann[DEVICES_TO_ALLOCATE] == ";"
        [rec] = decode_mig_allocations(ann[MIG_ALLOCATIONS])
        assert rec.runtime is not None and rec.runtime.mig_uuid.startswith("MIG-")
        fake = agents.node(node)
        assert fake is not None
        assert [g.placement for g in fake.backend.gpu_instances(gpu.index)] == [
            Placement(placement.start, placement.size)
        ]
    finally:
        api.delete(path)
    eventually(gone(api, path))
    eventually(lambda: fake.backend.gpu_instances(gpu.index) == [])
    assert fake.mig.instances() == {}


def test_kwok_mode_allocates_a_hami_core_pod(
    api: KubeClient, dev_cluster: ClusterClient, agents: KwokAgents
) -> None:
    node = fake_node(api, dev_cluster, "hami-core")
    gpus = node_devices(api, node)
    entry = f"{gpus[0].id},NVIDIA,2000,20:{gpus[1].id},NVIDIA,2000,20:;"
    path = f"{PODS}/kwok-shared"
    api.post(PODS, scheduled_pod("kwok-shared", node, entry))
    try:

        def phase() -> str | None:
            p = api.get(path)["metadata"]["annotations"].get(BIND_PHASE)
            return None if p == "allocating" else str(p)

        assert eventually(phase) == "success"
        assert api.get(path)["metadata"]["annotations"][DEVICES_TO_ALLOCATE] == ";"
    finally:
        api.delete(path)
    eventually(gone(api, path))


def test_kwok_mode_reads_only_pods_bound_to_a_node(
    api: KubeClient, dev_cluster: ClusterClient, agents: KwokAgents
) -> None:
    """The agents list and watch the pods bound to a node: a pending pod's events never
    reach them (nor cost the apiserver a copy for them); it arrives once it is bound."""
    node = fake_node(api, dev_cluster, "hami-core")
    waiting = plain_pod("kwok-waiting")
    waiting["spec"]["schedulerName"] = "no-such-scheduler"  # stays pending until bound here
    api.post(PODS, waiting)
    api.post(PODS, plain_pod("kwok-bound", node))
    try:
        eventually(lambda: agents.pods.get("default/kwok-bound") is not None)
        # the watch delivers in order: the pending pod, created first, would be there now
        assert agents.pods.get("default/kwok-waiting") is None
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": "kwok-waiting"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        api.post(f"{PODS}/kwok-waiting/binding", binding)
        eventually(lambda: agents.pods.get("default/kwok-waiting") is not None)
        assert agents.pods.on_node(node)
    finally:
        api.delete(f"{PODS}/kwok-waiting")
        api.delete(f"{PODS}/kwok-bound")
    eventually(gone(api, f"{PODS}/kwok-waiting"))
    eventually(lambda: agents.pods.get("default/kwok-waiting") is None)


class CountingKube:
    """The real client, counting node reads: GETs of one node and LISTs of all."""

    def __init__(self, api: KubeClient) -> None:
        self._api = api
        self.node_gets: list[str] = []
        self.node_lists = 0

    def get(self, path: str, **kw: Any) -> Any:
        if path.startswith("/api/v1/nodes/"):
            self.node_gets.append(path.rsplit("/", 1)[1])
        return self._api.get(path, **kw)

    def list(self, path: str, **kw: Any) -> Any:
        if path == "/api/v1/nodes":
            self.node_lists += 1
        return self._api.list(path, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)


def test_kwok_mode_starts_every_fake_node_agent_before_its_first_pod(
    api: KubeClient, dev_cluster: ClusterClient
) -> None:
    """As a real node's agent starts with its node: the first pod on a node costs no
    NVML discovery or MIG adoption, and the agents' start costs one node list."""
    kube = CountingKube(api)
    with KwokAgents(kube, DeviceConfig(), watch_timeout_s=2) as agents:  # type: ignore[arg-type]
        eventually(lambda: set(dev_cluster.nodes) <= agents.started(), timeout_s=30)
        eventually(agents.idle, timeout_s=10)
        assert kube.node_lists == 1 and kube.node_gets == []


def test_kwok_mode_learns_fake_nodes_from_one_node_list_and_looks_up_late_ones_alone(
    api: KubeClient, dev_cluster: ClusterClient
) -> None:
    kube = CountingKube(api)
    plain = "kwok-plain-node"
    api.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": plain}})
    try:
        agents = KwokAgents(kube, DeviceConfig(), watch_timeout_s=2)  # type: ignore[arg-type]
        try:
            nodes = list(dev_cluster.nodes)
            assert len(nodes) >= 2
            built = [agents.node(n) for n in nodes]
            assert all(b is not None for b in built)
            assert agents.node(plain) is None  # not a fake node: not simulated
            assert kube.node_lists == 1 and kube.node_gets == [plain]
            # A node not in that list (a late one) is looked up alone, without listing
            # again until the list is old.
            assert agents.node("kwok-no-such-node") is None
            assert kube.node_lists == 1 and kube.node_gets == [plain, "kwok-no-such-node"]
        finally:
            agents.stop()
    finally:
        api.delete(f"/api/v1/nodes/{plain}")


def test_kwok_mode_serves_a_fake_mps_node_and_publishes_its_daemon_health(
    api: KubeClient, tmp_path: Path
) -> None:
    """A fake mps node: its pod is allocated through the MPS branch, and a daemon crash
    (a fault file, as the e2e tests drop it) flips that GPU's register health and back."""
    name = "kwok-mps-it"
    path = f"/api/v1/nodes/{name}"
    register = simulated_register_json(name, "A100-PCIE-40GB", 2, "mps")
    api.post(
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", NODE_REGISTER: register},
            },
        },
    )
    g0, g1 = (d.id for d in decode(register))
    pod_path = f"{PODS}/kwok-mps"
    try:
        with KwokAgents(
            api, DeviceConfig(), state_dir=tmp_path, watch_timeout_s=2, mps_check_interval_s=0.2
        ) as agents:
            api.post(PODS, scheduled_pod("kwok-mps", name, f"{g0},NVIDIA,2000,30:;"))

            def phase() -> str | None:
                p = api.get(pod_path)["metadata"]["annotations"].get(BIND_PHASE)
                return None if p == "allocating" else str(p)

            assert eventually(phase) == "success"
            fake = agents.node(name)
            assert fake is not None and fake.mps_backend is not None
            assert fake.mps_backend.daemons() == {g0, g1}

            def registered() -> str:
                value: str = api.get(path)["metadata"]["annotations"][NODE_REGISTER]
                return value

            faults = tmp_path / f"{name}.mps" / "faults"
            faults.mkdir()
            (faults / f"{g1}.fail_start").touch()
            (faults / f"{g1}.crash").touch()
            eventually(lambda: [d.health for d in decode(registered())] == [True, False])
            assert registered().replace(g1, "") == register.replace(g1, "").replace(
                ',"health":true}]', "}]"
            )
            (faults / f"{g1}.fail_start").unlink()
            eventually(lambda: registered() == register)
    finally:
        with contextlib.suppress(NotFoundError):
            api.delete(pod_path)
        api.delete(path)
    eventually(gone(api, pod_path))
