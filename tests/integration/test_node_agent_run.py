"""``NodeAgent.run`` against the real apiserver, a simulated NVML and a fake kubelet.

Each test starts the agent of one (plain, not kwok-managed) node in a thread, with a
``SimulatedNvml`` and ``tests.fake_kubelet.FakeKubelet`` in a temp plugin dir, and plays the
kubelet's admission of scheduler-annotated pods: GetPreferredAllocation, then Allocate with
the ids it preferred. Every wait is bounded; every test checks that no thread is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    decode_devices,
    decode_mig_allocations,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.keys import (
    BIND_PHASE,
    BIND_TIME,
    DEVICES_ALLOCATED,
    DEVICES_TO_ALLOCATE,
    MIG_ALLOCATIONS,
    NODE_REGISTER,
    VGPU_NODE,
)
from api.hami.register import GpuDevice, Placement, decode
from api.kube.client import KubeClient
from api.kube.errors import NotFoundError
from node_agent.agent import NodeAgent
from node_agent.identities import KubeletPodResources
from node_agent.mig_manager import InstanceKey
from node_agent.nvml.errors import Uninitialized
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from node_agent.registration import HANDSHAKE
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from tests.fake_kubelet import FakeKubelet, FakePodResources, PluginConnection
from tests.waiting import eventually as _eventually

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_leaked_threads")]

PODS = "/api/v1/namespaces/default/pods"
MIG_NODE = "it-run-mig"
SHARED_NODE = "it-run-shared"
A100 = "A100-PCIE-40GB"
CONFIG = DeviceConfig(
    nodeconfig=(NodeConfig(MIG_NODE, "mig"), NodeConfig(SHARED_NODE, "hami-core"))
)
WAIT_S = 20.0


def eventually(check: Callable[[], Any], *, timeout_s: float = WAIT_S, what: str = "") -> Any:
    return _eventually(check, timeout_s=timeout_s, interval_s=0.05, what=what)


# Fixtures -------------------------------------------------------------------------------


@pytest.fixture
def api(dev_cluster: ClusterClient) -> Iterator[KubeClient]:
    with KubeClient.from_kubeconfig(dev_cluster.kubeconfig, timeout_s=15) as client:
        yield client


def node_fixture(api: KubeClient, name: str) -> Iterator[str]:
    api.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    try:
        yield name
    finally:
        for pod in api.list("/api/v1/pods", field_selector=f"spec.nodeName={name}")["items"]:
            with contextlib.suppress(NotFoundError):
                api.delete(f"{PODS}/{pod['metadata']['name']}")
        api.delete(f"/api/v1/nodes/{name}")


@pytest.fixture
def mig_node(api: KubeClient) -> Iterator[str]:
    yield from node_fixture(api, MIG_NODE)


@pytest.fixture
def shared_node(api: KubeClient) -> Iterator[str]:
    yield from node_fixture(api, SHARED_NODE)


class Running:
    """A ``NodeAgent.run`` in a thread; ``close`` stops it and re-raises what it raised."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-agent-{agent.node_name}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.agent.run(self.stop)
        except BaseException as e:
            self.error = e

    def wait_ready(self) -> None:
        eventually(
            lambda: self.agent.ready.is_set() or not self.thread.is_alive(), what="agent ready"
        )
        assert self.error is None, self.error
        assert self.agent.ready.is_set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the agent did not stop"
        if self.error is not None:
            raise self.error


def start_agent(
    node: str, backend: SimulatedNvml, api: KubeClient, plugin_dir: Path, **extra: Any
) -> Running:
    agent = NodeAgent(
        node,
        api,
        backend,
        CONFIG,
        plugin_dir=plugin_dir,
        reconcile_interval_s=0.3,
        health_interval_s=0.2,
        register_interval_s=30,
        plugin_retry_s=0.2,
        plugin_watch_interval_s=0.1,
        **extra,
    )
    running = Running(agent)
    try:
        running.wait_ready()
    except BaseException:
        running.close()
        raise
    return running


@contextlib.contextmanager
def agent_with_pod_resources(
    node: str, backend: SimulatedNvml, api: KubeClient, plugin_dir: Path
) -> Iterator[tuple[Running, FakePodResources]]:
    """A running agent that reads the kubelet's PodResources from a fake socket (checked
    every 0.05 s), and that socket; both stopped after."""
    with tempfile.TemporaryDirectory(prefix="podres-") as d:
        podres = FakePodResources(Path(d) / "kubelet.sock")
        running = start_agent(
            node,
            backend,
            api,
            plugin_dir,
            pod_resources=KubeletPodResources(str(podres.path)),
            identity_check_s=0.05,
        )
        try:
            yield running, podres
        finally:
            running.close()
            podres.stop()


