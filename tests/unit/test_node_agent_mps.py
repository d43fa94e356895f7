"""``NodeAgent`` on an mps node against an in-memory apiserver, a fake kubelet and
simulated GPUs and MPS daemons: registration, Allocate through the kubelet's gRPC, a daemon
down pushed to ListAndWatch and the register annotation, adoption after a restart, and
daemons stopped on a node that left mps mode."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.keys import BIND_PHASE, NODE_REGISTER
from api.hami.register import GpuDevice, decode
from node_agent.agent import NodeAgent
from node_agent.mps import SimulatedMps
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from tests.fake_kubelet import FakeKubelet, PluginConnection
from tests.node_agent_fakes import FakeKube, make_pod
from tests.waiting import eventually

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

NODE = "node-a"
NODE_PATH = f"/api/v1/nodes/{NODE}"
A100 = "A100-PCIE-40GB"
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
WAIT_S = 10.0


@dataclass
class Running:
    agent: NodeAgent
    stop: threading.Event
    thread: threading.Thread
    errors: list[BaseException]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        assert self.errors == []


def start_agent(kube: FakeKube, mps: SimulatedMps, plugin_dir: Path, mode: str = "mps") -> Running:
    nvml = SimulatedNvml([SimulatedGpuSpec(A100, uuid=G0), SimulatedGpuSpec(A100, uuid=G1)])
    config = DeviceConfig(nodeconfig=(NodeConfig(NODE, mode),))  # type: ignore[arg-type]
    agent = NodeAgent(
        NODE,
        kube,
        nvml,
        config,
        plugin_dir=plugin_dir,
        health_interval_s=0.1,
        plugin_watch_interval_s=0.05,
        mps_backend=mps,
        mps_check_interval_s=0.05,
    )
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            agent.run(stop)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    running = Running(agent, stop, thread, errors)
    if not agent.ready.wait(WAIT_S):
        running.close()
        pytest.fail("agent not ready")
    return running


def registered(kube: FakeKube) -> list[GpuDevice]:
    return list(decode(kube.annotations(NODE_PATH)[NODE_REGISTER]))


def health_by_gpu(conn: PluginConnection) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for d in conn.next_update():
        out.setdefault(d.ID.rsplit("-", 1)[0], set()).add(d.health)
    return out


def test_mps_node_registers_allocates_and_reports_a_daemon_down(
    plugin_dir: Path, kubelet: FakeKubelet, tmp_path: Path
) -> None:
    kube = FakeKube()
    kube.put(NODE_PATH, {"metadata": {"name": NODE}})
    mps = SimulatedMps(tmp_path / "mps", node_name=NODE)
    running = start_agent(kube, mps, plugin_dir)
    try:
        conn = kubelet.next_connection()
        assert health_by_gpu(conn) == {G0: {"Healthy"}, G1: {"Healthy"}}
        eventually(lambda: NODE_REGISTER in kube.annotations(NODE_PATH), timeout_s=WAIT_S)
        assert [(d.mode, d.count, d.health) for d in registered(kube)] == [("mps", 10, True)] * 2
        assert mps.daemons() == {G0, G1}

        path = kube.add_pod(make_pod("p", NODE, devices=[[(G1, 4000, 25)]]))
        reply = conn.allocate([f"{G1}-0"])
        assert dict(reply.envs) == {
            "NVIDIA_VISIBLE_DEVICES": G1,
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps/0",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4000M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        }
        assert [(m.container_path, m.host_path, m.read_only) for m in reply.mounts] == [
            ("/tmp/nvidia-mps/0", str(tmp_path / "mps" / G1 / "pipe"), False)
        ]
        assert kube.annotations(path)[BIND_PHASE] == "success"

        # G1's daemon dies and cannot be restarted: unhealthy to the kubelet and scheduler.
        faults = tmp_path / "mps" / "faults"
        faults.mkdir()
        (faults / f"{G1}.fail_start").touch()
        (faults / f"{G1}.crash").touch()
        assert health_by_gpu(conn) == {G0: {"Healthy"}, G1: {"Unhealthy"}}
        eventually(lambda: [d.health for d in registered(kube)] == [True, False], timeout_s=WAIT_S)
        kube.add_pod(make_pod("q", NODE, devices=[[(G1, 1000, 0)]]))
        with pytest.raises(grpc.RpcError) as err:
            conn.allocate([f"{G1}-1"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"MPS control daemon of GPU {G1} is down" in str(err.value.details())

        (faults / f"{G1}.fail_start").unlink()
        assert health_by_gpu(conn) == {G0: {"Healthy"}, G1: {"Healthy"}}
        eventually(lambda: [d.health for d in registered(kube)] == [True, True], timeout_s=WAIT_S)
        assert dict(conn.allocate([f"{G1}-1"]).envs)["NVIDIA_VISIBLE_DEVICES"] == G1
    finally:
        running.close()
    starts = mps.starts(G0), mps.starts(G1)
    assert starts == (1, 2)
    assert mps.daemons() == {G0, G1}  # the agent's stop leaves its daemons serving

    # A restarted agent (a new process: new backend object, same MPS root) adopts them.
    again = SimulatedMps(tmp_path / "mps", node_name=NODE)
    running = start_agent(kube, again, plugin_dir)
    try:
        assert running.agent.mps is not None
        assert running.agent.mps.health() == {G0: True, G1: True}
    finally:
        running.close()
    assert (again.starts(G0), again.starts(G1)) == starts


def test_a_node_no_longer_in_mps_mode_stops_the_daemons_left_running(
    plugin_dir: Path, kubelet: FakeKubelet, tmp_path: Path
) -> None:
    left = SimulatedMps(tmp_path / "mps", node_name=NODE)
    left.start(G0)
    left.start(G1)
    kube = FakeKube()
    kube.put(NODE_PATH, {"metadata": {"name": NODE}})
    mps = SimulatedMps(tmp_path / "mps", node_name=NODE)
    running = start_agent(kube, mps, plugin_dir, mode="hami-core")
    try:
        assert mps.daemons() == frozenset()  # stopped before the agent served
    finally:
        running.close()
    assert SimulatedMps(tmp_path / "mps").daemons() == frozenset()
