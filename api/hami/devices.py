"""Codecs of the pod annotations the scheduler writes and the node agent completes.

- ``hami.io/vgpu-devices-allocated`` / ``-to-allocate``: per device ``UUID,NVIDIA,<mem>,<cores>:``,
  each container's list closed by ``;``, containers in pod order (init containers first). The
  UUID of a device HAMi <= v2.9 placed on MIG carries ``[<template>-<slot>]`` (``legacy``).
- ``hami.io/vgpu-mig-allocations``: JSON array, one entry per MIG device.
- ``hami.io/bind-phase`` and ``hami.io/bind-time``.
All decoders are strict: anything off the format raises InvalidAnnotationError.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from api.errors import InvalidAnnotationError, short_repr
from api.hami.jsonvalue import Bad, annotation_errors, load_json
from api.hami.keys import (
    BIND_PHASE,
    BIND_PHASES,
    BIND_TIME,
    DEVICES_ALLOCATED,
    MIG_ALLOCATIONS,
    BindPhase,
)
from api.hami.register import Placement


@dataclass(frozen=True)
class DeviceAlloc:
    """One vGPU of one container: physical GPU, memory (MiB) and cores (percent).

    ``legacy``: the ``<template>-<slot>`` a HAMi <= v2.9 MIG device carries after its GPU's
    UUID (``GPU-…[1-1]``): an instance of that GPU whose placement the string does not say
    (the template indexes the old ``knownMigGeometries``, the slot the MIG device's NVML
    index). Only read, never written by Tessera."""

    uuid: str
    mem: int
    cores: int
    vendor: str = "NVIDIA"
    legacy: str | None = None

    @property
    def written_uuid(self) -> str:
        return self.uuid if self.legacy is None else f"{self.uuid}[{self.legacy}]"


ContainerDevices = tuple[DeviceAlloc, ...]
PodDevices = tuple[ContainerDevices, ...]

# \A…\Z, not ^…$: '$' also matches before a trailing newline.
_UUID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
# A device's UUID field: the GPU's, with a HAMi <= v2.9 MIG suffix ``[<template>-<slot>]``.
_DEVICE_UUID_RE = re.compile(
    r"\A(?P<uuid>[A-Za-z0-9][A-Za-z0-9_.\-]*)(?:\[(?P<legacy>[0-9]{1,6}-[0-9]{1,6})\])?\Z"
)


def encode_devices(pod_devices: PodDevices) -> str:
    return "".join(
        "".join(f"{d.written_uuid},{d.vendor},{d.mem},{d.cores}:" for d in container) + ";"
        for container in pod_devices
    )


def decode_devices(value: str, *, key: str = DEVICES_ALLOCATED, obj: str = "") -> PodDevices:
    def bad(problem: str) -> InvalidAnnotationError:
        return InvalidAnnotationError(key, problem, obj=obj)

    if value == "":
        return ()
    if not value.endswith(";"):
        raise bad("must end with ';' (each container's device list is closed by ';')")
    containers: list[ContainerDevices] = []
    for ci, chunk in enumerate(value[:-1].split(";")):
        if chunk == "":
            containers.append(())
            continue
        if not chunk.endswith(":"):
            raise bad(f"container {ci}: each device must end with ':' (got {short_repr(chunk)})")
        devices: list[DeviceAlloc] = []
        for di, dev in enumerate(chunk[:-1].split(":")):
            parts = dev.split(",")
            if len(parts) != 4:
                raise bad(
                    f"container {ci} device {di}: expected UUID,VENDOR,MEM,CORES, "
                    f"got {short_repr(dev)}"
                )
            uuid_field, vendor, mem_s, cores_s = parts
            m = _DEVICE_UUID_RE.match(uuid_field)
            if m is None:
                raise bad(f"container {ci} device {di}: invalid GPU UUID {short_repr(uuid_field)}")
            if not vendor:
                raise bad(f"container {ci} device {di}: empty vendor")
            if not _is_decimal(mem_s) or not _is_decimal(cores_s):
                raise bad(
                    f"container {ci} device {di}: memory and cores must be non-negative "
                    f"integers, got {short_repr(mem_s)} and {short_repr(cores_s)}"
                )
            mem, cores = int(mem_s), int(cores_s)
            if mem > 2**31 - 1 or cores > 100:
                raise bad(f"container {ci} device {di}: memory {mem} or cores {cores} out of range")
            devices.append(DeviceAlloc(m["uuid"], mem, cores, vendor, m["legacy"]))
        containers.append(tuple(devices))
    return tuple(containers)


def _is_decimal(s: str) -> bool:
    """ASCII digits, at most 12 (every field's range is shorter): str.isdigit() also takes
    '²', which int() refuses, and int() refuses more than 4300 digits."""
    return s.isascii() and s.isdigit() and len(s) <= 12


def empty_devices(container_count: int) -> str:
    """``to-allocate`` once every container has been allocated."""
    return ";" * container_count


@dataclass(frozen=True)
class RuntimeIdentity:
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class MigAllocation:
    """A reserved MIG device; ``runtime`` is filled in by the node agent after creation."""

    container_index: int
    device_index: int
    gpu_uuid: str
    profile: str
    placement: Placement
    runtime: RuntimeIdentity | None = None


def container_mig(
    allocs: Iterable[MigAllocation], container_index: int
) -> tuple[MigAllocation, ...]:
    """The entries of container ``container_index``, in ascending device index."""
    return tuple(
        sorted(
            (a for a in allocs if a.container_index == container_index),
            key=lambda a: a.device_index,
        )
    )


def encode_mig_allocations(allocs: tuple[MigAllocation, ...] | list[MigAllocation]) -> str:
    out: list[dict[str, object]] = []
    for a in allocs:
        item: dict[str, object] = {
            "containerIndex": a.container_index,
            "deviceIndex": a.device_index,
            "gpuUUID": a.gpu_uuid,
            "profile": a.profile,
            "placement": {"start": a.placement.start, "size": a.placement.size},
        }
        if a.runtime is not None:
            item["migUUID"] = a.runtime.mig_uuid
            item["gpuInstanceID"] = a.runtime.gpu_instance_id
            item["computeInstanceID"] = a.runtime.compute_instance_id
        out.append(item)
    return json.dumps(out, separators=(",", ":"))


_RUNTIME_KEYS = ("migUUID", "gpuInstanceID", "computeInstanceID")


def decode_mig_allocations(value: str, *, obj: str = "") -> tuple[MigAllocation, ...]:
    """The MIG devices ``hami.io/vgpu-mig-allocations`` reserves (``obj`` names the pod in
    errors). Valid values are memoized: the result is immutable, and the node agent re-reads
    every MIG pod of a node each time it works out that node's desired instances."""
    if not isinstance(value, str):
        return _decode_mig_allocations(value, obj)
    try:
        return _decode_valid_mig_allocations(value)
    except InvalidAnnotationError:
        return _decode_mig_allocations(value, obj)  # raises, naming ``obj``


@functools.lru_cache(maxsize=4096)
def _decode_valid_mig_allocations(value: str) -> tuple[MigAllocation, ...]:
    return _decode_mig_allocations(value, "")


def _decode_mig_allocations(value: str, obj: str) -> tuple[MigAllocation, ...]:
    bad = annotation_errors(MIG_ALLOCATIONS, obj)
    raw = load_json(value, bad)
    if not isinstance(raw, list):
        raise bad("must be a JSON array with one entry per MIG device")
    allocs: list[MigAllocation] = []
    seen: set[tuple[int, int]] = set()
    for i, item in enumerate(raw):
        where = f"entry [{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object")
        it = cast("dict[str, Any]", item)
        ci = _int(it, "containerIndex", where, bad, default=0)
        di = _int(it, "deviceIndex", where, bad, default=0)
        gpu = it.get("gpuUUID")
        if not isinstance(gpu, str) or not _UUID_RE.match(gpu):
            raise bad(f"{where}.gpuUUID must be a GPU UUID string, got {short_repr(gpu)}")
        profile = it.get("profile")
        if not isinstance(profile, str) or not profile:
            raise bad(f"{where}.profile must be a non-empty string, got {short_repr(profile)}")
        pl = it.get("placement")
        if not isinstance(pl, dict):
            raise bad(f"{where}.placement must be an object with start and size")
        pld = cast("dict[str, Any]", pl)
        start = _int(pld, "start", f"{where}.placement", bad, default=0)
        size = _int(pld, "size", f"{where}.placement", bad, default=None)
        if size < 1 or start + size > 16:
            raise bad(f"{where}.placement [{start},{start + size}) is not a valid slice range")
        present = [k for k in _RUNTIME_KEYS if k in it]
        runtime: RuntimeIdentity | None = None
        if present and len(present) != len(_RUNTIME_KEYS):
            missing = [k for k in _RUNTIME_KEYS if k not in it]
            raise bad(
                f"{where} has a partial runtime identity (missing {', '.join(missing)}); "
                "all of migUUID, gpuInstanceID, computeInstanceID or none"
            )
        if present:
            mig_uuid = it["migUUID"]
            if not isinstance(mig_uuid, str) or not mig_uuid.startswith("MIG-"):
                raise bad(f"{where}.migUUID must be a MIG-… UUID, got {short_repr(mig_uuid)}")
            runtime = RuntimeIdentity(
                mig_uuid,
                _int(it, "gpuInstanceID", where, bad, default=None),
                _int(it, "computeInstanceID", where, bad, default=None),
            )
        if (ci, di) in seen:
            raise bad(f"{where} duplicates (containerIndex {ci}, deviceIndex {di})")
        seen.add((ci, di))
        allocs.append(MigAllocation(ci, di, gpu, profile, Placement(start, size), runtime))
    return tuple(allocs)


def _int(raw: dict[str, Any], key: str, where: str, bad: Bad, *, default: int | None) -> int:
    v = raw.get(key)
    if v is None:
        if default is None:
            raise bad(f"{where}.{key} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 2**31 - 1:
        raise bad(f"{where}.{key} must be a non-negative integer, got {short_repr(v)}")
    return v


def decode_bind_phase(value: str, *, obj: str = "") -> BindPhase:
    for phase in BIND_PHASES:
        if value == phase:
            return phase
    raise InvalidAnnotationError(
        BIND_PHASE, f"{short_repr(value)} is not one of {', '.join(BIND_PHASES)}", obj=obj
    )


def encode_bind_time(unix_seconds: int) -> str:
    return str(unix_seconds)


def decode_bind_time(value: str, *, obj: str = "") -> int:
    if not _is_decimal(value) or len(value) > 12:
        raise InvalidAnnotationError(
            BIND_TIME,
            f"must be unix seconds as a decimal integer, got {short_repr(value)}",
            obj=obj,
        )
    return int(value)
