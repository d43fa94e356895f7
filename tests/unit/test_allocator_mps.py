"""Allocate on MPS GPUs: the daemons' pipe directories and MPS's limits, no HAMi-core."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.errors import TemporaryError
from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import MigAllocation
from api.hami.keys import BIND_PHASE, DEVICES_TO_ALLOCATE
from node_agent.allocator import AllocationRefusedError, Allocator
from node_agent.deviceplugin.types import Mount
from node_agent.mps import MpsDaemonDownError, MpsDaemons, SimulatedMps
from node_agent.nvml.simulated import SimulatedNvml
from tests.node_agent_fakes import FakeKube, make_pod, mig_alloc, simulated_gpus

NODE = "node-a"
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
A100 = "A100-PCIE-40GB"  # 40960 MiB


@pytest.fixture
def backend() -> Iterator[SimulatedNvml]:
    yield from simulated_gpus(G0, G1, model=A100)


@pytest.fixture
def daemons(tmp_path: Path) -> tuple[MpsDaemons, SimulatedMps]:
    sim = SimulatedMps(tmp_path / "mps", node_name=NODE)
    mps = MpsDaemons(sim, node_name=NODE)
    mps.sync([G0, G1])
    return mps, sim


def allocator(
    kube: FakeKube,
    backend: SimulatedNvml,
    mps: MpsDaemons | None,
    *,
    scaling: float | None = None,
) -> Allocator:
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "mps", None, scaling),))
    return Allocator(NODE, kube, backend, None, cfg, mps=mps)


@pytest.mark.parametrize(
    ("cores", "thread_env"),
    [(0, {}), (30, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}), (100, {})],
)
def test_one_device_gets_its_daemon_and_limits(
    backend: SimulatedNvml,
    daemons: tuple[MpsDaemons, SimulatedMps],
    tmp_path: Path,
    cores: int,
    thread_env: dict[str, str],
) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G1, 3000, cores)]]))
    [out] = allocator(kube, backend, daemons[0]).allocate([[f"{G1}-4"]])
    assert dict(out.envs) == {
        "NVIDIA_VISIBLE_DEVICES": G1,
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps/0",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3000M",
        **thread_env,
    }
    assert out.mounts == (Mount("/tmp/nvidia-mps/0", f"{tmp_path}/mps/{G1}/pipe", False),)
    ann = kube.annotations(path)
    assert (ann[DEVICES_TO_ALLOCATE], ann[BIND_PHASE]) == (";", "success")


@pytest.mark.parametrize(
    ("cores", "thread_env"),
    [(0, {}), (30, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}), (100, {})],
)
def test_two_devices_get_one_pipe_directory_each_in_visible_order(
    backend: SimulatedNvml,
    daemons: tuple[MpsDaemons, SimulatedMps],
    tmp_path: Path,
    cores: int,
    thread_env: dict[str, str],
) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G1, 5000, cores), (G0, 2048, cores)]]))
    [out] = allocator(kube, backend, daemons[0]).allocate([[f"{G0}-0", f"{G1}-0"]])
    assert dict(out.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{G1},{G0}",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps/0",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5000M,1=2048M",
        **thread_env,
    }
    assert out.mounts == (
        Mount("/tmp/nvidia-mps/0", f"{tmp_path}/mps/{G1}/pipe", False),
        Mount("/tmp/nvidia-mps/1", f"{tmp_path}/mps/{G0}/pipe", False),
    )
    assert not any("vgpu" in m.host_path or "preload" in m.container_path for m in out.mounts)


def test_a_daemon_down_refuses_for_now_and_leaves_the_pod_allocating(
    backend: SimulatedNvml, daemons: tuple[MpsDaemons, SimulatedMps]
) -> None:
    mps, sim = daemons
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 0), (G1, 1000, 0)]]))
    alloc = allocator(kube, backend, mps)
    sim.crash(G1)
    mps.sync([G0, G1])
    with pytest.raises(MpsDaemonDownError, match=f"GPU {G1} is down") as err:
        alloc.allocate([[f"{G0}-0", f"{G1}-0"]])
    assert isinstance(err.value, TemporaryError)  # the device plugin answers UNAVAILABLE
    assert kube.annotations(path)[BIND_PHASE] == "allocating"
    assert kube.patches == []
    mps.sync([G0, G1])  # restarted
    [out] = alloc.allocate([[f"{G0}-0", f"{G1}-0"]])
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == f"{G0},{G1}"
    assert kube.annotations(path)[BIND_PHASE] == "success"


def test_memory_is_checked_against_the_scaled_card_as_registered(
    backend: SimulatedNvml, daemons: tuple[MpsDaemons, SimulatedMps]
) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("ok", devices=[[(G0, 60000, 0)]]))
    allocator(kube, backend, daemons[0], scaling=1.5).allocate([[f"{G0}-0"]])
    kube = FakeKube()
    path = kube.add_pod(make_pod("big", devices=[[(G0, 60000, 0)]]))
    with pytest.raises(AllocationRefusedError, match="which has 40960 MiB"):
        allocator(kube, backend, daemons[0]).allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "failed"


@pytest.mark.parametrize(
    ("devices", "mig", "words"),
    [
        ([("GPU-elsewhere", 1000, 0)], [], "is not on node"),
        ([(G0, 1000, 0), (G0, 1000, 0)], [], "lists a GPU twice"),
        ([(G0, 9984, 29)], [mig_alloc(0, 0, G0, "2g.10gb", 0, 2)], "runs MPS but the container"),
    ],
)
def test_entries_an_mps_node_cannot_serve_are_refused_and_marked_failed(
    backend: SimulatedNvml,
    daemons: tuple[MpsDaemons, SimulatedMps],
    devices: list[tuple[str, int, int]],
    mig: list[MigAllocation],
    words: str,
) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[devices], mig=mig))
    ids = [f"{G1}-{i}" for i in range(len(devices))]
    with pytest.raises(AllocationRefusedError, match=words):
        allocator(kube, backend, daemons[0]).allocate([ids])
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_an_mps_node_without_daemons_refuses(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 0)]]))
    with pytest.raises(AllocationRefusedError, match="no MPS daemons"):
        allocator(kube, backend, None).allocate([[f"{G0}-0"]])


def test_kwok_style_allocate_next_takes_the_mps_branch(
    backend: SimulatedNvml, daemons: tuple[MpsDaemons, SimulatedMps]
) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 50)], [(G1, 2000, 50)]]))
    alloc = allocator(kube, backend, daemons[0])
    first = alloc.allocate_next("default", "p")
    second = alloc.allocate_next("default", "p")
    assert first is not None and second is not None
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == G0
    assert second.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2000M"
    assert alloc.allocate_next("default", "p") is None
    assert kube.annotations(path)[BIND_PHASE] == "success"
