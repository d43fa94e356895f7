"""Allocate end to end against a strict simulated GPU and an in-memory apiserver double."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.errors import InvalidAnnotationError, TemporaryError
from api.hami.catalog import find_model
from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import decode_mig_allocations
from api.hami.keys import BIND_PHASE, DEVICES_TO_ALLOCATE, MIG_ALLOCATIONS, VGPU_NODE_LABEL
from api.hami.register import Placement
from api.kube.errors import ServerError
from node_agent.allocator import HOOK_DIR, AllocationRefusedError, Allocator, HostDirs
from node_agent.deviceplugin.ids import InvalidDeviceIdError, prefer_spread
from node_agent.deviceplugin.types import Mount
from node_agent.mig_manager import MigAllocationError, MigManager
from node_agent.nvml.simulated import SimulatedNvml
from node_agent.pod_matching import AmbiguousPodError, NoMatchingPodError
from tests.node_agent_fakes import FakeKube, make_pod, mig_alloc, simulated_gpus

NODE = "node-a"
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
A100 = "A100-PCIE-40GB"


@pytest.fixture
def backend() -> Iterator[SimulatedNvml]:
    yield from simulated_gpus(G0, G1, model=A100)


def allocator(
    kube: FakeKube, backend: SimulatedNvml, mode: str = "hami-core", scaling: float | None = None
) -> tuple[Allocator, MigManager]:
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, mode, None, scaling),))  # type: ignore[arg-type]
    mig = MigManager(backend, node_name=NODE)
    return Allocator(NODE, kube, backend, mig, cfg, cache_name=lambda: "fixed"), mig


def gis(backend: SimulatedNvml, index: int = 0) -> list[Placement]:
    return sorted(g.placement for g in backend.gpu_instances(index))


def profile_id(name: str) -> int:
    fact = find_model(A100).profile(name)
    assert fact is not None
    return fact.profile_id


# hami-core ------------------------------------------------------------------------------


def test_hami_core_envs_mounts_and_patch(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 3000, 30), (G1, 2000, 20)]]))
    rv = kube.objects[path]["metadata"]["resourceVersion"]
    alloc, _ = allocator(kube, backend)
    [out] = alloc.allocate([[f"{G1}-2", f"{G0}-7"]])
    assert dict(out.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{G0},{G1}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "2000m",
        "CUDA_DEVICE_SM_LIMIT": "30",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{HOOK_DIR}/fixed.cache",
    }
    assert out.mounts == (
        Mount("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", True),
        Mount("/usr/local/vgpu", "/usr/local/vgpu/containers/uid-p_c0", False),
        Mount("/tmp/vgpulock", "/tmp/vgpulock", False),
        Mount("/etc/ld.so.preload", "/usr/local/vgpu/ld.so.preload", True),
    )
    ann = kube.annotations(path)
    assert ann[DEVICES_TO_ALLOCATE] == ";"
    assert ann[BIND_PHASE] == "success"
    assert kube.patches[-1][2] == rv  # resourceVersion precondition


def test_control_disabled_skips_preload_and_scaling_oversubscribes(
    backend: SimulatedNvml,
) -> None:
    kube = FakeKube()
    ctr = {"name": "c", "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]}
    kube.add_pod(make_pod("p", devices=[[(G0, 50000, 30)]], containers=[ctr]))
    alloc, _ = allocator(kube, backend, scaling=2.0)
    [out] = alloc.allocate([[f"{G0}-0"]])
    assert "/etc/ld.so.preload" not in {m.container_path for m in out.mounts}
    assert out.envs["CUDA_OVERSUBSCRIBE"] == "true"


@pytest.mark.parametrize(
    ("values", "preloaded"),
    [
        (["true"], False),
        (["1"], False),
        (["t"], False),
        (["TRUE"], False),
        (["false"], True),
        (["yes"], True),  # not a Go bool: passed over, as HAMi does
        (["tRuE"], True),
        (["false", "true"], False),  # a later true entry still counts
        ([], True),
    ],
)
def test_control_is_disabled_as_gos_parsebool_reads_the_env(
    backend: SimulatedNvml, values: list[str], preloaded: bool
) -> None:
    kube = FakeKube()
    env = [{"name": "CUDA_DISABLE_CONTROL", "value": v} for v in values]
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]], containers=[{"name": "c", "env": env}]))
    alloc, _ = allocator(kube, backend)
    [out] = alloc.allocate([[f"{G0}-0"]])
    assert ("/etc/ld.so.preload" in {m.container_path for m in out.mounts}) is preloaded


@pytest.mark.parametrize(
    ("settings", "node_level", "limits", "expected"),
    [
        ({}, None, {}, {}),
        ({"gpu_core_policy": "force"}, None, {}, {"GPU_CORE_UTILIZATION_POLICY": "force"}),
        (
            {"gpu_core_policy": "force", "disable_core_limit": True},
            None,
            {},
            {"GPU_CORE_UTILIZATION_POLICY": "disable"},
        ),
        ({"lib_cuda_log_level": "1"}, None, {}, {"LIBCUDA_LOG_LEVEL": "1"}),
        ({"lib_cuda_log_level": "1"}, "4", {}, {"LIBCUDA_LOG_LEVEL": "4"}),
        ({}, None, {"nvidia.com/priority": "1"}, {"CUDA_TASK_PRIORITY": "1"}),
        (
            {"resource_priority_name": "example.com/prio"},
            None,
            {"example.com/prio": 0, "nvidia.com/priority": 1},
            {"CUDA_TASK_PRIORITY": "0"},
        ),
    ],
)
def test_hami_core_settings_from_the_device_config(
    backend: SimulatedNvml,
    settings: dict[str, Any],
    node_level: str | None,
    limits: dict[str, Any],
    expected: dict[str, str],
) -> None:
    kube = FakeKube()
    ctr = {"name": "c", "resources": {"limits": limits}}
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 30)]], containers=[ctr]))
    node = NodeConfig(NODE, "hami-core", lib_cuda_log_level=node_level)  # type: ignore[arg-type]
    cfg = DeviceConfig(nodeconfig=(node,), **settings)
    alloc = Allocator(NODE, kube, backend, None, cfg, cache_name=lambda: "fixed")
    [out] = alloc.allocate([[f"{G0}-0"]])
    keys = ("GPU_CORE_UTILIZATION_POLICY", "LIBCUDA_LOG_LEVEL", "CUDA_TASK_PRIORITY")
    assert {k: v for k, v in out.envs.items() if k in keys} == expected


def test_containers_allocate_in_order_and_success_comes_last(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(
        make_pod(
            "p",
            devices=[[(G0, 1000, 10)], [], [(G1, 1000, 10)]],
            containers=[{"name": n} for n in "xyz"],
        )
    )
    alloc, _ = allocator(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    ann = kube.annotations(path)
    assert ann[DEVICES_TO_ALLOCATE] == f";;{G1},NVIDIA,1000,10:;"
    assert ann[BIND_PHASE] == "allocating"
    [out] = alloc.allocate([[f"{G1}-0"]])
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == G1
    assert kube.annotations(path)[BIND_PHASE] == "success"


def test_conflict_rereads_and_keeps_the_other_writers_change(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    kube.before_patch = lambda p: kube.merge_patch(p, {"metadata": {"labels": {"x": "y"}}})
    alloc, _ = allocator(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "success"
    assert kube.objects[path]["metadata"]["labels"] == {"x": "y", VGPU_NODE_LABEL: NODE}
    assert [p[2] is not None for p in kube.patches].count(True) == 2  # 409, then success


def test_node_label_is_added_when_missing_and_left_when_present(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    bare = kube.add_pod(make_pod("bare", devices=[[(G0, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    assert kube.objects[bare]["metadata"]["labels"][VGPU_NODE_LABEL] == NODE
    labelled = make_pod("labelled", devices=[[(G1, 1000, 10)]])
    labelled["metadata"]["labels"] = {VGPU_NODE_LABEL: NODE}
    kube.add_pod(labelled)
    alloc.allocate([[f"{G1}-0"]])
    assert "labels" not in kube.patches[-1][1]["metadata"]


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _preparing(kube: FakeKube, backend: SimulatedNvml, hook: Path, lock: Path) -> Allocator:
    """A hami-core node's allocator that prepares the host dirs under ``hook`` and ``lock``."""
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "hami-core"),))
    mig = MigManager(backend, node_name=NODE)
    return Allocator(
        NODE, kube, backend, mig, cfg, host_hook_dir=str(hook), host_dirs=HostDirs(str(lock))
    )


