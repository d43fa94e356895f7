"""Cluster-wide allocation invariants, checked from what the API shows (nodes + pods).

``capacity_violations`` rebuilds a ``ClusterState`` the way a restarted plugin server would
(``parse_node``, ``parse_allocation``, ``counts_against_capacity``) and reports MIG placement
overlaps and over-committed GPUs. ``annotation_violations`` checks each bound GPU pod's
annotations: complete, decodable, naming GPUs of its own node in the right mode, and
(after ``bind-phase: success``) carrying the MIG runtime identities.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scheduler_plugins import annotations as ann
from scheduler_plugins.config import DeviceConfig
from scheduler_plugins.errors import InvalidInputError
from scheduler_plugins.node_register import GpuDevice
from scheduler_plugins.nodes import parse_node
from scheduler_plugins.pod_annotations import decode_devices, decode_mig_allocations
from scheduler_plugins.pods import (
    all_containers,
    counts_against_capacity,
    parse_allocation,
    parse_request,
    pod_key,
)
from scheduler_plugins.state import ClusterState

Obj = Mapping[str, Any]


def rebuild_state(
    nodes: Iterable[Obj], pods: Iterable[Obj], config: DeviceConfig | None = None
) -> ClusterState:
    """The scheduler's accounting of ``nodes`` and ``pods`` rebuilt from scratch."""
    state = ClusterState(config or DeviceConfig())
    for node in nodes:
        info = parse_node(node)
        state.upsert_node(
            info.name, info.devices, cpu_milli=info.cpu_milli, memory_bytes=info.memory_bytes
        )
    for pod in pods:
        if counts_against_capacity(pod):
            state.upsert_pod(parse_allocation(pod), pod_key(pod))
    return state


def capacity_violations(state: ClusterState) -> list[str]:
    """Per GPU: no overlapping MIG placements, slots ≤ count, memory ≤ devmem, and for
    hami-core GPUs cores ≤ devcore (MIG profiles' core shares may add up past 100)."""
    out: list[str] = []
    g = state.gpus
    for name, entry in sorted(state.nodes.items()):
        for d in entry.devices:
            r = entry.rows[d.id]
            where = f"{name}/GPU {d.index} ({d.mode})"
            if int(g.conflict[r]) != 0:
                use = g.slice_use[r].tolist()
                out.append(f"{where}: {int(g.conflict[r])} MIG slices used twice ({use})")
            if g.used_slots[r] > d.count:
                out.append(f"{where}: {g.used_slots[r]:.0f} vGPUs > count {d.count}")
            if g.used_mem[r] > d.devmem:
                out.append(f"{where}: {g.used_mem[r]:.0f} MiB > devmem {d.devmem}")
            if d.mode == "hami-core" and g.used_cores[r] > d.devcore:
                out.append(f"{where}: {g.used_cores[r]:.0f}% cores > devcore {d.devcore}")
            if min(g.used_slots[r], g.used_mem[r], g.used_cores[r]) < 0:
                out.append(f"{where}: negative usage (a pod counted off twice?)")
    return out


def annotation_violations(pod: Obj, node_gpus: Mapping[str, tuple[GpuDevice, ...]]) -> list[str]:
    """What is wrong with a bound GPU pod's annotations (empty list: nothing)."""
    key = pod_key(pod)
    node = str(pod["spec"].get("nodeName") or "")
    a: Mapping[str, str] = pod["metadata"].get("annotations") or {}
    out: list[str] = []

    def bad(problem: str) -> None:
        out.append(f"{key} on {node}: {problem}")

    for k in (ann.VGPU_NODE, ann.BIND_TIME, ann.BIND_PHASE, ann.DEVICES_ALLOCATED):
        if k not in a:
            bad(f"missing {k}")
    if out:
        return out
    if a[ann.VGPU_NODE] != node:
        bad(f"{ann.VGPU_NODE}={a[ann.VGPU_NODE]!r} but bound to {node}")
    if a[ann.BIND_PHASE] != "success":
        bad(f"{ann.BIND_PHASE}={a[ann.BIND_PHASE]!r}, want success")
    gpus = {d.id: d for d in node_gpus.get(node, ())}
    try:
        request = parse_request(pod, DeviceConfig())
        devices = decode_devices(a[ann.DEVICES_ALLOCATED], obj=key)
        mig = (
            decode_mig_allocations(a[ann.MIG_ALLOCATIONS], obj=key)
            if ann.MIG_ALLOCATIONS in a
            else ()
        )
        if ann.DEVICES_TO_ALLOCATE in a:
            decode_devices(a[ann.DEVICES_TO_ALLOCATE], key=ann.DEVICES_TO_ALLOCATE, obj=key)
    except InvalidInputError as e:
        bad(f"undecodable: {e}")
        return out
    if a.get(ann.DEVICES_TO_ALLOCATE, "").strip(";"):
        bad(f"{ann.DEVICES_TO_ALLOCATE} not consumed after success: {a[ann.DEVICES_TO_ALLOCATE]!r}")
    if len(devices) != len(all_containers(pod)):
        bad(f"{len(devices)} container entries for {len(all_containers(pod))} containers")
    mig_slots = {(m.container_index, m.device_index): m for m in mig}
    for c in request.containers:
        got = devices[c.index] if c.index < len(devices) else ()
        if len(got) != c.count:
            bad(f"container {c.name}: {len(got)} devices for {c.count} requested")
        uuids = [d.uuid for d in got]
        for di, d in enumerate(got):
            gpu = gpus.get(d.uuid)
            if gpu is None:
                bad(f"device {d.uuid} is not a GPU of {node}")
                continue
            m = mig_slots.get((c.index, di))
            if m is None:
                if gpu.mode != "hami-core":
                    bad(f"shared device on {gpu.mode} GPU {gpu.index}")
                if d.mem != c.mem_for(gpu.devmem) or d.cores != c.cores:
                    bad(f"device {d.uuid}: {d.mem} MiB {d.cores}% for request {c}")
                if request.mode == "mig":
                    bad("asked for MIG, got a shared vGPU")
            else:
                if gpu.mode != "mig":
                    bad(f"MIG device on {gpu.mode} GPU {gpu.index}")
                if m.gpu_uuid != d.uuid:
                    bad(f"MIG allocation {m} names another GPU than device {d.uuid}")
                profile = next((p for p in gpu.mig_profiles if p.name == m.profile), None)
                if profile is None:
                    bad(f"profile {m.profile} not offered by GPU {gpu.index}")
                elif m.placement not in profile.placements:
                    bad(f"{m.profile} at {m.placement} is not a legal placement")
                elif profile.memory_mb < c.mem_for(gpu.devmem):
                    bad(f"{m.profile} ({profile.memory_mb} MiB) below {c.mem_for(gpu.devmem)} MiB")
                if m.runtime is None:
                    bad(f"MIG device {m.profile}@{m.placement} has no runtime identity")
                if request.mode == "hami-core":
                    bad("asked for hami-core, got a MIG device")
        shared = [u for di, u in enumerate(uuids) if (c.index, di) not in mig_slots]
        if len(set(shared)) != len(shared):
            bad(f"container {c.name}: one GPU twice ({shared})")
    if len(mig_slots) != len(mig):
        bad("two MIG allocations for one device slot")
    for m in mig:
        if m.container_index >= len(devices) or m.device_index >= len(devices[m.container_index]):
            bad(f"MIG allocation {m} has no device entry")
    runtimes = [m.runtime.mig_uuid for m in mig if m.runtime is not None]
    if len(set(runtimes)) != len(runtimes):
        bad(f"MIG UUID used twice: {runtimes}")
    return out
