"""What a node registers, discovered through an ``NvmlBackend``.

``discover`` is pure apart from the backend's read-only calls (and a warning for a GPU it
leaves out): it produces the ``GpuDevice`` records of ``hami.io/node-nvidia-register``.
In mig mode each GPU lists the allowlisted profiles NVML resolves, in allowlist order, with
NVML's memory, slice count and possible placements, and
``core = ceil(profile SMs × 100 / full-GPU SMs)``.

Profile names are policy labels, NVML works with profile indexes: to resolve a name the
GPU's profile index constants (0..17) are queried; a profile's name is the one NVML's v2
info gives (``"MIG 2g.10gb"`` -> ``"2g.10gb"``), or, from bindings that return v1 info
without a name, the catalog's name of the profile with the same id and slice count on
that model (matching by id, not memory, because memory sizes drift between drivers).
Allowlisted names that resolve to nothing are left out, as HAMi does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import structlog

from api.hami.catalog import UnknownModelError, find_model
from api.hami.keys import GpuMode
from api.hami.register import GpuDevice, MigProfile, registered_count, registered_type
from node_agent.nvml.backend import (
    GPU_INSTANCE_PROFILE_INDEXES,
    DeviceInfo,
    GpuInstanceProfileInfo,
    NvmlBackend,
)
from node_agent.nvml.errors import InvalidArgument, NotFound, NotSupported

log = structlog.get_logger(__name__)

_ABSENT = (NotSupported, InvalidArgument, NotFound)
# Modes whose GPUs are shared by slots with limits (HAMi-core's or MPS's): memory and core
# scaling apply to them; a MIG GPU's memory and cores are the card's.
_SCALED_MODES: frozenset[GpuMode] = frozenset({"hami-core", "mps"})


def discover(
    backend: NvmlBackend,
    allowlist_profiles_for: Callable[[str], tuple[str, ...]],
    mode: GpuMode,
    split_count: int,
    memory_scaling: float,
    *,
    core_scaling: float = 1.0,
    registers: Callable[[str, int], bool] = lambda _uuid, _index: True,
) -> tuple[GpuDevice, ...]:
    """The GPUs of this node as it registers them (``backend`` must be initialized), but
    those ``registers`` leaves out (``filterdevices``). A hami-core or mps GPU registers
    ``core_scaling`` × 100 cores (HAMi's ``deviceCoreScaling``) and ``memory_scaling`` × its
    memory; an mps GPU at most ``MPS_MAX_CLIENTS`` slots (one daemon serves no more). A lost
    GPU whose size is unknown (never read, a model the catalog lacks) is left out: a
    register entry without memory is unreadable, and would make the node's whole register
    so; it is registered once NVML answers for it again."""
    devices: list[GpuDevice] = []
    for index in range(backend.device_count()):
        dev = backend.device(index)
        if not registers(dev.uuid, dev.index):
            continue
        if dev.memory_mib <= 0:
            _left_out(dev, "NVML reports no memory size for it (lost before it was ever read)")
            continue
        profiles: tuple[MigProfile, ...] = ()
        scaled = mode in _SCALED_MODES
        instance_counts: list[int] = []
        if mode == "mig":
            found = mig_profiles(backend, dev, allowlist_profiles_for(dev.name))
            if not found and dev.healthy:
                # As HAMi: a GPU that offers no allowlisted profile (MIG off, none allowed
                # for its model) has nothing to register in mig mode.
                _left_out(dev, "no allowlisted MIG profile resolves on it (MIG mode off?)")
                continue
            profiles = tuple(p for p, _ in found)
            instance_counts = [n for _, n in found]
        devices.append(
            GpuDevice(
                id=dev.uuid,
                index=dev.index,
                count=registered_count(mode, split_count, instance_counts),
                devmem=int(dev.memory_mib * (memory_scaling if scaled else 1.0)),
                devcore=int(100 * (core_scaling if scaled else 1.0)),
                type=registered_type(dev.name),
                numa=dev.numa_node,
                health=dev.healthy,
                mode=mode,
                mig_profiles=profiles,
            )
        )
    return tuple(devices)


def _left_out(dev: DeviceInfo, reason: str) -> None:
    log.warning(
        "discovery.gpu_left_out", gpu=dev.uuid, index=dev.index, model=dev.name, reason=reason
    )


def unregistered(backend: NvmlBackend, registers: Callable[[str, int], bool]) -> frozenset[int]:
    """Indexes of the GPUs ``registers`` leaves out: not this agent's to touch."""
    out = set()
    for index in range(backend.device_count()):
        dev = backend.device(index)
        if not registers(dev.uuid, dev.index):
            out.add(index)
    return frozenset(out)


def mig_profiles(
    backend: NvmlBackend, dev: DeviceInfo, allowed: tuple[str, ...]
) -> tuple[tuple[MigProfile, int], ...]:
    """The allowlisted profiles NVML resolves on ``dev``, each with how many instances of
    it the GPU allows; none unless MIG mode is on."""
    if not allowed or dev.multiprocessor_count <= 0:
        return ()
    try:
        if not backend.mig_mode(dev.index).current:
            return ()
    except NotSupported:
        return ()
    resolved = resolve_profiles(backend, dev)
    out: list[tuple[MigProfile, int]] = []
    for name in allowed:
        info = resolved.get(name)
        if info is None:
            continue
        placements = tuple(backend.gpu_instance_possible_placements(dev.index, info.id))
        if not placements:
            continue
        profile = MigProfile(
            name=name,
            memory_mb=info.memory_mib,
            core=math.ceil(info.multiprocessor_count * 100 / dev.multiprocessor_count),
            slice_count=info.slice_count,
            placements=placements,
        )
        out.append((profile, info.instance_count))
    return tuple(out)


def resolve_profiles(backend: NvmlBackend, dev: DeviceInfo) -> dict[str, GpuInstanceProfileInfo]:
    """Profile name -> NVML profile info, for every profile index the GPU answers."""
    out: dict[str, GpuInstanceProfileInfo] = {}
    for profile_index in GPU_INSTANCE_PROFILE_INDEXES:
        try:
            info = backend.gpu_instance_profile_info(dev.index, profile_index)
        except _ABSENT:
            continue
        name = _profile_name(info, dev.name)
        if name is not None:
            out.setdefault(name, info)
    return out


def _profile_name(info: GpuInstanceProfileInfo, device_name: str) -> str | None:
    if info.name:
        return info.name.strip().removeprefix("MIG ").strip()
    try:
        model = find_model(device_name)
    except UnknownModelError:
        return None
    return next(
        (
            p.name
            for p in model.profiles
            if p.profile_id == info.id and p.slice_count == info.slice_count
        ),
        None,
    )
