"""Which pod a kubelet Allocate call is for, found without a node-wide lock.

The kubelet's AllocateRequest carries device ids only (``<gpu uuid>-<slot>``, ids this
agent advertised), never the pod. HAMi serializes every bind on a node behind a node
annotation lock to know the pod; Tessera instead matches the request against the pods
the scheduler has bound here and that wait for allocation.

The rule (one container request at a time):

1. Candidates: pods bound to this node (``spec.nodeName`` or ``hami.io/vgpu-node``) with
   ``hami.io/bind-phase: allocating``, not being deleted, not Succeeded/Failed.
2. A candidate's *next container* is the first container (pod order, init containers
   first) whose ``hami.io/vgpu-devices-to-allocate`` entry is non-empty; the node agent
   empties each entry once it has allocated that container.
3. A candidate matches when the GPU UUIDs of its next container's entry, counted with
   multiplicity, equal the GPU UUIDs of the request's device ids (so both the device
   count and the set of GPUs agree).
4. One match: that pod. Several: if exactly one of them is *in progress* (one of its GPU
   containers is already allocated), that one, because the kubelet admits one pod at a
   time and allocates all of its containers before the next pod. Otherwise the request
   is ambiguous and Allocate fails (the kubelet's retry, or the scheduler's serialization,
   resolves it) instead of guessing. Matches are reported in kubelet admission order
   (``hami.io/bind-time``, then creation time).

What it cannot tell apart: two allocating pods on one node whose next containers ask for
the same GPUs the same number of times (e.g. both ``nvidia.com/gpu: 1`` on GPU-A), neither
in progress. :func:`ambiguous` says whether two pods could ever be in that situation, so
the scheduler can keep such a pair from being allocating on one node at the same time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.deviceplugin.ids import gpu_of
from scheduler_plugins.annotations import (
    BIND_PHASE,
    BIND_TIME,
    DEVICES_ALLOCATED,
    DEVICES_TO_ALLOCATE,
    VGPU_NODE,
)
from scheduler_plugins.errors import InvalidAnnotationError, TemporaryError
from scheduler_plugins.pod_annotations import (
    ContainerDevices,
    PodDevices,
    decode_bind_time,
    decode_devices,
)


class PodMatchError(TemporaryError):
    """No single pod can be named for an Allocate request; the kubelet should retry."""


class NoMatchingPodError(PodMatchError):
    """No allocating pod on this node waits for exactly these GPUs."""


class AmbiguousPodError(PodMatchError):
    """Several allocating pods wait for exactly these GPUs; refusing to guess."""


@dataclass(frozen=True)
class Match:
    """The pod an Allocate request is for, and which of its containers."""

    pod: Mapping[str, Any]
    key: str  # namespace/name
    container_index: int
    devices: ContainerDevices


def requested_gpus(device_ids: Iterable[str]) -> Counter[str]:
    """GPU UUIDs of the request's device ids, with multiplicity (InvalidDeviceIdError)."""
    return Counter(gpu_of(d)[0] for d in device_ids)


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


def annotations_of(pod: Mapping[str, Any]) -> Mapping[str, str]:
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    return ann if isinstance(ann, Mapping) else {}


def is_candidate(pod: Mapping[str, Any], node_name: str) -> bool:
    """Bound to ``node_name``, waiting for allocation, alive."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ann = annotations_of(pod)
    bound = spec.get("nodeName") == node_name or ann.get(VGPU_NODE) == node_name
    return (
        bound
        and ann.get(BIND_PHASE) == "allocating"
        and not meta.get("deletionTimestamp")
        and status.get("phase") not in ("Succeeded", "Failed")
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


def in_progress(annotations: Mapping[str, str], *, obj: str = "") -> bool:
    """Some GPU container of the pod is allocated already while others still wait."""
    pending = to_allocate(annotations, obj=obj)
    allocated = decode_devices(annotations.get(DEVICES_ALLOCATED, ""), obj=obj)
    done = any(allocated[i] and not pending[i] for i in range(min(len(pending), len(allocated))))
    return done and any(pending)


def admission_order(pod: Mapping[str, Any]) -> tuple[float, str, str]:
    """Sort key: bind time (unknown last), creation time, namespace/name."""
    ann = annotations_of(pod)
    try:
        bind_time: float = decode_bind_time(ann.get(BIND_TIME, ""))
    except InvalidAnnotationError:
        bind_time = math.inf
    created = str((pod.get("metadata") or {}).get("creationTimestamp") or "")
    return bind_time, created, pod_key(pod)


def match_pod(
    pods: Iterable[Mapping[str, Any]], node_name: str, device_ids: Sequence[str]
) -> Match:
    """The pod and container one container request of an Allocate call is for."""
    wanted = requested_gpus(device_ids)
    if not wanted:
        raise NoMatchingPodError("the Allocate request names no devices")
    matches: list[Match] = []
    skipped: list[str] = []
    for pod in sorted((p for p in pods if is_candidate(p, node_name)), key=admission_order):
        key = pod_key(pod)
        try:
            nxt = next_container(annotations_of(pod), obj=key)
        except InvalidAnnotationError as e:
            skipped.append(str(e))
            continue
        if nxt is not None and Counter(d.uuid for d in nxt[1]) == wanted:
            matches.append(Match(pod, key, nxt[0], nxt[1]))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        extra = (
            f"; skipped pods with malformed annotations: {'; '.join(skipped)}" if skipped else ""
        )
        raise NoMatchingPodError(
            f"no pod on node {node_name} with {BIND_PHASE}=allocating waits for "
            f"{_describe(wanted)}{extra}"
        )
    started = [m for m in matches if _in_progress_safe(m)]
    if len(started) == 1:
        return started[0]
    raise AmbiguousPodError(
        f"pods {', '.join(m.key for m in matches)} on node {node_name} all wait for "
        f"{_describe(wanted)}; refusing to guess (the scheduler serializes such pods)"
    )


def ambiguous(pod_a_annotations: Mapping[str, str], pod_b_annotations: Mapping[str, str]) -> bool:
    """Could an Allocate for one of these pods be mistaken for the other on one node?

    Pure, for the scheduler: True when some not-yet-allocated container of one pod asks
    for the same GPUs (with multiplicity) as some not-yet-allocated container of the other.
    Every remaining container counts, not just the next one, because each pod's next
    container moves on as the kubelet admits it. Unreadable annotations count as
    ambiguous (the safe answer is to serialize).
    """
    try:
        a = to_allocate(pod_a_annotations)
        b = to_allocate(pod_b_annotations)
    except InvalidAnnotationError:
        return True
    sets_a = {_frozen(c) for c in a if c}
    return any(_frozen(c) in sets_a for c in b if c)


def _frozen(entry: ContainerDevices) -> frozenset[tuple[str, int]]:
    return frozenset(Counter(d.uuid for d in entry).items())


def _in_progress_safe(m: Match) -> bool:
    try:
        return in_progress(annotations_of(m.pod), obj=m.key)
    except InvalidAnnotationError:
        return False


def _describe(wanted: Counter[str]) -> str:
    return ", ".join(f"{uuid}×{n}" if n > 1 else uuid for uuid, n in sorted(wanted.items()))