def test_host_dirs_are_made_world_writable_before_allocate_answers(
    backend: SimulatedNvml, tmp_path: Path, strict_umask: None
) -> None:
    """As HAMi's: the container's cache directory and the lock directory exist, 0777 under
    any umask, when the kubelet mounts them (a container of any user writes there)."""
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    lock = tmp_path / "vgpulock"
    alloc = _preparing(kube, backend, tmp_path / "usr-local", lock)
    [out] = alloc.allocate([[f"{G0}-0"]])
    container_dir = next(m.host_path for m in out.mounts if m.container_path == HOOK_DIR)
    for path in (Path(container_dir), lock):
        assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o777, path


def test_a_host_dir_that_cannot_be_made_fails_the_pod_naming_it(
    backend: SimulatedNvml, tmp_path: Path
) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    (tmp_path / "file").write_text("")
    alloc = _preparing(kube, backend, tmp_path, tmp_path / "file" / "vgpulock")
    with pytest.raises(AllocationRefusedError, match="cannot prepare the host directories"):
        alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_no_node_label_where_the_node_name_is_too_long_for_one(backend: SimulatedNvml) -> None:
    """A node name over 63 characters is no label value: the API server would refuse the
    whole patch, and the pod would never get its devices."""
    long_name = "gpu-node-" + "x" * 60
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", long_name, devices=[[(G0, 1000, 10)]]))
    cfg = DeviceConfig(nodeconfig=(NodeConfig(long_name, "hami-core"),))
    mig = MigManager(backend, node_name=long_name)
    alloc = Allocator(long_name, kube, backend, mig, cfg, cache_name=lambda: "fixed")
    alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "success"
    assert VGPU_NODE_LABEL not in (kube.objects[path]["metadata"].get("labels") or {})


