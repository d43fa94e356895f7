"""Pods as the scheduling core sees them: GPU requests and recorded allocations.

Input is the plain JSON/YAML form of a Kubernetes Pod (a dict); nothing here talks to the
API. ``parse_request`` reads what a pod asks for (container limits, falling back to
requests, plus the user annotations); ``parse_allocation`` reads what the scheduler
recorded for a bound pod. Both read the pod's CPU and memory as kube-scheduler counts them
(``host_requests``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from api.errors import InvalidRequestError, short_repr
from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    PodDevices,
    decode_devices,
    decode_mig_allocations,
)
from api.hami.keys import GPU_MODES, GpuMode, modes_named, parse_go_bool
from api.hami.policy import GpuPolicy, Policy, ScoringWeights
from api.kube.objects import (
    all_containers,
    annotations_of,
    as_object,
    finished,
    parse_quantity,
    pod_key,
    pod_priority,
)


@dataclass(frozen=True)
class ContainerRequest:
    """What one container asks of each of its ``count`` vGPUs."""

    index: int  # position in pod order, init containers first
    name: str
    count: int
    mem_mib: int  # absolute MiB per vGPU; 0 when a percentage is used
    mem_percent: int  # percent of the card per vGPU, used when mem_mib == 0
    cores: int

    def mem_for(self, devmem: int) -> int:
        return self.mem_mib if self.mem_mib else devmem * self.mem_percent // 100


@dataclass(frozen=True)
class PodRequest:
    key: str  # "namespace/name"
    uid: str
    containers: tuple[ContainerRequest, ...]  # only containers that ask for GPUs
    container_count: int  # all containers, init first
    modes: frozenset[GpuMode] | None  # None: the pod names none (any mode)
    node_policy: Policy
    gpu_policy: GpuPolicy
    numa_bind: bool  # all of a container's devices on one NUMA node
    weights: ScoringWeights  # of the GPU score
    use_types: tuple[str, ...]
    nouse_types: tuple[str, ...]
    use_uuids: tuple[str, ...]
    nouse_uuids: tuple[str, ...]
    cpu_milli: int
    memory_bytes: int
    # ``spec.priority``: only pods of a strictly lower one may be preempted for this pod.
    priority: int = 0
    # The pod names its GPU policy (``hami.io/gpu-scheduler-policy``): under the fragmentation
    # node policy its devices still go by that policy's GPU order.
    gpu_policy_named: bool = False

    @property
    def fragmentation(self) -> bool:
        """Node and GPUs chosen by the fragmentation rule (``core.fragmentation``)."""
        return self.node_policy is Policy.FRAGMENTATION

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    @property
    def device_count(self) -> int:
        return sum(c.count for c in self.containers)


def _resource(container: Mapping[str, Any], name: str) -> object | None:
    res = as_object(container.get("resources"))
    for section in ("limits", "requests"):
        values = as_object(res.get(section))
        if name in values:
            return cast("object", values[name])
    return None


def host_requests(pod: Mapping[str, Any], *, strict: bool) -> tuple[int, int]:
    """The CPU (millicores) and memory (bytes) ``pod`` requests, as kube-scheduler counts them
    (``PodRequests``, Kubernetes 1.36): its containers' requests plus its sidecars' (init
    containers with ``restartPolicy: Always``), or, where more, the most an init container
    needs while it runs (its own request plus the sidecars started before it); pod-level
    ``spec.resources`` replace that sum; ``spec.overhead`` is added. A request that is not
    stated is its limit's (the API server defaults one to the other), else 0.

    ``strict``: an unreadable or negative quantity raises ``InvalidRequestError`` naming where
    it is (a pod to place); otherwise it counts as 0 (a pod the API server admitted).
    """
    key = pod_key(pod)
    spec = as_object(pod.get("spec"))

    def read(resources: object, where: str) -> tuple[int, int]:
        values = as_object(resources)
        out = [0, 0]
        for i, (name, scale) in enumerate((("cpu", 1000), ("memory", 1))):
            raw = _requested(values, name)
            if raw is None:
                continue
            try:
                q = parse_quantity(raw)
                if q < 0:
                    raise ValueError(f"{name} {short_repr(raw)} is negative")
            except ValueError as e:
                if strict:
                    raise InvalidRequestError(key, f"{where}: {e}") from None
                continue
            out[i] = math.ceil(q * scale)  # kube's MilliValue/Value round up
        return out[0], out[1]

    def container(c: Mapping[str, Any], i: int) -> tuple[int, int]:
        return read(c.get("resources"), f"container {short_repr(str(c.get('name', i)))}")

    cpu, mem = 0, 0
    for i, c in enumerate(_listed(spec, "containers")):
        c_cpu, c_mem = container(c, i)
        cpu, mem = cpu + c_cpu, mem + c_mem
    sidecar_cpu = sidecar_mem = init_cpu = init_mem = 0
    for i, c in enumerate(_listed(spec, "initContainers")):
        c_cpu, c_mem = container(c, i)
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside what starts after it
            cpu, mem = cpu + c_cpu, mem + c_mem
            sidecar_cpu, sidecar_mem = sidecar_cpu + c_cpu, sidecar_mem + c_mem
            c_cpu, c_mem = sidecar_cpu, sidecar_mem
        else:
            c_cpu, c_mem = c_cpu + sidecar_cpu, c_mem + sidecar_mem
        init_cpu, init_mem = max(init_cpu, c_cpu), max(init_mem, c_mem)
    cpu, mem = max(cpu, init_cpu), max(mem, init_mem)
    pod_level = as_object(spec.get("resources"))
    if pod_level:
        level_cpu, level_mem = read(pod_level, "spec.resources")
        if _requested(as_object(pod_level), "cpu") is not None:
            cpu = level_cpu
        if _requested(as_object(pod_level), "memory") is not None:
            mem = level_mem
    overhead_cpu, overhead_mem = read({"requests": spec.get("overhead")}, "spec.overhead")
    return cpu + overhead_cpu, mem + overhead_mem


def _requested(resources: Mapping[str, Any], name: str) -> object | None:
    """A resource's request in ``resources`` (``requests``/``limits``), else its limit."""
    for section in ("requests", "limits"):
        values = as_object(resources.get(section))
        if name in values:
            return cast("object", values[name])
    return None