def registered(api: KubeClient, node: str) -> list[GpuDevice]:
    def read() -> list[GpuDevice] | None:
        ann = api.get(f"/api/v1/nodes/{node}")["metadata"].get("annotations") or {}
        return sorted(decode(ann[NODE_REGISTER]), key=lambda d: d.index) if ann else None

    devices: list[GpuDevice] = eventually(read, what=f"{NODE_REGISTER} on {node}")
    return devices


def scheduled_pod(
    name: str, node: str, entries: list[list[tuple[str, int, int]]], mig: list[MigAllocation]
) -> dict[str, Any]:
    """A pod as the scheduler's bind leaves it (containers c0.., one per entry)."""
    devices = encode_devices(tuple(tuple(DeviceAlloc(*d) for d in e) for e in entries))
    ann = {
        VGPU_NODE: node,
        BIND_TIME: str(int(time.time())),
        BIND_PHASE: "allocating",
        DEVICES_ALLOCATED: devices,
        DEVICES_TO_ALLOCATE: devices,
    }
    if mig:
        ann[MIG_ALLOCATIONS] = encode_mig_allocations(mig)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": ann},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": f"c{i}", "image": "registry.invalid/cuda:latest"}
                for i in range(len(entries))
            ],
        },
    }


def pod_annotations(api: KubeClient, pod: str) -> dict[str, str]:
    ann: dict[str, str] = api.get(f"{PODS}/{pod}")["metadata"]["annotations"]
    return ann


def all_ids(conn: PluginConnection) -> list[str]:
    return [d.ID for d in conn.next_update()]


def gis(backend: SimulatedNvml, index: int) -> list[Placement]:
    """GPU instances of GPU ``index`` from the simulated state (readable in or out of a
    session)."""
    gpu = backend.state_snapshot()["gpus"][index]
    return [Placement(g["start"], g["size"]) for g in gpu["gpuInstances"]]


def delete(api: KubeClient, pod: str) -> None:
    api.delete(f"{PODS}/{pod}")

    def gone() -> bool:
        try:
            api.get(f"{PODS}/{pod}")
        except NotFoundError:
            return True
        return False

    eventually(gone, what=f"pod {pod} deleted")


# MIG node -------------------------------------------------------------------------------


