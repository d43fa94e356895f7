"""``NvmlBackend`` over the NVIDIA driver through ``pynvml`` (package nvidia-ml-py).

``pynvml`` is imported on first use, so this module loads on machines without a driver;
the constructor also takes the module object, which is how tests inject a fake. Every
``pynvml.NVMLError`` is mapped to ``node_agent.nvml.errors`` by its return code
(``raise … from e``); pynvml types never leave this module. The list-returning NVML
calls take caller-allocated arrays: they are passed as ctypes arrays plus a pointer to
the count, which is what pynvml forwards to the C library.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Final, TypeVar

from api.hami.catalog import UnknownModelError, find_model
from api.hami.register import Placement
from node_agent.nvml.backend import (
    COMPUTE_INSTANCE_PROFILE_SLICES,
    GPU_INSTANCE_PROFILE_INDEXES,
    ComputeInstance,
    DeviceInfo,
    GpuInstance,
    GpuInstanceProfileInfo,
    MigMode,
    SessionGate,
    describe_placement,
)
from node_agent.nvml.errors import NotFound, NvmlError, NvmlUnavailable, code_name, error_for_code

_MIB: Final = 1024 * 1024
# Room for every list NVML returns here (at most 12 memory slices, 8 compute slices).
_MAX_ITEMS: Final = 32
_MIG_ENABLE: Final = 1
_ENGINE_PROFILE_SHARED: Final = 0
# Codes that mean "this profile / slot does not exist here" while enumerating.
_ABSENT: Final = frozenset(
    {"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_FOUND"}
)
_LOST: Final = frozenset({"NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED"})

T = TypeVar("T")


def map_nvml_error(error: BaseException, attempted: str) -> NvmlError:
    """The Tessera error for a ``pynvml.NVMLError`` (its ``value`` is the return code)."""
    code = getattr(error, "value", None)
    try:
        detail = str(error)
    except Exception:  # pynvml's __str__ asks the library, which may be missing
        detail = ""
    if not isinstance(code, int):
        return NvmlError(attempted, detail or repr(error))
    return error_for_code(code, attempted, detail)


class PynvmlBackend:
    """The real NVML backend; one session per ``init``/``shutdown`` cycle."""

    def __init__(self, module: Any | None = None) -> None:
        self._module = module
        self._gate = SessionGate()
        self._memory_seen: dict[str, int] = {}  # GPU UUID -> MiB, as last read

    # -- session ----------------------------------------------------------------------

    def init(self) -> None:
        def initialize() -> None:
            with self._mapped("initialize NVML") as nv:
                nv.nvmlInit()

        self._gate.open(initialize)

    def shutdown(self) -> None:
        def finalize() -> None:
            with self._mapped("shut down NVML") as nv:
                nv.nvmlShutdown()

        self._gate.close(finalize)

    # -- queries ----------------------------------------------------------------------

    def device_count(self) -> int:
        with self._op("count GPUs") as nv:
            return int(nv.nvmlDeviceGetCount())

    def device(self, index: int) -> DeviceInfo:
        with self._op(f"query GPU {index}") as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            name = _text(nv.nvmlDeviceGetName(h))
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            healthy = True
            try:
                memory_mib = int(nv.nvmlDeviceGetMemoryInfo(h).total) // _MIB
                self._memory_seen[uuid] = memory_mib
            except nv.NVMLError as e:
                if _code(e) not in _LOST:
                    raise
                healthy = False  # fallen off the bus / needs a reset: report, don't fail
                memory_mib = self._lost_memory(uuid, name)
            return DeviceInfo(
                index=index,
                uuid=uuid,
                name=name,
                memory_mib=memory_mib,
                numa_node=self._numa(nv, h),
                multiprocessor_count=self._multiprocessors(nv, h, name) if healthy else 0,
                healthy=healthy,
            )

    def mig_mode(self, index: int) -> MigMode:
        with self._op(f"query MIG mode of GPU {index}") as nv:
            current, pending = nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(index))
            return MigMode(_int(current) == _MIG_ENABLE, _int(pending) == _MIG_ENABLE)

    def gpu_instance_profile_info(self, index: int, profile_index: int) -> GpuInstanceProfileInfo:
        what = f"query GPU instance profile index {profile_index} on GPU {index}"
        with self._op(what) as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            return _profile_info(nv.nvmlDeviceGetGpuInstanceProfileInfo(h, profile_index))

    def gpu_instance_possible_placements(self, index: int, profile_id: int) -> list[Placement]:
        what = f"list possible placements of GPU instance profile id {profile_id} on GPU {index}"
        with self._op(what) as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            items = _fill(
                nv.c_nvmlGpuInstancePlacement_t,
                partial(nv.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id),
            )
            return [Placement(int(p.start), int(p.size)) for p in items]

    def gpu_instances(self, index: int, profile_id: int | None = None) -> list[GpuInstance]:
        with self._op(f"list GPU instances on GPU {index}") as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            ids = [profile_id] if profile_id is not None else self._gi_profile_ids(nv, h)
            out: set[GpuInstance] = set()
            for pid in ids:
                handles = _fill(
                    nv.c_nvmlGpuInstance_t, partial(nv.nvmlDeviceGetGpuInstances, h, pid)
                )
                out.update(_gi_view(nv.nvmlGpuInstanceGetInfo(gi)) for gi in handles)
            return sorted(out)

    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]:
        with self._op(f"list compute instances of GPU instance {gi_id} on GPU {index}") as nv:
            gi = nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(index), gi_id)
            out: set[ComputeInstance] = set()
            for ci_profile_index in COMPUTE_INSTANCE_PROFILE_SLICES:
                prof = _absent_is_none(
                    nv,
                    partial(
                        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                        gi,
                        ci_profile_index,
                        _ENGINE_PROFILE_SHARED,
                    ),
                )
                if prof is None:
                    continue
                handles = _fill(
                    nv.c_nvmlComputeInstance_t,
                    partial(nv.nvmlGpuInstanceGetComputeInstances, gi, prof.id),
                )
                for ci in handles:
                    info = nv.nvmlComputeInstanceGetInfo(ci)
                    out.add(ComputeInstance(int(info.id), gi_id, int(info.profileId)))
            return sorted(out)

    def mig_device_uuid(self, index: int, gi_id: int, ci_id: int) -> str:
        what = f"resolve MIG device of GPU instance {gi_id} compute instance {ci_id} on GPU {index}"
        with self._op(what) as nv:
            for mig in self._mig_handles(nv, nv.nvmlDeviceGetHandleByIndex(index)):
                if (
                    _int(nv.nvmlDeviceGetGpuInstanceId(mig)) == gi_id
                    and _int(nv.nvmlDeviceGetComputeInstanceId(mig)) == ci_id
                ):
                    return _text(nv.nvmlDeviceGetUUID(mig))
            raise NotFound(what, "no MIG device has that GI and CI id", code=code_name(6))

    def running_processes(self, index: int) -> list[int]:
        """Compute processes on the GPU and on each of its MIG devices."""
        with self._op(f"list processes on GPU {index}") as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            pids: set[int] = set()
            for dev in [h, *self._mig_handles(nv, h)]:
                procs = _absent_is_none(nv, partial(nv.nvmlDeviceGetComputeRunningProcesses, dev))
                pids.update(int(p.pid) for p in procs or ())
            return sorted(pids)

    # -- mutations --------------------------------------------------------------------

    def create_gpu_instance_with_placement(
        self, index: int, profile_id: int, placement: Placement
    ) -> GpuInstance:
        what = (
            f"create GPU instance of profile id {profile_id} at {describe_placement(placement)}"
            f" on GPU {index}"
        )
        with self._op(what) as nv:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            pl = nv.c_nvmlGpuInstancePlacement_t()
            pl.start, pl.size = placement.start, placement.size
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.pointer(pl))
            return _gi_view(nv.nvmlGpuInstanceGetInfo(gi))

    def create_compute_instance(
        self, index: int, gi_id: int, ci_profile_index: int
    ) -> ComputeInstance:
        what = (
            f"create compute instance of profile index {ci_profile_index} in GPU instance"
            f" {gi_id} on GPU {index}"
        )
        with self._op(what) as nv:
            gi = nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(index), gi_id)
            prof = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, ci_profile_index, _ENGINE_PROFILE_SHARED
            )
            info = nv.nvmlComputeInstanceGetInfo(
                nv.nvmlGpuInstanceCreateComputeInstance(gi, prof.id)
            )
            return ComputeInstance(int(info.id), gi_id, int(info.profileId))

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        with self._op(
            f"destroy compute instance {ci_id} of GPU instance {gi_id} on GPU {index}"
        ) as nv:
            gi = nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(index), gi_id)
            nv.nvmlComputeInstanceDestroy(nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        with self._op(f"destroy GPU instance {gi_id} on GPU {index}") as nv:
            nv.nvmlGpuInstanceDestroy(
                nv.nvmlDeviceGetGpuInstanceById(nv.nvmlDeviceGetHandleByIndex(index), gi_id)
            )

    # -- internals --------------------------------------------------------------------

    def _nv(self) -> Any:
        if self._module is None:
            try:
                self._module = importlib.import_module("pynvml")
            except ImportError as e:
                raise NvmlUnavailable(
                    "load the NVML Python bindings",
                    "module pynvml is missing; install the nvidia-ml-py package",
                ) from e
        return self._module

    @contextmanager
    def _mapped(self, attempted: str) -> Iterator[Any]:
        nv = self._nv()
        try:
            yield nv
        except nv.NVMLError as e:
            raise map_nvml_error(e, attempted) from e

    @contextmanager
    def _op(self, attempted: str) -> Iterator[Any]:
        with self._gate.operation(attempted), self._mapped(attempted) as nv:
            yield nv

    @staticmethod
    def _numa(nv: Any, h: Any) -> int:
        get = getattr(nv, "nvmlDeviceGetNumaNodeId", None)  # newer bindings only
        node = _absent_is_none(nv, lambda: get(h)) if get is not None else None
        return max(_int(node), 0) if node is not None else 0

    def _lost_memory(self, uuid: str, name: str) -> int:
        """A lost GPU's memory, which NVML no longer answers: as last read, else the catalog's
        size for the model, else 0 (unknown)."""
        seen = self._memory_seen.get(uuid)
        if seen is not None:
            return seen
        try:
            return find_model(name).memory_mib
        except UnknownModelError:
            return 0

    @staticmethod
    def _multiprocessors(nv: Any, h: Any, name: str) -> int:
        """SMs of the whole GPU: device attributes where the driver answers for full GPUs,
        else the catalog's count for the model, else the largest MIG profile's."""
        attrs = _absent_is_none(nv, lambda: nv.nvmlDeviceGetAttributes(h))
        if attrs is not None and int(attrs.multiprocessorCount) > 0:
            return int(attrs.multiprocessorCount)
        try:
            return find_model(name).multiprocessor_count
        except UnknownModelError:
            pass
        best = 0
        for i in GPU_INSTANCE_PROFILE_INDEXES:
            info = _absent_is_none(nv, partial(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, i))
            if info is not None:
                best = max(best, int(info.multiprocessorCount))
        return best

    @staticmethod
    def _gi_profile_ids(nv: Any, h: Any) -> list[int]:
        ids: list[int] = []
        for i in GPU_INSTANCE_PROFILE_INDEXES:
            info = _absent_is_none(nv, partial(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, i))
            if info is not None and int(info.id) not in ids:
                ids.append(int(info.id))
        return ids

    @staticmethod
    def _mig_handles(nv: Any, h: Any) -> list[Any]:
        mode = _absent_is_none(nv, lambda: nv.nvmlDeviceGetMigMode(h))
        if mode is None or _int(mode[0]) != _MIG_ENABLE:
            return []
        out = []
        for i in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(h))):
            mig = _absent_is_none(nv, partial(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, i))
            if mig is not None:
                out.append(mig)
        return out


def _absent_is_none(nv: Any, call: Callable[[], T]) -> T | None:
    """``call()``, or None when NVML says the thing is not there (enumeration gaps)."""
    try:
        return call()
    except nv.NVMLError as e:
        if _code(e) in _ABSENT:
            return None
        raise


def _fill(item_type: Any, call: Callable[[Any, Any], object]) -> list[Any]:
    arr = (item_type * _MAX_ITEMS)()
    count = ctypes.c_uint(_MAX_ITEMS)  # in: room (placements _v2); out: items written
    call(arr, ctypes.pointer(count))
    return [arr[i] for i in range(min(count.value, _MAX_ITEMS))]


def _profile_info(info: Any) -> GpuInstanceProfileInfo:
    raw_name = getattr(info, "name", None)  # v2 info only
    return GpuInstanceProfileInfo(
        id=int(info.id),
        slice_count=int(info.sliceCount),
        instance_count=int(info.instanceCount),
        multiprocessor_count=int(info.multiprocessorCount),
        memory_mib=int(info.memorySizeMB),
        name=_text(raw_name) or None if raw_name is not None else None,
    )


def _gi_view(info: Any) -> GpuInstance:
    return GpuInstance(
        int(info.id),
        int(info.profileId),
        Placement(int(info.placement.start), int(info.placement.size)),
    )


def _code(e: BaseException) -> str:
    value = getattr(e, "value", None)
    return code_name(value) if isinstance(value, int) else ""


def _int(v: Any) -> int:
    return int(getattr(v, "value", v))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
