"""Which allocating pod a node agent can tell apart from another: the rule both sides keep.

The kubelet's Allocate request names device ids only, never the pod. The node agent finds
the pod by the one thing the request carries that the scheduler decided: how many devices the
container asks (``node_agent.pod_matching`` applies the rule to a request); the scheduler
keeps two pods it could not tell apart from allocating on one node at the same time
(``ambiguous``).

1. Candidates: pods bound to this node (``spec.nodeName`` or ``hami.io/vgpu-node``) with
   ``hami.io/bind-phase: allocating``, not being deleted, not Succeeded/Failed.
2. A candidate's *next container* is the first container (pod order, init containers
   first) whose ``hami.io/vgpu-devices-to-allocate`` entry is non-empty; the node agent
   empties each entry once it has allocated that container.
3. A candidate matches a request of ``n`` device ids when its next container asks ``n``
   devices; candidates are taken in kubelet admission order (``hami.io/bind-time``, then
   creation time).
4. Several matches are *interchangeable* when they share one ``interchange_key``: each has a
   single GPU container whose entry differs from the others' only in its GPU UUIDs, and the
   same GPU selectors and container resources and HAMi-core switches; a MIG container's
   reservation (``hami.io/vgpu-mig-allocations``, nothing realized yet) differs only in its
   GPUs and placements, the same profile for each device. Any of them may be handed the
   request: whichever pod the kubelet is admitting gets limits and settings (or a MIG
   instance of the profile) equal to its own, and the per-GPU sums and the set of reserved
   placements the scheduler counts do not change. The node agent hands out the one whose
   GPUs the request's ids name and later corrects the recorded GPUs (and MIG instances)
   from the kubelet's PodResources (which pod holds which ids); the scheduler lets such
   pods allocate on one node at once.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from api.errors import InvalidAnnotationError
from api.hami.devices import (
    ContainerDevices,
    MigAllocation,
    PodDevices,
    container_mig,
    decode_bind_time,
    decode_devices,
    decode_mig_allocations,
)
from api.hami.keys import (
    BIND_PHASE,
    BIND_TIME,
    DEVICES_ALLOCATED,
    DEVICES_TO_ALLOCATE,
    MIG_ALLOCATIONS,
    NOUSE_GPUTYPE,
    NOUSE_GPUUUID,
    NUMA_BIND,
    USE_GPUTYPE,
    USE_GPUUUID,
    VGPU_MODE,
    VGPU_NODE,
)
from api.kube.objects import all_containers, annotations_of, as_object, finished, pod_key


@dataclass(frozen=True)
class Match:
    """The pod an Allocate request is for, and which of its containers."""

    pod: Mapping[str, Any]
    key: str  # namespace/name
    container_index: int
    devices: ContainerDevices
    # The other candidates this one was chosen among (interchangeable with it, rule 4).
    siblings: tuple[str, ...] = ()


def is_candidate(pod: Mapping[str, Any], node_name: str) -> bool:
    """Bound to ``node_name``, waiting for allocation, alive."""
    if not isinstance(pod, Mapping):
        return False
    meta = as_object(pod.get("metadata"))
    spec = as_object(pod.get("spec"))
    ann = annotations_of(pod)
    bound = spec.get("nodeName") == node_name or ann.get(VGPU_NODE) == node_name
    return (
        bound
        and ann.get(BIND_PHASE) == "allocating"
        and not meta.get("deletionTimestamp")
        and not finished(pod)
    )


def to_allocate(annotations: Mapping[str, str], *, obj: str = "") -> PodDevices:
    return decode_devices(
        annotations.get(DEVICES_TO_ALLOCATE, ""), key=DEVICES_TO_ALLOCATE, obj=obj
    )


def next_container(
    annotations: Mapping[str, str], *, obj: str = ""
) -> tuple[int, ContainerDevices] | None:
    """(index, entry) of the first container still to allocate; None when all are done."""
    for index, entry in enumerate(to_allocate(annotations, obj=obj)):
        if entry:
            return index, entry
    return None


def admission_order(pod: Mapping[str, Any]) -> tuple[float, str, str]:
    """Sort key: bind time (unknown last), creation time, namespace/name."""
    ann = annotations_of(pod)
    try:
        bind_time: float = decode_bind_time(ann.get(BIND_TIME, ""))
    except InvalidAnnotationError:
        bind_time = math.inf
    created = str(as_object(pod.get("metadata")).get("creationTimestamp") or "")
    return bind_time, created, pod_key(pod)


def ambiguous(
    pod_a_annotations: Mapping[str, str],
    pod_b_annotations: Mapping[str, str],
    *,
    keys: tuple[str | None, str | None] = (None, None),
) -> bool:
    """Could an Allocate for one of these pods be mistaken for the other on one node, with
    a different outcome?

    Pure, for the scheduler: True when some not-yet-allocated container of one pod asks
    the same number of devices as some not-yet-allocated container of the other, whatever
    their GPUs (the kubelet's request only shows the count), unless the two are
    interchangeable (``keys``: their ``interchange_key``s, equal and not None). Every
    remaining container counts, not just the next one, because each pod's next container
    moves on as the kubelet admits it. Unreadable annotations count as ambiguous (the safe
    answer is to serialize).
    """
    if interchangeable(*keys):
        return False
    try:
        a = to_allocate(pod_a_annotations)
        b = to_allocate(pod_b_annotations)
    except InvalidAnnotationError:
        return True
    counts_a = {len(c) for c in a if c}
    return any(len(c) in counts_a for c in b if c)


def interchangeable(key_a: str | None, key_b: str | None) -> bool:
    return key_a is not None and key_a == key_b


# What the node agent's Allocate answer depends on besides the entry: the GPU selectors
# (so either pod may stand on the other's GPUs), and per container its extended resources
# (GPU count, memory, cores, task priority; not CPU, memory or storage, which the node's
# accounting keeps per pod whoever holds which GPU) and HAMi-core's switch.
_SELECTORS = (USE_GPUTYPE, NOUSE_GPUTYPE, USE_GPUUUID, NOUSE_GPUUUID, NUMA_BIND, VGPU_MODE)
_CONTROL_ENV = "CUDA_DISABLE_CONTROL"
_HOST_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def _device_resources(container: Mapping[str, Any]) -> dict[str, Any]:
    resources = as_object(container.get("resources"))
    out: dict[str, Any] = {}
    for section in ("limits", "requests"):
        values = as_object(resources.get(section))
        out[section] = {
            k: v
            for k, v in values.items()
            if k not in _HOST_RESOURCES and not str(k).startswith("hugepages-")
        }
    return out


def interchange_key(
    pod: Mapping[str, Any], bind_annotations: Mapping[str, str] | None = None
) -> str | None:
    """What makes a pod interchangeable with another on its node (rule 4), as a string equal
    for interchangeable pods; None when the pod may not be swapped with any.

    ``bind_annotations`` (the scheduler's, before they are on the pod) override the pod's.
    None unless the pod has exactly one GPU container, not yet allocated, whose MIG
    reservation (if any) covers its devices and holds no instance yet, and everything read
    parses."""
    ann = {**annotations_of(pod), **(bind_annotations or {})}
    try:
        held = decode_devices(ann.get(DEVICES_ALLOCATED, ""))
        pending = to_allocate(ann)
        mig = decode_mig_allocations(ann[MIG_ALLOCATIONS]) if ann.get(MIG_ALLOCATIONS) else ()
    except InvalidAnnotationError:
        return None
    gpu = [i for i, c in enumerate(held) if c]
    if len(gpu) != 1 or len(pending) != len(held) or pending[gpu[0]] != held[gpu[0]]:
        return None
    ci = gpu[0]
    profiles = _mig_profiles(mig, ci, len(held[ci]))
    if mig and profiles is None:
        return None
    containers = all_containers(pod)
    if ci >= len(containers):
        return None
    container = containers[ci]
    env = container.get("env")
    control = [
        e.get("value")
        for e in (env if isinstance(env, list) else [])
        if isinstance(e, Mapping) and e.get("name") == _CONTROL_ENV
    ]
    shape = {
        "container": ci,
        "devices": [[d.vendor, d.mem, d.cores, d.legacy] for d in held[ci]],
        "selectors": [ann.get(k) for k in _SELECTORS],
        "resources": _device_resources(container),
        "control": control,
        "mig": profiles,
    }
    try:
        text = json.dumps(shape, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _mig_profiles(mig: tuple[MigAllocation, ...], ci: int, devices: int) -> list[str] | None:
    """The profile of each device of container ``ci`` when ``mig`` reserves exactly its
    ``devices`` devices and none is realized yet; else None (a pod halfway through its
    allocation, or a reservation the entry does not match, is nobody's twin)."""
    mine = container_mig(mig, ci)
    if (
        len(mine) != len(mig)
        or [a.device_index for a in mine] != list(range(devices))
        or any(a.runtime is not None for a in mine)
    ):
        return None
    return [a.profile for a in mine]


def asking(
    pods: Iterable[Mapping[str, Any]], node_name: str, size: int
) -> tuple[list[Match], list[str]]:
    """Candidates whose next container asks ``size`` devices (admission order), and the
    candidates whose annotations could not be read."""
    matches: list[Match] = []
    unreadable: list[str] = []
    for pod in sorted((p for p in pods if is_candidate(p, node_name)), key=admission_order):
        key = pod_key(pod)
        try:
            nxt = next_container(annotations_of(pod), obj=key)
        except InvalidAnnotationError as e:
            unreadable.append(str(e))
            continue
        if nxt is not None and len(nxt[1]) == size:
            matches.append(Match(pod, key, nxt[0], nxt[1]))
    return matches, unreadable


def choose(matches: list[Match], gpus: Mapping[str, int] | None = None) -> Match | None:
    """One of several ``matches`` when they are all interchangeable (rule 4), else None:
    the first (admission order) whose GPUs are ``gpus`` (with multiplicity; the request's
    ids), else the first. Its ``siblings`` name the others."""
    if len(matches) < 2:
        return None
    first = interchange_key(matches[0].pod)
    if first is None or any(interchange_key(m.pod) != first for m in matches[1:]):
        return None
    chosen = matches[0]
    if gpus is not None:
        wanted = dict(gpus)
        for m in matches:
            have: dict[str, int] = {}
            for d in m.devices:
                have[d.uuid] = have.get(d.uuid, 0) + 1
            if have == wanted:
                chosen = m
                break
    siblings = tuple(m.key for m in matches if m is not chosen)
    return Match(chosen.pod, chosen.key, chosen.container_index, chosen.devices, siblings)
