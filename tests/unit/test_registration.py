"""The register annotation: published on change only, health changes show, handshake."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.keys import NODE_REGISTER
from api.hami.register import decode
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from node_agent.registration import HANDSHAKE, Registrar
from tests.node_agent_fakes import FakeKube

NODE = "node-a"
PATH = f"/api/v1/nodes/{NODE}"


@pytest.fixture
def backend() -> Iterator[SimulatedNvml]:
    b = SimulatedNvml(
        [SimulatedGpuSpec("A100-PCIE-40GB"), SimulatedGpuSpec("A100-PCIE-40GB")],
        None,
        node_name=NODE,
    )
    b.init()
    yield b
    b.shutdown()


def registrar(kube: FakeKube, backend: SimulatedNvml, mode: str = "mig") -> Registrar:
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, mode, 7, None),))  # type: ignore[arg-type]
    return Registrar(
        NODE, kube, backend, cfg, now=lambda: datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)
    )


def test_first_sync_publishes_register_and_handshake(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    assert registrar(kube, backend).sync()
    ann = kube.annotations(PATH)
    devices = decode(ann[NODE_REGISTER])
    assert [d.count for d in devices] == [7, 7]
    assert all(d.mode == "mig" and d.mig_profiles for d in devices)
    assert ann[HANDSHAKE] == "Reported 2024-05-06T07:08:09Z"


def test_unchanged_node_is_not_patched(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    r = registrar(kube, backend)
    r.sync()
    assert not r.sync()
    assert len(kube.patches) == 1


def test_health_change_is_published(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    r = registrar(kube, backend, mode="hami-core")
    r.sync()
    backend.set_health(1, False)
    assert r.sync()
    assert [d.health for d in decode(kube.annotations(PATH)[NODE_REGISTER])] == [True, False]


def test_scheduler_handshake_request_is_answered(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    r = registrar(kube, backend)
    r.sync()
    kube.merge_patch(PATH, {"metadata": {"annotations": {HANDSHAKE: "Requesting_2024.05.06"}}})
    assert r.sync()
    assert kube.annotations(PATH)[HANDSHAKE].startswith("Reported ")
