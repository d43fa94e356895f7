"""``NodeAgent.run`` start-up and stop against an in-memory apiserver and a fake kubelet.

The end-to-end flows (Allocate, reclaim, restart adoption) run against the real apiserver
in ``tests/integration/test_node_agent_run.py``; here: what the agent does when the API
cannot be read at start (touch nothing) versus when it can (clean idle MIG GPUs), and the
teardown after a failed start.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.keys import NODE_REGISTER
from api.hami.register import Placement
from api.kube.errors import ServerError
from node_agent.agent import NodeAgent
from node_agent.nvml.errors import NvmlUnavailable, Uninitialized
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from tests.fake_kubelet import FakeKubelet
from tests.node_agent_fakes import FakeKube

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

NODE = "node-a"
A100 = "A100-PCIE-40GB"
CONFIG = DeviceConfig(nodeconfig=(NodeConfig(NODE, "mig"),))
WAIT_S = 10.0


class DownKube(FakeKube):
    """Nodes readable and patchable; pods cannot be listed."""

    def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]:
        raise ServerError("GET", path, 503, "ServiceUnavailable", "etcd is down")


def backend_with_a_stray_instance(state: Path) -> SimulatedNvml:
    """An idle MIG GPU holding an instance no pod records (left by a previous agent)."""
    b = SimulatedNvml([SimulatedGpuSpec(A100)], state, node_name=NODE)
    b.init()
    gi = b.create_gpu_instance_with_placement(0, 9, Placement(0, 4))  # 3g.20gb
    b.create_compute_instance(0, gi.id, 2)
    b.shutdown()
    return SimulatedNvml([SimulatedGpuSpec(A100)], state, node_name=NODE)


def run_briefly(agent: NodeAgent) -> None:
    """Start the agent, wait until it serves, let a few loop passes run, stop it."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            agent.run(stop)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    try:
        assert agent.ready.wait(WAIT_S) or errors, "agent not ready"
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(WAIT_S)
    assert not t.is_alive()
    assert errors == []


def make_agent(kube: FakeKube, backend: SimulatedNvml, plugin_dir: Path) -> NodeAgent:
    kube.put(f"/api/v1/nodes/{NODE}", {"metadata": {"name": NODE}})
    return NodeAgent(
        NODE,
        kube,
        backend,
        CONFIG,
        plugin_dir=plugin_dir,
        reconcile_interval_s=0.1,
        health_interval_s=0.1,
        plugin_watch_interval_s=0.05,
    )


def stray_gis(backend: SimulatedNvml) -> list[dict[str, Any]]:
    gis: list[dict[str, Any]] = backend.state_snapshot()["gpus"][0]["gpuInstances"]
    return gis


def test_unreadable_pods_at_start_touch_no_instance(
    plugin_dir: Path, kubelet: FakeKubelet, tmp_path: Path
) -> None:
    backend = backend_with_a_stray_instance(tmp_path / "nvml.json")
    kube = DownKube()
    agent = make_agent(kube, backend, plugin_dir)
    run_briefly(agent)
    assert len(stray_gis(backend)) == 1  # neither adoption nor reconcile destroyed it
    assert agent.mig_manager is not None and agent.mig_manager.instances() == {}
    assert NODE_REGISTER in kube.annotations(f"/api/v1/nodes/{NODE}")  # still registered
    assert not agent.socket_path.exists()
    with pytest.raises(Uninitialized):
        backend.device_count()


def test_readable_pods_at_start_clean_an_idle_mig_gpu(
    plugin_dir: Path, kubelet: FakeKubelet, tmp_path: Path
) -> None:
    backend = backend_with_a_stray_instance(tmp_path / "nvml.json")
    agent = make_agent(FakeKube(), backend, plugin_dir)
    run_briefly(agent)
    assert stray_gis(backend) == []


def test_failed_start_tears_down_and_raises(plugin_dir: Path) -> None:
    backend = SimulatedNvml([SimulatedGpuSpec(A100)], None, node_name=NODE)
    backend.fail_next("device_count", NvmlUnavailable("count GPUs", "driver gone"))
    kube = FakeKube()
    kube.put(f"/api/v1/nodes/{NODE}", {"metadata": {"name": NODE}})
    agent = NodeAgent(NODE, kube, backend, DeviceConfig(), plugin_dir=plugin_dir)  # hami-core
    errors: list[BaseException] = []
    stop = threading.Event()

    def target() -> None:
        try:
            agent.run(stop)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(WAIT_S)
    if t.is_alive():
        stop.set()
        t.join(WAIT_S)
        pytest.fail("run did not fail at start-up")
    assert [type(e) for e in errors] == [NvmlUnavailable]
    assert not agent.ready.is_set()
    assert not agent.socket_path.exists()
    with pytest.raises(Uninitialized):
        backend.device_count()
