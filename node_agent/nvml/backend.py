"""The one NVML interface the node agent uses, its result values and its session gate.

``NvmlBackend`` mirrors the NVML calls the agent needs (snake_case, typed); the real
backend wraps ``pynvml``, the simulated one models the catalog's geometry as strictly as
the hardware. Every call raises only ``node_agent.nvml.errors`` types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from api.hami.register import Placement
from node_agent.nvml.errors import Uninitialized

# NVML_GPU_INSTANCE_PROFILE_* index constants the reference lists (1_SLICE=0 … 3_SLICE_GFX=17).
GPU_INSTANCE_PROFILE_INDEXES: Final[tuple[int, ...]] = tuple(range(18))

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (1_SLICE=0 … 6_SLICE=6).
COMPUTE_INSTANCE_PROFILE_SLICES: Final[dict[int, int]] = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


def full_compute_instance_profile(slice_count: int) -> int:
    """The CI profile index whose slice count equals the GI's (one full-size CI per GI)."""
    for index, slices in COMPUTE_INSTANCE_PROFILE_SLICES.items():
        if slices == slice_count:
            return index
    raise ValueError(f"no compute instance profile has {slice_count} slices")


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int
    numa_node: int
    multiprocessor_count: int
    healthy: bool


class MigMode(NamedTuple):
    current: bool
    pending: bool


@dataclass(frozen=True)
class GpuInstanceProfileInfo:
    """``nvmlDeviceGetGpuInstanceProfileInfo``: ``id`` is the profile *id*, not the index."""

    id: int
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    memory_mib: int
    name: str | None = None  # v2 info only, e.g. "MIG 2g.10gb"


@dataclass(frozen=True, order=True)
class GpuInstance:
    id: int
    profile_id: int
    placement: Placement


@dataclass(frozen=True, order=True)
class ComputeInstance:
    id: int
    gi_id: int
    profile_id: int


class NvmlBackend(Protocol):
    """What the node agent calls; GPUs by index, profiles by NVML index or id as NVML does.

    ``init`` opens a session (idempotent while open); ``shutdown`` refuses new calls, waits
    for the accepted ones to finish, then closes; closing twice is harmless. Any other call
    outside a session raises ``Uninitialized``.
    """

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def device_count(self) -> int: ...

    def device(self, index: int) -> DeviceInfo: ...

    def mig_mode(self, index: int) -> MigMode: ...

    def gpu_instance_profile_info(
        self, index: int, profile_index: int
    ) -> GpuInstanceProfileInfo: ...

    def gpu_instance_possible_placements(self, index: int, profile_id: int) -> list[Placement]: ...

    def create_gpu_instance_with_placement(
        self, index: int, profile_id: int, placement: Placement
    ) -> GpuInstance: ...

    def gpu_instances(self, index: int, profile_id: int | None = None) -> list[GpuInstance]: ...

    def create_compute_instance(
        self, index: int, gi_id: int, ci_profile_index: int
    ) -> ComputeInstance: ...

    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]: ...

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None: ...

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None: ...

    def mig_device_uuid(self, index: int, gi_id: int, ci_id: int) -> str: ...

    def running_processes(self, index: int) -> list[int]: ...


def describe_placement(p: Placement) -> str:
    return f"placement {{start={p.start}, size={p.size}}}"


class SessionGate:
    """Tracks one NVML session and the calls in flight in it.

    ``close`` first refuses new calls, then waits until every accepted call has returned,
    so the library is never shut down under a running hardware operation.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._closing = False
        self._in_flight = 0

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._open

    def open(self, initialize: Callable[[], None]) -> None:
        """Run ``initialize`` and open the session; a no-op while it is open."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closing)
            if self._open:
                return
            initialize()  # raises: the session stays closed
            self._open = True

    @contextmanager
    def operation(self, attempted: str) -> Iterator[None]:
        with self._cond:
            if not self._open:
                raise Uninitialized(
                    attempted, "NVML is not initialized (call init() first, or it was shut down)"
                )
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def close(self, finalize: Callable[[], None]) -> None:
        """Refuse new calls, wait for accepted ones, then run ``finalize``; twice is a no-op."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closing)
            if not self._open:
                return
            self._open = False
            self._closing = True
            self._cond.wait_for(lambda: self._in_flight == 0)
        try:
            finalize()
        finally:
            with self._cond:
                self._closing = False
                self._cond.notify_all()