def test_legacy_mig_slot_is_refused_with_what_to_do(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    legacy = f"{G0}[1-1],NVIDIA,19968,28:;"
    path = kube.add_pod(
        make_pod(
            "old",
            devices=[[(G0, 19968, 28)]],
            extra_annotations={DEVICES_TO_ALLOCATE: legacy},
        )
    )
    alloc, _ = allocator(kube, backend, mode="mig")
    with pytest.raises(AllocationRefusedError, match=r"\[1-1\] is a MIG slot of HAMi's <= v2.9"):
        alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "failed"
    assert gis(backend) == []


def test_gpu_of_another_node_is_refused_and_marked_failed(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    other = "GPU-99999999-9999-9999-9999-999999999999"
    path = kube.add_pod(make_pod("p", devices=[[(other, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    with pytest.raises(AllocationRefusedError, match="not on node"):
        alloc.allocate([[f"{other}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_memory_above_the_card_is_refused(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 90000, 10)]]))
    alloc, _ = allocator(kube, backend)
    with pytest.raises(AllocationRefusedError, match="MiB"):
        alloc.allocate([[f"{G0}-0"]])


def test_no_pod_waits_for_that_many_devices(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    with pytest.raises(NoMatchingPodError):
        alloc.allocate([[f"{G0}-0", f"{G1}-0"]])


def test_unsteered_ids_still_get_the_only_pods_own_devices(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    [out] = alloc.allocate([[f"{G1}-4"]])  # the kubelet chose a slot of the other GPU
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == G0
    assert out.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    assert kube.annotations(path)[BIND_PHASE] == "success"


def test_same_count_pods_on_different_gpus_are_ambiguous(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    p = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    q = kube.add_pod(make_pod("q", devices=[[(G1, 2000, 10)]]))
    alloc, _ = allocator(kube, backend)
    with pytest.raises(AmbiguousPodError, match="default/p, default/q"):
        alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(p)[BIND_PHASE] == kube.annotations(q)[BIND_PHASE] == "allocating"


# GetPreferredAllocation -----------------------------------------------------------------

SLOTS = [f"{g}-{s}" for g in (G0, G1) for s in range(4)]


def test_preferred_steers_to_the_unique_candidates_gpus(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("one", devices=[[(G1, 1000, 10)]]))
    kube.add_pod(make_pod("two", devices=[[(G1, 1000, 10), (G1, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    # Spread would pick G0 first; steering names the GPU of the only pod asking that count.
    assert alloc.preferred(SLOTS, [], 1) == [f"{G1}-0"]
    assert alloc.preferred(SLOTS, [], 2) == [f"{G1}-0", f"{G1}-1"]
    assert alloc.preferred([s for s in SLOTS if s != f"{G1}-0"], [], 1) == [f"{G1}-1"]
    # The ids it steered to are then matched to that pod and get its devices.
    [out] = alloc.allocate([alloc.preferred(SLOTS, [], 2)])
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == f"{G1},{G1}"


def test_preferred_falls_back_to_spread_without_a_unique_candidate(
    backend: SimulatedNvml,
) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G1, 1000, 10)]]))
    kube.add_pod(make_pod("q", devices=[[(G1, 3000, 10)]]))
    alloc, _ = allocator(kube, backend)
    assert alloc.preferred(SLOTS, [], 1) == prefer_spread(SLOTS, [], 1) == [f"{G0}-0"]
    assert alloc.preferred(SLOTS, [], 2) == [f"{G0}-0", f"{G1}-0"]  # nobody asks 2


def test_preferred_falls_back_to_spread_when_pods_cannot_be_listed(
    backend: SimulatedNvml,
) -> None:
    class Down(FakeKube):
        def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]:
            raise ServerError("GET", path, 503, "ServiceUnavailable", "down")

    kube = Down()
    kube.add_pod(make_pod("p", devices=[[(G1, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    assert alloc.preferred(SLOTS, [], 1) == [f"{G0}-0"]


def test_preferred_rejects_malformed_ids(backend: SimulatedNvml) -> None:
    alloc, _ = allocator(FakeKube(), backend)
    with pytest.raises(InvalidDeviceIdError):
        alloc.preferred(["nope"], [], 1)


# MIG ------------------------------------------------------------------------------------


def test_mig_creates_exact_instance_and_records_identity(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(
        make_pod("m", devices=[[(G0, 9984, 29)]], mig=[mig_alloc(0, 0, G0, "2g.10gb", 2, 2)])
    )
    alloc, mig = allocator(kube, backend, mode="mig")
    [out] = alloc.allocate([[f"{G0}-0"]])
    assert gis(backend) == [Placement(2, 2)]
    ann = kube.annotations(path)
    [rec] = decode_mig_allocations(ann[MIG_ALLOCATIONS])
    assert rec.runtime is not None
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": rec.runtime.mig_uuid}
    assert out.mounts == ()
    assert ann[DEVICES_TO_ALLOCATE] == ";"
    assert ann[BIND_PHASE] == "success"
    # one patch carried both annotations, under a precondition
    _, patch, rv = kube.patches[-1]
    assert set(patch["metadata"]["annotations"]) == {
        MIG_ALLOCATIONS,
        DEVICES_TO_ALLOCATE,
        BIND_PHASE,
    }
    assert rv is not None
    assert len(mig.instances()) == 1


def test_repeated_allocate_after_a_lost_patch_returns_the_same_instance(
    backend: SimulatedNvml,
) -> None:
    kube = FakeKube()
    path = kube.add_pod(
        make_pod("m", devices=[[(G0, 9984, 29)]], mig=[mig_alloc(0, 0, G0, "2g.10gb", 4, 2)])
    )
    alloc, _ = allocator(kube, backend, mode="mig")
    kube.fail_patch.append(ServerError("PATCH", path, 503, "ServiceUnavailable", "busy"))
    with pytest.raises(TemporaryError):
        alloc.allocate([[f"{G0}-0"]])
    assert kube.annotations(path)[BIND_PHASE] == "allocating"  # left for the retry
    first = backend.gpu_instances(0)
    [out] = alloc.allocate([[f"{G0}-0"]])
    assert backend.gpu_instances(0) == first
    [rec] = decode_mig_allocations(kube.annotations(path)[MIG_ALLOCATIONS])
    assert rec.runtime is not None and out.envs["NVIDIA_VISIBLE_DEVICES"] == rec.runtime.mig_uuid


def test_multi_device_failure_rolls_back_and_marks_failed(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    # Someone else's 3g instance covers [4,8): the second reservation cannot be realized.
    backend.create_gpu_instance_with_placement(0, profile_id("3g.20gb"), Placement(4, 4))
    path = kube.add_pod(
        make_pod(
            "m",
            devices=[[(G0, 9984, 29), (G0, 9984, 29)]],
            mig=[mig_alloc(0, 0, G0, "2g.10gb", 0, 2), mig_alloc(0, 1, G0, "2g.10gb", 4, 2)],
        )
    )
    alloc, mig = allocator(kube, backend, mode="mig")
    with pytest.raises(MigAllocationError):
        alloc.allocate([[f"{G0}-0", f"{G0}-1"]])
    assert gis(backend) == [Placement(4, 4)]  # only the foreign one; nothing leaked
    assert mig.instances() == {}
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_reservation_not_matching_the_entry_changes_no_hardware(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(
        make_pod("m", devices=[[(G0, 9984, 29)]], mig=[mig_alloc(0, 0, G1, "2g.10gb", 0, 2)])
    )
    alloc, _ = allocator(kube, backend, mode="mig")
    with pytest.raises(AllocationRefusedError, match="reserves GPUs"):
        alloc.allocate([[f"{G0}-0"]])
    assert gis(backend, 0) == [] and gis(backend, 1) == []
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_malformed_mig_record_changes_no_hardware(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(
        make_pod("m", devices=[[(G0, 9984, 29)]], extra_annotations={MIG_ALLOCATIONS: "[{"})
    )
    alloc, _ = allocator(kube, backend, mode="mig")
    with pytest.raises(InvalidAnnotationError):
        alloc.allocate([[f"{G0}-0"]])
    assert gis(backend) == []
    assert kube.annotations(path)[BIND_PHASE] == "failed"


def test_mig_node_refuses_a_container_without_reservation(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    alloc, _ = allocator(kube, backend, mode="mig")
    with pytest.raises(AllocationRefusedError, match="runs MIG"):
        alloc.allocate([[f"{G0}-0"]])


def test_allocate_next_derives_kubelet_ids(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    path = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10), (G1, 1000, 10)]]))
    alloc, _ = allocator(kube, backend)
    out = alloc.allocate_next("default", "p")
    assert out is not None and out.envs["NVIDIA_VISIBLE_DEVICES"] == f"{G0},{G1}"
    assert alloc.allocate_next("default", "p") is None
    assert kube.annotations(path)[BIND_PHASE] == "success"
