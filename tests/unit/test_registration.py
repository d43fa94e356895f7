"""The register annotation: published on change only, health changes show, handshake."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.keys import NODE_REGISTER
from api.hami.register import decode
from node_agent.mps import MpsDaemons, SimulatedMps
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


# mps ------------------------------------------------------------------------------------


def mps_registrar(
    kube: FakeKube, backend: SimulatedNvml, cfg: DeviceConfig, mps: MpsDaemons | None
) -> Registrar:
    return Registrar(
        NODE, kube, backend, cfg, now=lambda: datetime(2024, 5, 6, tzinfo=UTC), mps=mps
    )


@pytest.mark.parametrize(
    ("cfg", "count"),
    [
        (DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps", 100),)), 48),
        (DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps", 10),)), 10),
        (DeviceConfig(device_split_count=100, nodeconfig=(NodeConfig(NODE, "mps"),)), 48),
        (DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps"),)), 10),  # the default split
    ],
)
def test_mps_gpus_register_at_most_the_client_limit_of_slots(
    backend: SimulatedNvml, cfg: DeviceConfig, count: int
) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    mps = MpsDaemons(SimulatedMps(node_name=NODE), node_name=NODE)
    r = mps_registrar(kube, backend, cfg, mps)
    mps.sync(r.mps_gpus())
    r.sync()
    devices = decode(kube.annotations(PATH)[NODE_REGISTER])
    assert [(d.mode, d.count, d.health, d.devmem, d.devcore) for d in devices] == [
        ("mps", count, True, 40960, 100)
    ] * 2
    assert '"mode":"mps"' in kube.annotations(PATH)[NODE_REGISTER]


def test_mps_memory_and_core_scaling_apply_as_for_hami_core(backend: SimulatedNvml) -> None:
    node = NodeConfig(NODE, "mps", device_memory_scaling=1.5, device_core_scaling=2.0)
    cfg = DeviceConfig(nodeconfig=(node,))
    mps = MpsDaemons(SimulatedMps(node_name=NODE), node_name=NODE)
    devices = mps_registrar(FakeKube(), backend, cfg, mps).devices()
    assert [(d.devmem, d.devcore) for d in devices] == [(61440, 200)] * 2


def test_an_mps_gpu_is_unhealthy_while_its_daemon_is_down_and_republished(
    backend: SimulatedNvml,
) -> None:
    kube = FakeKube()
    kube.put(PATH, {"metadata": {"name": NODE}})
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps"),))
    sim = SimulatedMps(node_name=NODE)
    mps = MpsDaemons(sim, node_name=NODE)
    r = mps_registrar(kube, backend, cfg, mps)
    gpus = r.mps_gpus()
    assert gpus == (backend.device(0).uuid, backend.device(1).uuid)
    mps.sync(gpus)
    r.sync()
    sim.crash(gpus[1])
    mps.sync(gpus)
    assert r.sync()
    assert [d.health for d in decode(kube.annotations(PATH)[NODE_REGISTER])] == [True, False]
    mps.sync(gpus)  # restarted
    assert r.sync()
    assert [d.health for d in decode(kube.annotations(PATH)[NODE_REGISTER])] == [True, True]


def test_an_mps_node_without_a_daemon_manager_vouches_for_no_gpu(backend: SimulatedNvml) -> None:
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps"),))
    assert [d.health for d in mps_registrar(FakeKube(), backend, cfg, None).devices()] == [
        False,
        False,
    ]
    assert registrar(FakeKube(), backend, mode="hami-core").mps_gpus() == ()