def test_mig_node_allocates_reclaims_and_adopts_after_restart(
    api: KubeClient, mig_node: str, plugin_dir: Path, kubelet: FakeKubelet, tmp_path: Path
) -> None:
    state = tmp_path / "nvml.json"
    specs = [SimulatedGpuSpec(A100), SimulatedGpuSpec(A100)]
    backend = SimulatedNvml(specs, state, node_name=mig_node)
    running = start_agent(mig_node, backend, api, plugin_dir)
    try:
        conn = kubelet.next_connection()
        assert conn.request.resource_name == "nvidia.com/gpu"
        assert conn.request.endpoint == running.agent.socket_name
        assert conn.request.options.get_preferred_allocation_available
        ids = all_ids(conn)
        devices = registered(api, mig_node)
        # HAMi's count in mig mode: the most instances of one profile (seven 1g.5gb)
        assert len(ids) == sum(d.count for d in devices) == 2 * 7
        assert [d.mode for d in devices] == ["mig", "mig"]
        node_ann = api.get(f"/api/v1/nodes/{mig_node}")["metadata"]["annotations"]
        assert node_ann[HANDSHAKE].startswith("Reported ")

        gpu = devices[1]  # spread would prefer GPU 0: steering must pick GPU 1
        profile = next(p for p in gpu.mig_profiles if p.name == "2g.10gb")
        place = profile.placements[1]

        def admit(name: str, placement: Placement) -> tuple[str, MigAllocation]:
            alloc = MigAllocation(0, 0, gpu.id, profile.name, placement)
            api.post(
                PODS,
                scheduled_pod(
                    name, mig_node, [[(gpu.id, profile.memory_mb, profile.core)]], [alloc]
                ),
            )
            preferred = conn.preferred(ids, 1)
            assert preferred == [f"{gpu.id}-0"]
            envs = dict(conn.allocate(preferred).envs)
            mig_uuid = envs["NVIDIA_VISIBLE_DEVICES"]
            assert mig_uuid.startswith("MIG-")
            ann = pod_annotations(api, name)
            assert ann[BIND_PHASE] == "success"
            assert ann[DEVICES_TO_ALLOCATE] == ";"
            [rec] = decode_mig_allocations(ann[MIG_ALLOCATIONS])
            assert rec.runtime is not None and rec.runtime.mig_uuid == mig_uuid
            return mig_uuid, alloc

        admit("run-mig-a", Placement(place.start, place.size))
        assert gis(backend, 1) == [Placement(place.start, place.size)]

        # The pod goes away: the reconcile loop destroys its instance.
        delete(api, "run-mig-a")
        eventually(lambda: gis(backend, 1) == [], what="instance of the deleted pod destroyed")

        # Another pod holds an instance across an agent restart.
        keep_placement = Placement(profile.placements[0].start, profile.placements[0].size)
        keep_uuid, _ = admit("run-mig-keep", keep_placement)
    finally:
        running.close()
    assert not running.agent.socket_path.exists()
    with pytest.raises(Uninitialized):
        backend.device_count()  # the agent's NVML session is closed
    backend.shutdown()  # closing twice is harmless
    assert gis(backend, 1) == [keep_placement]

    restarted = SimulatedNvml(specs, state, node_name=mig_node)
    running = start_agent(mig_node, restarted, api, plugin_dir)
    try:
        kubelet.next_connection()  # registered again
        manager = running.agent.mig_manager
        assert manager is not None
        key = InstanceKey(1, profile.name, keep_placement.start, keep_placement.size)
        managed = manager.instances()
        assert set(managed) == {key}
        assert managed[key].adopted and managed[key].identity.mig_uuid == keep_uuid
        time.sleep(1.0)  # several reconcile passes
        assert gis(restarted, 1) == [keep_placement]
        assert restarted.mig_device_uuid(1, managed[key].identity.gpu_instance_id, 0) == keep_uuid

        delete(api, "run-mig-keep")
        eventually(lambda: gis(restarted, 1) == [], what="adopted instance reclaimed")
    finally:
        running.close()
    assert not running.agent.socket_path.exists()


# hami-core node -------------------------------------------------------------------------