def _listed(spec: Mapping[str, Any], field_name: str) -> list[dict[str, Any]]:
    items = spec.get(field_name)
    return [as_object(c) for c in items] if isinstance(items, list) else []


def _int_resource(key: str, cname: str, name: str, raw: object, lo: int, hi: int) -> int:
    try:
        q = parse_quantity(raw)
    except ValueError as e:
        raise InvalidRequestError(key, f"container {short_repr(cname)}: {name}: {e}") from None
    if q != q.to_integral_value():
        raise InvalidRequestError(
            key,
            f"container {short_repr(cname)}: {name} must be a whole number, got {short_repr(raw)}",
        )
    v = int(q)
    if not lo <= v <= hi:
        raise InvalidRequestError(
            key, f"container {short_repr(cname)}: {name} = {v} must be between {lo} and {hi}"
        )
    return v


def _csv(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(x.strip() for x in value.split(",") if x.strip())


def parse_request(pod: Mapping[str, Any], config: DeviceConfig) -> PodRequest:
    """What the pod asks for; InvalidRequestError names the container and resource."""
    key = pod_key(pod)
    meta = as_object(pod.get("metadata"))
    annotations = annotations_of(pod)
    containers = all_containers(pod)
    requests: list[ContainerRequest] = []
    cpu_milli, memory_bytes = host_requests(pod, strict=True)
    for i, c in enumerate(containers):
        cname = str(c.get("name", i))
        count_raw = _resource(c, config.resource_count_name)
        mem_raw = _resource(c, config.resource_memory_name)
        pct_raw = _resource(c, config.resource_memory_percentage_name)
        cores_raw = _resource(c, config.resource_core_name)
        if count_raw is None and mem_raw is None and pct_raw is None and cores_raw is None:
            continue
        count = (
            _int_resource(key, cname, config.resource_count_name, count_raw, 0, 64)
            if count_raw is not None
            else config.default_gpu_num
        )
        if count == 0:
            if mem_raw is not None or pct_raw is not None or cores_raw is not None:
                raise InvalidRequestError(
                    key,
                    f"container {short_repr(cname)}: asks for GPU memory or cores with "
                    f"{config.resource_count_name}: 0",
                )
            continue
        if mem_raw is not None and pct_raw is not None:
            raise InvalidRequestError(
                key,
                f"container {short_repr(cname)}: set either {config.resource_memory_name} or "
                f"{config.resource_memory_percentage_name}, not both",
            )
        # 0 is "not asked" for both, as HAMi reads them; gpumem is in units of memoryFactor MiB.
        factor = config.memory_factor
        mem = (
            factor
            * _int_resource(
                key, cname, config.resource_memory_name, mem_raw, 0, (2**31 - 1) // factor
            )
            if mem_raw is not None
            else 0
        )
        pct = (
            _int_resource(key, cname, config.resource_memory_percentage_name, pct_raw, 0, 100)
            if pct_raw is not None
            else 0
        )
        if mem == 0 and pct == 0:
            if config.default_memory:
                mem = config.default_memory
            else:
                pct = 100
        cores = (
            _int_resource(key, cname, config.resource_core_name, cores_raw, 0, 100)
            if cores_raw is not None
            else config.default_cores
        )
        requests.append(ContainerRequest(i, cname, count, mem, pct, cores))

    modes: frozenset[GpuMode] | None = None
    mode_raw = annotations.get(ann.VGPU_MODE)
    if mode_raw is not None:
        modes = modes_named(mode_raw)
        if not modes:
            raise InvalidRequestError(
                key,
                f"annotation {ann.VGPU_MODE}: {short_repr(mode_raw)} names none of "
                f"{', '.join(GPU_MODES)} (several may be given, e.g. hami-core,mig)",
            )
    numa_bind = False
    numa_raw = annotations.get(ann.NUMA_BIND)
    if numa_raw is not None:
        parsed = parse_go_bool(numa_raw)
        if parsed is None:
            raise InvalidRequestError(
                key, f"annotation {ann.NUMA_BIND}: {short_repr(numa_raw)} is not true or false"
            )
        numa_bind = parsed
    try:
        node_policy = Policy.parse(
            annotations.get(ann.NODE_POLICY) or config.default_node_policy.value,
            what=f"annotation {ann.NODE_POLICY}",
        )
    except ValueError as e:
        raise InvalidRequestError(key, str(e)) from None
    try:
        gpu_policy = GpuPolicy.parse(
            annotations.get(ann.GPU_POLICY, ""), default=config.default_gpu_policy
        )
    except ValueError as e:
        raise InvalidRequestError(key, f"annotation {ann.GPU_POLICY}: {e}") from None
    weights = ScoringWeights()
    weights_raw = annotations.get(ann.SCORING_WEIGHTS)
    if weights_raw is not None:
        try:
            weights = ScoringWeights.parse(weights_raw)
        except ValueError as e:
            raise InvalidRequestError(key, f"annotation {ann.SCORING_WEIGHTS}: {e}") from None
    if numa_bind:
        gpu_policy = gpu_policy.numa_first()
    return PodRequest(
        key=key,
        uid=str(meta.get("uid", "")),
        containers=tuple(requests),
        container_count=len(containers),
        modes=modes,
        node_policy=node_policy,
        gpu_policy=gpu_policy,
        gpu_policy_named=bool(annotations.get(ann.GPU_POLICY, "").strip()),
        numa_bind=numa_bind,
        weights=weights,
        use_types=_csv(annotations.get(ann.USE_GPUTYPE)),
        nouse_types=_csv(annotations.get(ann.NOUSE_GPUTYPE)),
        use_uuids=_csv(annotations.get(ann.USE_GPUUUID)),
        nouse_uuids=_csv(annotations.get(ann.NOUSE_GPUUUID)),
        cpu_milli=cpu_milli,
        memory_bytes=memory_bytes,
        priority=pod_priority(pod),
    )


@dataclass(frozen=True)
class PodAllocation:
    """What a bound (or assumed) pod holds on its node, as counted by the scheduler."""

    key: str
    node: str
    devices: tuple[DeviceAlloc, ...]  # hami-core devices (MIG devices excluded)
    mig: tuple[MigAllocation, ...]
    cpu_milli: int = 0
    memory_bytes: int = 0
    # The pod's hami.io/vgpu-devices-allocated as the API shows it (the string the cache keeps
    # anyway; "" for a reservation not seen on the pod yet): HAMi's per-container metrics
    # report each of its devices. Not part of what the pod holds.
    devices_written: str = field(default="", compare=False)
    # Who holds it, for preemption (which pods may make room for a pod, named by uid by
    # kube-scheduler's dry runs). Not part of what the pod holds either: a reservation that
    # the watch confirms with the same devices stays the same allocation.
    uid: str = field(default="", compare=False)
    priority: int = field(default=0, compare=False)

    @property
    def holds_gpus(self) -> bool:
        """It holds GPU devices (what preempting it can free for Tessera's pods)."""
        return bool(self.devices or self.mig)


def counts_against_capacity(pod: Mapping[str, Any]) -> bool:
    """Succeeded/Failed pods hold nothing; terminating pods still do."""
    return not finished(pod)


def parse_allocation(pod: Mapping[str, Any]) -> PodAllocation | None:
    """The allocation of a pod placed on a node, or None if it holds no GPUs.

    Raises InvalidAnnotationError when the recorded annotations are malformed.
    """
    spec = as_object(pod.get("spec"))
    annotations = annotations_of(pod)
    node = spec.get("nodeName") or annotations.get(ann.VGPU_NODE) or ""
    if not isinstance(node, str) or not node:
        return None
    key = pod_key(pod)
    devices: PodDevices = ()
    if ann.DEVICES_ALLOCATED in annotations:
        devices = decode_devices(annotations[ann.DEVICES_ALLOCATED], obj=f"pod {key}")
    mig: tuple[MigAllocation, ...] = ()
    if ann.MIG_ALLOCATIONS in annotations:
        mig = decode_mig_allocations(annotations[ann.MIG_ALLOCATIONS], obj=f"pod {key}")
    mig_slots = {(m.container_index, m.device_index) for m in mig}
    shared = tuple(
        d
        for ci, container in enumerate(devices)
        for di, d in enumerate(container)
        if (ci, di) not in mig_slots
    )
    # The API server validated these; a bad one only counts 0.
    cpu_milli, memory_bytes = host_requests(pod, strict=False)
    if not shared and not mig and not cpu_milli and not memory_bytes:
        return None
    written = annotations.get(ann.DEVICES_ALLOCATED, "")
    uid = as_object(pod.get("metadata")).get("uid")
    return PodAllocation(
        key,
        node,
        shared,
        mig,
        cpu_milli,
        memory_bytes,
        written,
        uid=uid if isinstance(uid, str) else "",
        priority=pod_priority(pod),
    )
