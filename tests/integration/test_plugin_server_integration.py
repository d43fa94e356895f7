"""The plugin server against a real kube-apiserver: watches, PreBind's patch, restart, re-list."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import encode
from api.kube.client import KubeClient, Obj, Watch
from api.kube.errors import GoneError, NotFoundError, UnreachableError
from api.kube.objects import pod_key
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import counts_against_capacity, parse_allocation
from scheduler_plugins.core.state import build_state
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from scheduler_plugins.server.app import PluginServer
from tests.builders import gpu, mig_gpu
from tests.priority import PRIORITY_CLASSES, priority_class, wait_admitted
from tests.waiting import eventually

pytestmark = pytest.mark.integration

PODS = "/api/v1/namespaces/default/pods"
NODES = "/api/v1/nodes"
V1 = pb.PROTOCOL_VERSION_1
CORE_NODE = "ps-core"
MIG_NODE = "ps-mig"


def node_obj(name: str, register: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {ann.NODE_REGISTER: register}},
    }


def pod_obj(
    name: str,
    *,
    node: str | None = None,
    gpus: int = 1,
    mem: int = 1000,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/cuda:latest",
                "resources": {
                    "limits": {"nvidia.com/gpu": str(gpus), "nvidia.com/gpumem": str(mem)}
                },
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"suite": "plugin-server"},
            "annotations": annotations or {},
        },
        "spec": spec,
    }


def bound(name: str, node: str, devices: str, mig: str | None = None) -> dict[str, Any]:
    a = {
        ann.VGPU_NODE: node,
        ann.BIND_TIME: "1700000000",
        ann.BIND_PHASE: "success",
        ann.DEVICES_ALLOCATED: devices,
        ann.DEVICES_TO_ALLOCATE: ";",
    }
    if mig is not None:
        a[ann.MIG_ALLOCATIONS] = mig
    return pod_obj(name, node=node, annotations=a)


def force_delete(api: KubeClient, path: str) -> None:
    with contextlib.suppress(NotFoundError):
        api.request(
            "DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        )


def expected_snapshot(api: KubeClient, nodes: tuple[str, ...]) -> dict[str, Any]:
    """Usage of ``nodes`` computed from scratch from what the API holds now."""
    infos = [parse_node(n) for n in api.list(NODES)["items"]]
    pods = {}
    for p in api.list("/api/v1/pods")["items"]:
        if counts_against_capacity(p):
            alloc = parse_allocation(p)
            if alloc is not None:
                pods[pod_key(p)] = alloc
    state = build_state(
        DeviceConfig(), [(i.name, i.devices, i.cpu_milli, i.memory_bytes) for i in infos], pods
    )
    return _only(state.usage_snapshot(), nodes)


def _only(snapshot: dict[str, Any], nodes: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if k.split("/", 1)[0] in nodes}


def snapshot_of(server: PluginServer, nodes: tuple[str, ...]) -> dict[str, Any]:
    with server.cache.lock:
        return _only(server.cache.state.usage_snapshot(), nodes)


@pytest.fixture
def api(dev_cluster: ClusterClient) -> Iterator[KubeClient]:
    with KubeClient.from_kubeconfig(dev_cluster.kubeconfig, timeout_s=15) as client:
        yield client


@pytest.fixture
def gpu_nodes(api: KubeClient) -> Iterator[tuple[str, ...]]:
    """Two GPU nodes of our own (no kubelet): a hami-core one and a MIG one."""
    api.post(NODES, node_obj(CORE_NODE, encode([gpu("GPU-c0"), gpu("GPU-c1", index=1)])))
    api.post(NODES, node_obj(MIG_NODE, encode([mig_gpu("GPU-m0")])))
    try:
        yield (CORE_NODE, MIG_NODE)
    finally:
        for p in api.list(PODS, label_selector="suite=plugin-server")["items"]:
            force_delete(api, f"{PODS}/{p['metadata']['name']}")
        for n in (CORE_NODE, MIG_NODE):
            force_delete(api, f"{NODES}/{n}")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tpsi-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(kube: Any, sock: Path) -> PluginServer:
    from scheduler_plugins.server.watch import Backoff

    server = PluginServer(
        kube,
        DeviceConfig(),
        socket_path=sock,
        watch_timeout_s=5,
        backoff=Backoff(0.05, 0.5),
        prebind_wait_s=5,
    )
    server.start()
    assert server.wait_ready(30)
    return server


MIG_RESERVATION = json.dumps(
    [
        {
            "containerIndex": 0,
            "deviceIndex": 0,
            "gpuUUID": "GPU-m0",
            "profile": "3g.20gb",
            "placement": {"start": 4, "size": 4},
        }
    ]
)


def test_cache_converges_from_watches_and_a_restart_rebuilds_the_same_state(
    api: KubeClient, gpu_nodes: tuple[str, ...], short_dir: Path
) -> None:
    api.post(PODS, bound("ps-a", CORE_NODE, "GPU-c0,NVIDIA,3000,20:;"))
    server = serve(api, short_dir / "a.sock")
    try:
        assert snapshot_of(server, gpu_nodes) == expected_snapshot(api, gpu_nodes)
        # Changes after the initial list arrive through the watch.
        api.post(PODS, bound("ps-b", CORE_NODE, "GPU-c1,NVIDIA,5000,0:;"))
        api.post(PODS, bound("ps-m", MIG_NODE, "GPU-m0,NVIDIA,19968,42:;", MIG_RESERVATION))
        force_delete(api, f"{PODS}/ps-a")
        eventually(lambda: snapshot_of(server, gpu_nodes) == expected_snapshot(api, gpu_nodes))
        held = snapshot_of(server, gpu_nodes)
        assert held[f"{CORE_NODE}/GPU-c0"][0] == 0  # ps-a released
        assert held[f"{CORE_NODE}/GPU-c1"][:2] == (1.0, 5000.0)
        assert held[f"{MIG_NODE}/GPU-m0"][3] == 0b11110000  # slices [4, 8)
    finally:
        server.stop()
    restarted = serve(api, short_dir / "b.sock")
    try:
        assert snapshot_of(restarted, gpu_nodes) == held
    finally:
        restarted.stop()


def test_prebind_patch_lands_on_the_real_pod(
    api: KubeClient, gpu_nodes: tuple[str, ...], short_dir: Path
) -> None:
    created = api.post(PODS, pod_obj("ps-p", gpus=2, mem=8000, annotations={ann.VGPU_MODE: "mig"}))
    uid = created["metadata"]["uid"]
    ref = pb.PodRef(namespace="default", name="ps-p", uid=uid)
    server = serve(api, short_dir / "p.sock")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)  # type: ignore[no-untyped-call]
            r = stub.PreFilter(
                pb.PreFilterRequest(version=V1, pod=ref, pod_json=json.dumps(created).encode()),
                timeout=10,
            )
            assert r.code == pb.PreFilterResponse.OK, r.message
            assert MIG_NODE in r.feasible_nodes
            stub.Reserve(
                pb.ReserveRequest(version=V1, pod=ref, node=MIG_NODE, decision_id=r.decision_id),
                timeout=10,
            )
            written = dict(
                stub.PreBind(
                    pb.PreBindRequest(version=V1, pod=ref, node=MIG_NODE), timeout=10
                ).annotations
            )
        pod = api.get(f"{PODS}/ps-p")
        got = pod["metadata"]["annotations"]
        assert {k: got[k] for k in written} == written
        assert written[ann.BIND_PHASE] == "allocating" and ann.MIG_ALLOCATIONS in written
        # The watch shows the patch: the pod's own record replaces the reservation.
        eventually(lambda: not server.cache.state.is_assumed("default/ps-p"))
        assert snapshot_of(server, gpu_nodes) == expected_snapshot(api, gpu_nodes)
    finally:
        server.stop()


class FlakyKube:
    """The real client, but its watches can be made to fail: down (unreachable), then 410."""

    def __init__(self, real: KubeClient) -> None:
        self.real = real
        self.down = threading.Event()
        self.gone_once = threading.Event()

    def list(self, path: str) -> Obj:
        if self.down.is_set():
            raise UnreachableError("apiserver down (test)")
        return self.real.list(path)

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> Watch:
        if self.down.is_set():
            raise UnreachableError("apiserver down (test)")
        if path.endswith("/pods") and self.gone_once.is_set():
            self.gone_once.clear()
            raise GoneError("GET", path, 410, "Expired", "too old resource version")
        return self.real.watch(path, resource_version, timeout_s=timeout_s)

    def get(self, path: str) -> Any:
        return self.real.get(path)

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        return self.real.merge_patch(path, patch, resource_version=resource_version)

    def post(self, path: str, body: object) -> Any:
        return self.real.post(path, body)


def test_broken_watch_and_410_gone_relist_and_converge(
    api: KubeClient, gpu_nodes: tuple[str, ...], short_dir: Path
) -> None:
    api.post(PODS, bound("ps-x", CORE_NODE, "GPU-c0,NVIDIA,2000,0:;"))
    kube = FlakyKube(api)
    server = serve(kube, short_dir / "f.sock")
    try:
        lists = server.watches.pods.lists
        kube.down.set()
        server.watches.pods.interrupt()  # the connection drops; the apiserver is away
        # What happens meanwhile is only visible to a new list.
        api.post(PODS, bound("ps-y", CORE_NODE, "GPU-c1,NVIDIA,4000,0:;"))
        force_delete(api, f"{PODS}/ps-x")
        # (Whether the old watch saw these before it dropped is a race; the re-list counts
        # below prove the recovery path ran.)
        kube.gone_once.set()  # back, but the first watch finds its version compacted
        kube.down.clear()
        eventually(lambda: snapshot_of(server, gpu_nodes) == expected_snapshot(api, gpu_nodes))
        eventually(lambda: not kube.gone_once.is_set())
        eventually(lambda: server.watches.pods.lists >= lists + 2)
        assert server.cache.state.allocation("default/ps-x") is None
        api.post(PODS, bound("ps-z", CORE_NODE, "GPU-c0,NVIDIA,1000,0:;"))
        eventually(lambda: server.cache.state.allocation("default/ps-z") is not None)
    finally:
        server.stop()


@pytest.fixture
def high_priority(api: KubeClient) -> Iterator[str]:
    """A PriorityClass of value 1000 (admission sets the pods' spec.priority from it)."""
    api.post(PRIORITY_CLASSES, priority_class("ps-high", 1000))
    try:
        wait_admitted(api, "ps-high", 1000)
        yield "ps-high"
    finally:
        force_delete(api, f"{PRIORITY_CLASSES}/ps-high")


def test_preemption_what_ifs_and_the_preemptors_event_from_the_watch(
    api: KubeClient, gpu_nodes: tuple[str, ...], short_dir: Path, high_priority: str
) -> None:
    """What kube-scheduler's preemption sees (preemptible nodes, a dry run on one node) and
    what it does (the victim marked and deleted, the preemptor nominated), against the API:
    the victim counts until it is gone, and the preemptor gets one Normal Event naming it."""
    low = api.post(
        PODS,
        bound("ps-low", CORE_NODE, "GPU-c0,NVIDIA,6000,10:GPU-c1,NVIDIA,6000,10:;"),
    )
    urgent = pod_obj("ps-urgent", mem=4000, annotations={ann.VGPU_MODE: "hami-core"})
    urgent["spec"]["priorityClassName"] = high_priority
    urgent = api.post(PODS, urgent)
    assert urgent["spec"]["priority"] == 1000
    ref = pb.PodRef(namespace="default", name="ps-urgent", uid=urgent["metadata"]["uid"])
    server = serve(api, short_dir / "pre.sock")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)  # type: ignore[no-untyped-call]
            r = stub.PreFilter(
                pb.PreFilterRequest(version=V1, pod=ref, pod_json=json.dumps(urgent).encode()),
                timeout=10,
            )
            assert CORE_NODE not in r.feasible_nodes and CORE_NODE in r.preemptible_nodes
            assert MIG_NODE not in r.preemptible_nodes

            def dry_run(*removed: str) -> pb.FilterWhatIfResponse:
                return stub.FilterWhatIf(  # type: ignore[no-any-return]
                    pb.FilterWhatIfRequest(
                        version=V1,
                        pod=ref,
                        decision_id=r.decision_id,
                        node=CORE_NODE,
                        removed_pod_uids=list(removed),
                    ),
                    timeout=10,
                )

            assert not dry_run().fits
            assert dry_run(low["metadata"]["uid"]).fits
        held = snapshot_of(server, gpu_nodes)
        # kube-scheduler preempts: marks the victim, deletes it, nominates the preemptor.
        api.merge_patch(
            f"{PODS}/ps-low/status",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                            "message": "preempting to accommodate a higher priority pod",
                        }
                    ]
                }
            },
        )
        eventually(lambda: server.cache.state.allocation("default/ps-low") is not None)
        assert snapshot_of(server, gpu_nodes) == held  # marked, it still counts
        force_delete(api, f"{PODS}/ps-low")
        api.merge_patch(f"{PODS}/ps-urgent/status", {"status": {"nominatedNodeName": CORE_NODE}})
        eventually(lambda: server.cache.state.allocation("default/ps-low") is None)

        def reported() -> list[dict[str, Any]]:
            events = api.list("/api/v1/namespaces/default/events")["items"]
            return [e for e in events if e.get("reason") == "TesseraPreemption"]

        [event] = eventually(reported, what="the preemptor's TesseraPreemption event")
        assert event["type"] == "Normal"
        assert event["involvedObject"]["uid"] == urgent["metadata"]["uid"]
        assert "default/ps-low (priority 0, held GPU GPU-c0 6000MiB 10% cores" in event["message"]
        assert f"on node {CORE_NODE}" in event["message"]
        assert "did not fit there with them: insufficient GPU memory." in event["message"]
        victims = server.metrics_registry.get_sample_value("tessera_preemption_victims_total")
        assert victims == 1
    finally:
        server.stop()
        for e in api.list("/api/v1/namespaces/default/events")["items"]:
            if e.get("reason") == "TesseraPreemption":
                force_delete(api, f"/api/v1/namespaces/default/events/{e['metadata']['name']}")