def test_shared_node_steers_binds_count_distinct_pods_concurrently_and_pushes_health(
    api: KubeClient, shared_node: str, plugin_dir: Path, kubelet: FakeKubelet
) -> None:
    specs = [SimulatedGpuSpec(A100, mig_enabled=False)] * 2
    backend = SimulatedNvml(specs, None, node_name=shared_node)
    running = start_agent(shared_node, backend, api, plugin_dir)
    try:
        conn = kubelet.next_connection()
        ids = all_ids(conn)
        assert len(ids) == 20
        g0, g1 = (d.id for d in registered(api, shared_node))

        # Two pods allocating at once on one node, next containers asking 1 and 2 devices.
        api.post(PODS, scheduled_pod("run-one", shared_node, [[(g1, 3000, 30)]], []))
        api.post(
            PODS,
            scheduled_pod("run-two", shared_node, [[(g0, 2000, 20), (g1, 2000, 20)]], []),
        )
        two = conn.preferred(ids, 2)
        assert sorted(two) == sorted([f"{g0}-0", f"{g1}-0"])
        envs_two = dict(conn.allocate(two).envs)
        assert envs_two["NVIDIA_VISIBLE_DEVICES"] == f"{g0},{g1}"
        assert envs_two["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
        assert envs_two["CUDA_DEVICE_MEMORY_LIMIT_1"] == "2000m"

        left = [i for i in ids if i not in two]
        one = conn.preferred(left, 1)
        assert one == [f"{g1}-1"]
        envs_one = dict(conn.allocate(one).envs)
        assert envs_one["NVIDIA_VISIBLE_DEVICES"] == g1
        assert envs_one["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"
        assert envs_one["CUDA_DEVICE_SM_LIMIT"] == "30"
        for pod in ("run-one", "run-two"):
            ann = pod_annotations(api, pod)
            assert (ann[BIND_PHASE], ann[DEVICES_TO_ALLOCATE]) == ("success", ";")

        # Two pods whose next containers ask the same count, and other memory: no steering,
        # no guessing.
        api.post(PODS, scheduled_pod("run-same-a", shared_node, [[(g0, 1000, 10)]], []))
        api.post(PODS, scheduled_pod("run-same-b", shared_node, [[(g1, 1500, 10)]], []))
        assert conn.preferred(left, 1) == [f"{g0}-1"]  # the spread choice
        with pytest.raises(grpc.RpcError) as err:
            conn.allocate([f"{g1}-2"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refusing to guess" in str(err.value.details())
        for pod in ("run-same-a", "run-same-b"):
            assert pod_annotations(api, pod)[BIND_PHASE] == "allocating"

        # A health change reaches ListAndWatch and the register annotation.
        backend.set_health(0, False)
        update = {d.ID: d.health for d in conn.next_update()}
        assert {update[f"{g0}-{s}"] for s in range(10)} == {"Unhealthy"}
        assert {update[f"{g1}-{s}"] for s in range(10)} == {"Healthy"}
        eventually(
            lambda: [d.health for d in registered(api, shared_node)] == [False, True],
            what="unhealthy GPU registered",
        )
    finally:
        running.close()
    assert not running.agent.socket_path.exists()
    assert running.agent.mig_manager is None  # hami-core nodes never touch MIG


def test_interchangeable_pods_allocate_at_once_and_their_gpus_follow_the_kubelets_record(
    api: KubeClient, shared_node: str, plugin_dir: Path, kubelet: FakeKubelet
) -> None:
    """Two replicas on one node, allocating together: the kubelet admits the second first,
    Allocate hands it the first's entry (the pods are alike), and once the kubelet's
    PodResources shows who holds which ids, each pod records the GPU it really got."""
    specs = [SimulatedGpuSpec(A100, mig_enabled=False)] * 2
    backend = SimulatedNvml(specs, None, node_name=shared_node)
    with agent_with_pod_resources(shared_node, backend, api, plugin_dir) as (running, podres):
        conn = kubelet.next_connection()
        ids = all_ids(conn)
        g0, g1 = (dev.id for dev in registered(api, shared_node))
        api.post(PODS, scheduled_pod("rep-a", shared_node, [[(g0, 1000, 10)]], []))
        api.post(PODS, scheduled_pod("rep-b", shared_node, [[(g1, 1000, 10)]], []))
        # The kubelet admits rep-b: GetPreferredAllocation names one replica's GPU.
        first = conn.preferred(ids, 1)
        gpu_first = first[0].rsplit("-", 1)[0]
        envs = dict(conn.allocate(first).envs)
        assert envs["NVIDIA_VISIBLE_DEVICES"] == gpu_first
        assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
        second = conn.preferred([i for i in ids if i not in first], 1)
        gpu_second = second[0].rsplit("-", 1)[0]
        assert {gpu_first, gpu_second} == {g0, g1}
        conn.allocate(second)
        for pod in ("rep-a", "rep-b"):
            assert pod_annotations(api, pod)[BIND_PHASE] == "success"
        # The kubelet recorded rep-b's container with the first ids, rep-a's the second.
        podres.held = {("default/rep-b", "c0"): first, ("default/rep-a", "c0"): second}

        def gpus(pod: str) -> list[str]:
            devices = decode_devices(pod_annotations(api, pod)[DEVICES_ALLOCATED])
            return [dev.uuid for c in devices for dev in c]

        eventually(
            lambda: gpus("rep-b") == [gpu_first] and gpus("rep-a") == [gpu_second],
            what="recorded GPUs follow the kubelet's record",
        )
        identities = running.agent.identities
        assert identities is not None and not identities.pending()


def test_mig_replicas_allocate_at_once_and_their_instances_follow_the_kubelets_record(
    api: KubeClient, mig_node: str, plugin_dir: Path, kubelet: FakeKubelet
) -> None:
    """Two MIG pods of one profile on one node, allocating together: the kubelet admits the
    second first and Allocate creates the first's reserved instance for it. Once the
    kubelet's PodResources shows who holds which ids, each pod records the instance it runs
    on, the reconcile loop moves the instances' ownership instead of destroying them, and
    when a pod ends the instance it really held goes."""
    specs = [SimulatedGpuSpec(A100), SimulatedGpuSpec(A100)]
    backend = SimulatedNvml(specs, None, node_name=mig_node)
    with agent_with_pod_resources(mig_node, backend, api, plugin_dir) as (running, podres):
        conn = kubelet.next_connection()
        ids = all_ids(conn)
        devices = registered(api, mig_node)
        profile = next(p for p in devices[0].mig_profiles if p.name == "2g.10gb")
        place = Placement(profile.placements[0].start, profile.placements[0].size)
        for name, gpu in (("mrep-a", devices[0]), ("mrep-b", devices[1])):
            alloc = MigAllocation(0, 0, gpu.id, profile.name, place)
            entry = [[(gpu.id, profile.memory_mb, profile.core)]]
            api.post(PODS, scheduled_pod(name, mig_node, entry, [alloc]))
        # The kubelet admits mrep-b: the agent cannot tell, and the pods are alike.
        first = conn.preferred(ids, 1)
        x = dict(conn.allocate(first).envs)["NVIDIA_VISIBLE_DEVICES"]
        second = conn.preferred([i for i in ids if i not in first], 1)
        y = dict(conn.allocate(second).envs)["NVIDIA_VISIBLE_DEVICES"]
        assert x.startswith("MIG-") and y.startswith("MIG-") and x != y
        assert gis(backend, 0) == gis(backend, 1) == [place]
        podres.held = {("default/mrep-b", "c0"): first, ("default/mrep-a", "c0"): second}

        def held(pod: str) -> list[str]:
            recs = decode_mig_allocations(pod_annotations(api, pod)[MIG_ALLOCATIONS])
            return [r.runtime.mig_uuid for r in recs if r.runtime is not None]

        eventually(
            lambda: (held("mrep-b"), held("mrep-a")) == ([x], [y]),
            what="recorded MIG instances follow the kubelet's record",
        )
        manager = running.agent.mig_manager
        assert manager is not None

        def owners() -> dict[str, str]:
            return {m.identity.mig_uuid: m.owner.pod for m in manager.instances().values()}

        eventually(
            lambda: owners() == {x: "default/mrep-b", y: "default/mrep-a"},
            what="the reconcile loop moves the instances to their holders",
        )
        assert gis(backend, 0) == gis(backend, 1) == [place]  # nothing destroyed
        delete(api, "mrep-b")  # it ran on x, the instance reserved for mrep-a
        eventually(
            lambda: set(owners()) == {y} and gis(backend, 1) == [place],
            what="the ended pod's real instance reclaimed, the other kept",
        )
        identities = running.agent.identities
        assert identities is not None and not identities.pending()


def test_agent_waits_for_the_kubelet_and_stops_cleanly_without_one(
    api: KubeClient, shared_node: str, plugin_dir: Path
) -> None:
    backend = SimulatedNvml(
        [SimulatedGpuSpec(A100, mig_enabled=False)], None, node_name=shared_node
    )
    agent = NodeAgent(shared_node, api, backend, CONFIG, plugin_dir=plugin_dir, plugin_retry_s=0.1)
    running = Running(agent)
    try:
        registered(api, shared_node)  # registration does not wait for the kubelet
        assert not agent.ready.is_set()
        kubelet = FakeKubelet(plugin_dir)
        try:
            running.wait_ready()
            assert len(kubelet.next_connection().next_update()) == 10
        finally:
            running.close()
            kubelet.stop()
    finally:
        if running.thread.is_alive():
            running.close()
    assert not agent.socket_path.exists()


def test_cli_runs_a_simulated_node_and_stops_on_sigterm(
    api: KubeClient,
    dev_cluster: ClusterClient,
    shared_node: str,
    plugin_dir: Path,
    kubelet: FakeKubelet,
    tmp_path: Path,
) -> None:
    config = tmp_path / "device-config.yaml"
    config.write_text(
        f"nvidia:\n  nodeconfig:\n    - name: {shared_node}\n      operatingmode: hami-core\n"
    )
    env = {
        **os.environ,
        "TESSERA_NVML": "simulated",
        "TESSERA_SIM_GPUS": f"{A100},{A100}",
        "TESSERA_SIM_STATE": str(tmp_path / "nvml.json"),
    }
    cmd = [
        sys.executable,
        "-m",
        "scheduler_plugins.cli",
        "node-agent",
        "run",
        "--node-name",
        shared_node,
        "--kubeconfig",
        str(dev_cluster.kubeconfig),
        "--config",
        str(config),
        "--plugin-dir",
        str(plugin_dir),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        try:
            conn = kubelet.next_connection()
        except BaseException:
            proc.kill()
            print(proc.communicate(timeout=WAIT_S)[0].decode()[-3000:])
            raise
        assert len(conn.next_update()) == 20
        assert len(registered(api, shared_node)) == 2
        assert (plugin_dir / "tessera-gpu.sock").exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, out.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=WAIT_S)
    assert not (plugin_dir / "tessera-gpu.sock").exists()
