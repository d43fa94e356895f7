"""PynvmlBackend: call sequencing and error mapping against a fake ``pynvml`` module.

The fake forwards to a SimulatedNvml and speaks pynvml's dialect (integer handles, ctypes
arrays filled through a count pointer, ``NVMLError(value)``), so the real backend runs
end to end against strict geometry without a GPU.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from api.hami.catalog import find_model
from api.hami.register import Placement, decode, encode
from node_agent.nvml import (
    InsufficientResources,
    InUse,
    InvalidArgument,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
    PynvmlBackend,
    SimulatedGpuSpec,
    SimulatedNvml,
    Uninitialized,
)
from node_agent.nvml.backend import COMPUTE_INSTANCE_PROFILE_SLICES
from node_agent.nvml.discovery import discover
from node_agent.nvml.errors import error_for_code
from node_agent.nvml.real import map_nvml_error

A100 = "NVIDIA A100-PCIE-40GB"
MIB = 1024 * 1024


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


class _Placement(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


_CODE = {
    InsufficientResources: 23,
    InUse: 19,
    NotFound: 6,
    NotSupported: 3,
    InvalidArgument: 2,
    Uninitialized: 1,
}


class FakePynvml:
    """Just enough of pynvml, backed by a SimulatedNvml; records every call."""

    NVMLError = FakeNVMLError
    c_nvmlGpuInstancePlacement_t = _Placement
    c_nvmlGpuInstance_t = ctypes.c_void_p
    c_nvmlComputeInstance_t = ctypes.c_void_p

    def __init__(self, sim: SimulatedNvml) -> None:
        self.sim = sim
        self.calls: list[str] = []
        self.hooks: dict[str, Callable[[], None]] = {}
        self._handles: dict[tuple[Any, ...], int] = {}
        self._objects: dict[int, tuple[Any, ...]] = {}

    def __getattr__(self, name: str) -> Any:
        impl = getattr(self, "_" + name, None)
        if impl is None or not name.startswith("nvml"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            self.calls.append(name)
            if name in self.hooks:
                self.hooks[name]()
            try:
                return impl(*args)
            except NvmlError as e:
                raise FakeNVMLError(_CODE.get(type(e), 999)) from e

        return call

    def handle(self, *key: Any) -> int:
        if key not in self._handles:
            self._handles[key] = len(self._handles) + 1
            self._objects[self._handles[key]] = key
        return self._handles[key]

    def obj(self, h: Any) -> tuple[Any, ...]:
        return self._objects[int(h)]

    # session and devices
    def _nvmlInit(self) -> None:
        self.sim.init()

    def _nvmlShutdown(self) -> None:
        self.sim.shutdown()

    def _nvmlDeviceGetCount(self) -> int:
        return self.sim.device_count()

    def _nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self.sim.device(i)
        return self.handle("gpu", i)

    def _nvmlDeviceGetName(self, h: int) -> bytes:
        return self.sim.device(self.obj(h)[1]).name.encode()  # old bindings return bytes

    def _nvmlDeviceGetUUID(self, h: int) -> str:
        kind, i, *ids = self.obj(h)
        return self.sim.mig_device_uuid(i, *ids) if kind == "mig" else self.sim.device(i).uuid

    def _nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        dev = self.sim.device(self.obj(h)[1])
        if not dev.healthy:
            raise FakeNVMLError(15)  # GPU is lost
        return SimpleNamespace(total=dev.memory_mib * MIB)

    def _nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        return self.sim.device(self.obj(h)[1]).numa_node

    def _nvmlDeviceGetAttributes(self, h: int) -> None:
        raise FakeNVMLError(3)  # only MIG device handles: the backend falls back

    def _nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        mode = self.sim.mig_mode(self.obj(h)[1])
        return [int(mode.current), int(mode.pending)]

    # GPU instances
    def _nvmlDeviceGetGpuInstanceProfileInfo(self, h: int, index: int) -> SimpleNamespace:
        info = self.sim.gpu_instance_profile_info(self.obj(h)[1], index)
        return SimpleNamespace(
            id=info.id,
            sliceCount=info.slice_count,
            instanceCount=info.instance_count,
            multiprocessorCount=info.multiprocessor_count,
            memorySizeMB=info.memory_mib,
            name=(info.name or "").encode(),
        )

    def _nvmlDeviceGetGpuInstancePossiblePlacements(
        self, h: int, profile_id: int, arr: Any, count: Any
    ) -> None:
        pls = self.sim.gpu_instance_possible_placements(self.obj(h)[1], profile_id)
        if count.contents.value < len(pls):
            raise FakeNVMLError(7)
        for k, p in enumerate(pls):
            arr[k].start, arr[k].size = p.start, p.size
        count.contents.value = len(pls)

    def _nvmlDeviceCreateGpuInstanceWithPlacement(self, h: int, profile_id: int, pl: Any) -> int:
        i = self.obj(h)[1]
        placement = Placement(pl.contents.start, pl.contents.size)
        gi = self.sim.create_gpu_instance_with_placement(i, profile_id, placement)
        return self.handle("gi", i, gi.id)

    def _nvmlGpuInstanceGetInfo(self, gi_h: int) -> SimpleNamespace:
        _, i, gi_id = self.obj(gi_h)
        gi = next(g for g in self.sim.gpu_instances(i) if g.id == gi_id)
        pl = SimpleNamespace(start=gi.placement.start, size=gi.placement.size)
        return SimpleNamespace(id=gi.id, profileId=gi.profile_id, placement=pl)

    def _nvmlDeviceGetGpuInstances(self, h: int, profile_id: int, arr: Any, count: Any) -> None:
        i = self.obj(h)[1]
        gis = self.sim.gpu_instances(i, profile_id)
        for k, gi in enumerate(gis):
            arr[k] = self.handle("gi", i, gi.id)
        count.contents.value = len(gis)

    def _nvmlDeviceGetGpuInstanceById(self, h: int, gi_id: int) -> int:
        i = self.obj(h)[1]
        if gi_id not in {g.id for g in self.sim.gpu_instances(i)}:
            raise FakeNVMLError(6)
        return self.handle("gi", i, gi_id)

    def _nvmlGpuInstanceDestroy(self, gi_h: int) -> None:
        _, i, gi_id = self.obj(gi_h)
        self.sim.destroy_gpu_instance(i, gi_id)

    # compute instances
    def _nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi_h: int, ci_index: int, engine: int
    ) -> SimpleNamespace:
        _, i, gi_id = self.obj(gi_h)
        gi = next(g for g in self.sim.gpu_instances(i) if g.id == gi_id)
        info = next(
            self.sim.gpu_instance_profile_info(i, x)
            for x in range(18)
            if x in {0, 1, 2, 3, 4, 7, 9}
            and self.sim.gpu_instance_profile_info(i, x).id == gi.profile_id
        )
        if engine != 0 or COMPUTE_INSTANCE_PROFILE_SLICES.get(ci_index, 99) > info.slice_count:
            raise FakeNVMLError(3)
        return SimpleNamespace(id=ci_index)

    def _nvmlGpuInstanceCreateComputeInstance(self, gi_h: int, profile_id: int) -> int:
        _, i, gi_id = self.obj(gi_h)
        ci = self.sim.create_compute_instance(i, gi_id, profile_id)
        return self.handle("ci", i, gi_id, ci.id)

    def _nvmlComputeInstanceGetInfo(self, ci_h: int) -> SimpleNamespace:
        _, i, gi_id, ci_id = self.obj(ci_h)
        ci = next(c for c in self.sim.compute_instances(i, gi_id) if c.id == ci_id)
        return SimpleNamespace(id=ci.id, profileId=ci.profile_id)

    def _nvmlGpuInstanceGetComputeInstances(
        self, gi_h: int, profile_id: int, arr: Any, count: Any
    ) -> None:
        _, i, gi_id = self.obj(gi_h)
        cis = [c for c in self.sim.compute_instances(i, gi_id) if c.profile_id == profile_id]
        for k, c in enumerate(cis):
            arr[k] = self.handle("ci", i, gi_id, c.id)
        count.contents.value = len(cis)

    def _nvmlGpuInstanceGetComputeInstanceById(self, gi_h: int, ci_id: int) -> int:
        _, i, gi_id = self.obj(gi_h)
        if ci_id not in {c.id for c in self.sim.compute_instances(i, gi_id)}:
            raise FakeNVMLError(6)
        return self.handle("ci", i, gi_id, ci_id)

    def _nvmlComputeInstanceDestroy(self, ci_h: int) -> None:
        _, i, gi_id, ci_id = self.obj(ci_h)
        self.sim.destroy_compute_instance(i, gi_id, ci_id)

    # MIG devices and processes
    def _mig_devices(self, i: int) -> list[tuple[int, int]]:
        return [
            (gi.id, ci.id)
            for gi in self.sim.gpu_instances(i)
            for ci in self.sim.compute_instances(i, gi.id)
        ]

    def _nvmlDeviceGetMaxMigDeviceCount(self, h: int) -> int:
        return 7

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, h: int, k: int) -> int:
        i = self.obj(h)[1]
        devices = self._mig_devices(i)
        if k >= len(devices):
            raise FakeNVMLError(6)
        return self.handle("mig", i, *devices[k])

    def _nvmlDeviceGetGpuInstanceId(self, mig: int) -> int:
        return int(self.obj(mig)[2])

    def _nvmlDeviceGetComputeInstanceId(self, mig: int) -> int:
        return int(self.obj(mig)[3])

    def _nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        kind, i, *_ = self.obj(h)
        if kind == "mig":
            return [SimpleNamespace(pid=4242)]  # also seen on the parent: reported once
        return [SimpleNamespace(pid=p) for p in self.sim.running_processes(i)]


@pytest.fixture
def fake() -> FakePynvml:
    return FakePynvml(SimulatedNvml([SimulatedGpuSpec(A100)], node_name="node-a"))


@pytest.fixture
def backend(fake: FakePynvml) -> Iterator[PynvmlBackend]:
    b = PynvmlBackend(fake)
    b.init()
    yield b
    b.shutdown()


def test_device_queries_decode_and_fall_back(backend: PynvmlBackend, fake: FakePynvml) -> None:
    assert backend.device_count() == 1
    dev = backend.device(0)
    assert (dev.name, dev.uuid, dev.memory_mib, dev.numa_node, dev.healthy) == (
        A100,
        fake.sim.device(0).uuid,
        40960,
        0,
        True,
    )
    assert dev.multiprocessor_count == 98  # attributes unsupported: the catalog's count
    assert tuple(backend.mig_mode(0)) == (True, True)
    info = backend.gpu_instance_profile_info(0, 1)
    assert (info.id, info.slice_count, info.memory_mib, info.name) == (14, 2, 9984, "MIG 2g.10gb")


def test_mig_lifecycle_through_pynvml(backend: PynvmlBackend, fake: FakePynvml) -> None:
    assert backend.gpu_instance_possible_placements(0, 14) == [
        Placement(0, 2),
        Placement(2, 2),
        Placement(4, 2),
    ]
    fake.calls.clear()
    gi = backend.create_gpu_instance_with_placement(0, 14, Placement(2, 2))
    assert (gi.id, gi.profile_id, gi.placement) == (4, 14, Placement(2, 2))
    assert fake.calls == [
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceGetInfo",
    ]
    ci = backend.create_compute_instance(0, gi.id, 1)
    assert (ci.id, ci.gi_id, ci.profile_id) == (0, 4, 1)
    other = backend.create_gpu_instance_with_placement(0, 19, Placement(0, 1))
    assert backend.gpu_instances(0) == [gi, other]  # by id
    assert backend.gpu_instances(0, 14) == [gi]
    assert backend.compute_instances(0, gi.id) == [ci]
    assert backend.mig_device_uuid(0, gi.id, ci.id) == fake.sim.mig_device_uuid(0, 4, 0)
    fake.sim.set_processes(0, [4242], gi_id=gi.id)
    assert backend.running_processes(0) == [4242]
    with pytest.raises(InUse):
        backend.destroy_compute_instance(0, gi.id, ci.id)
    fake.sim.set_processes(0, [], gi_id=gi.id)
    with pytest.raises(InUse, match="destroy GPU instance 4 on GPU 0"):
        backend.destroy_gpu_instance(0, gi.id)
    backend.destroy_compute_instance(0, gi.id, ci.id)
    backend.destroy_gpu_instance(0, gi.id)
    with pytest.raises(NotFound, match="no MIG device"):
        backend.mig_device_uuid(0, gi.id, ci.id)
    assert backend.gpu_instances(0) == [other]


def test_hardware_refusals_map_to_tessera_errors(backend: PynvmlBackend) -> None:
    backend.create_gpu_instance_with_placement(0, 9, Placement(0, 4))
    with pytest.raises(InsufficientResources) as exc:
        backend.create_gpu_instance_with_placement(0, 14, Placement(2, 2))
    err = exc.value
    assert err.code == "NVML_ERROR_INSUFFICIENT_RESOURCES"
    assert isinstance(err.__cause__, FakeNVMLError)
    assert "placement {start=2, size=2} on GPU 0" in str(err)
    with pytest.raises(NotFound):
        backend.destroy_gpu_instance(0, 5)
    with pytest.raises(InvalidArgument):
        backend.device(3)


@pytest.mark.parametrize(
    ("code", "error", "name"),
    [
        (23, InsufficientResources, "NVML_ERROR_INSUFFICIENT_RESOURCES"),
        (19, InUse, "NVML_ERROR_IN_USE"),
        (6, NotFound, "NVML_ERROR_NOT_FOUND"),
        (3, NotSupported, "NVML_ERROR_NOT_SUPPORTED"),
        (13, NotSupported, "NVML_ERROR_FUNCTION_NOT_FOUND"),
        (2, InvalidArgument, "NVML_ERROR_INVALID_ARGUMENT"),
        (1, Uninitialized, "NVML_ERROR_UNINITIALIZED"),
        (12, NvmlUnavailable, "NVML_ERROR_LIBRARY_NOT_FOUND"),
        (9, NvmlUnavailable, "NVML_ERROR_DRIVER_NOT_LOADED"),
        (18, NvmlUnavailable, "NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
        (15, NvmlError, "NVML_ERROR_GPU_IS_LOST"),
        (4, NvmlError, "NVML_ERROR_NO_PERMISSION"),
        (777, NvmlError, "NVML return code 777"),
    ],
)
def test_error_mapping_by_return_code(code: int, error: type[NvmlError], name: str) -> None:
    mapped = map_nvml_error(FakeNVMLError(code), "create GPU instance on GPU 0")
    assert type(mapped) is error
    assert mapped.code == name
    assert str(mapped) == f"create GPU instance on GPU 0: fake NVML error {code} [{name}]"
    assert type(error_for_code(code, "x")) is error


def test_error_without_a_code_and_with_a_failing_str() -> None:
    class Broken(Exception):
        value = 12

        def __str__(self) -> str:
            raise RuntimeError("library missing")

    mapped = map_nvml_error(Broken(), "initialize NVML")
    assert isinstance(mapped, NvmlUnavailable)
    assert str(mapped) == "initialize NVML: NVML_ERROR_LIBRARY_NOT_FOUND"
    assert type(map_nvml_error(ValueError("odd"), "x")) is NvmlError


def test_failed_init_leaves_the_session_closed(fake: FakePynvml) -> None:
    def no_driver() -> None:
        raise FakeNVMLError(9)

    fake.hooks["nvmlInit"] = no_driver
    backend = PynvmlBackend(fake)
    with pytest.raises(NvmlUnavailable, match="initialize NVML"):
        backend.init()
    with pytest.raises(Uninitialized):
        backend.device_count()
    del fake.hooks["nvmlInit"]
    backend.init()
    assert backend.device_count() == 1
    backend.shutdown()


def test_missing_pynvml_is_reported_as_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NvmlUnavailable, match="install the nvidia-ml-py package"):
        PynvmlBackend().init()


def test_lost_gpu_is_reported_unhealthy(backend: PynvmlBackend, fake: FakePynvml) -> None:
    fake.sim.set_health(0, False)
    dev = backend.device(0)
    assert not dev.healthy
    assert dev.uuid == fake.sim.device(0).uuid


def test_a_lost_gpu_keeps_the_memory_it_had(backend: PynvmlBackend, fake: FakePynvml) -> None:
    size = backend.device(0).memory_mib
    fake.sim.set_health(0, False)
    dev = backend.device(0)
    assert not dev.healthy and dev.memory_mib == size > 0


def test_a_gpu_lost_before_it_was_ever_read_has_its_models_memory(
    backend: PynvmlBackend, fake: FakePynvml
) -> None:
    fake.sim.set_health(0, False)
    assert backend.device(0).memory_mib == find_model(A100).memory_mib


def test_a_node_with_a_lost_gpu_registers_what_the_scheduler_reads(
    backend: PynvmlBackend, fake: FakePynvml
) -> None:
    """A lost GPU registers unhealthy with its memory: an entry without it is unreadable and
    would make the node's whole register so."""
    fake.sim.set_health(0, False)
    devices = discover(backend, lambda _name: (), "hami-core", 10, 1.0)
    (gpu,) = decode(encode(devices))
    assert not gpu.health and gpu.devmem == find_model(A100).memory_mib


def test_shutdown_waits_for_accepted_operations(fake: FakePynvml) -> None:
    backend = PynvmlBackend(fake)
    backend.init()
    entered, release = threading.Event(), threading.Event()

    def slow_create() -> None:
        entered.set()
        assert release.wait(5)

    fake.hooks["nvmlDeviceCreateGpuInstanceWithPlacement"] = slow_create
    created: list[object] = []
    worker = threading.Thread(
        target=lambda: created.append(
            backend.create_gpu_instance_with_placement(0, 0, Placement(0, 8))
        )
    )
    worker.start()
    assert entered.wait(5)
    closer = threading.Thread(target=backend.shutdown)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the in-flight creation
    assert "nvmlShutdown" not in fake.calls
    with pytest.raises(Uninitialized):  # no new operation is accepted meanwhile
        backend.device_count()
    release.set()
    worker.join(5)
    closer.join(5)
    assert len(created) == 1
    assert fake.calls[-1] == "nvmlShutdown"
    backend.shutdown()  # twice is harmless
    assert fake.calls.count("nvmlShutdown") == 1


def test_code_names_agree_with_the_installed_pynvml() -> None:
    pynvml = pytest.importorskip("pynvml")
    from node_agent.nvml.errors import CODE_NAMES

    theirs = {
        v: k for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_") and isinstance(v, int)
    }
    assert {code: theirs[code] for code in CODE_NAMES if code in theirs} == {
        code: name for code, name in CODE_NAMES.items() if code in theirs
    }


def test_the_installed_pynvml_has_every_call_the_backend_makes() -> None:
    pynvml = pytest.importorskip("pynvml")
    used = [n for n in vars(FakePynvml) if n.startswith("_nvml")] + [
        "_c_nvmlGpuInstancePlacement_t",
        "_c_nvmlGpuInstance_t",
        "_c_nvmlComputeInstance_t",
        "_NVMLError",
    ]
    assert [n[1:] for n in used if not hasattr(pynvml, n[1:])] == []
