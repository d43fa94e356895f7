"""Which pod a kubelet Allocate call is for, found without a node-wide lock.

The kubelet's PreferredAllocationRequest and AllocateRequest carry device ids only
(``<gpu uuid>-<slot>``, ids this agent advertised), never the pod, and the kubelet takes
the ids of an Allocate from what GetPreferredAllocation answered (or picks its own when
the answer is short). HAMi serializes every bind on a node behind a node annotation lock to
know the pod; Tessera instead identifies the pod by the one thing the request does carry
that the scheduler decided: the number of devices the container asks.

The rule (one container request at a time):

1. Candidates: pods bound to this node (``spec.nodeName`` or ``hami.io/vgpu-node``) with
   ``hami.io/bind-phase: allocating``, not being deleted, not Succeeded/Failed.
2. A candidate's *next container* is the first container (pod order, init containers
   first) whose ``hami.io/vgpu-devices-to-allocate`` entry is non-empty; the node agent
   empties each entry once it has allocated that container.
3. A candidate matches a request of ``n`` device ids when its next container asks ``n``
   devices. The GPU UUIDs of the ids do not decide anything: they are only right when
   GetPreferredAllocation steered the kubelet to them, which it can only do for the same
   unique candidate (step 5), so matching on them would add no certainty.
4. Exactly one match: that pod. Several, or a candidate whose annotations cannot be read
   (it might be the one): the request is ambiguous and Allocate fails with
   ``AmbiguousPodError`` instead of guessing. Pods are reported in kubelet admission order
   (``hami.io/bind-time``, then creation time).
5. GetPreferredAllocation (``preferred_gpus``) applies the same rule to its
   ``allocation_size``: when exactly one candidate's next container asks that many devices,
   the preferred ids are slots of the GPUs that container reserved (with multiplicity), so
   the kubelet's slot accounting follows the scheduler's; otherwise the agent falls back to
   spreading over GPUs (``ids.prefer_spread``).

Whatever pod is matched, the devices and limits handed out come from *that pod's* own
to-allocate entry, never from the request's ids or from another pod.

What it cannot tell apart: two allocating pods on one node whose next containers ask the
same device count, whatever their GPUs (e.g. both ``nvidia.com/gpu: 1``, one on GPU-A and
one on GPU-B). Pods whose next containers ask different device counts are told apart and
bind concurrently on one node. :func:`ambiguous` says whether two pods could ever be in
that situation (any of their remaining containers asks the same count), so the scheduler
keeps exactly such pairs from being allocating on one node at the same time.
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


def as_object(value: object) -> Mapping[str, Any]:
    """A JSON object field, or {} when it is missing or not an object."""
    return value if isinstance(value, Mapping) else {}


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = as_object(pod.get("metadata"))
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


def annotations_of(pod: Mapping[str, Any]) -> Mapping[str, str]:
    """The pod's annotations; non-string values (never from the API server) are left out."""
    ann = as_object(as_object(pod.get("metadata")).get("annotations"))
    return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)}


def is_candidate(pod: Mapping[str, Any], node_name: str) -> bool:
    """Bound to ``node_name``, waiting for allocation, alive."""
    if not isinstance(pod, Mapping):
        return False
    meta = as_object(pod.get("metadata"))
    spec = as_object(pod.get("spec"))
    status = as_object(pod.get("status"))
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


def admission_order(pod: Mapping[str, Any]) -> tuple[float, str, str]:
    """Sort key: bind time (unknown last), creation time, namespace/name."""
    ann = annotations_of(pod)
    try:
        bind_time: float = decode_bind_time(ann.get(BIND_TIME, ""))
    except InvalidAnnotationError:
        bind_time = math.inf
    created = str(as_object(pod.get("metadata")).get("creationTimestamp") or "")
    return bind_time, created, pod_key(pod)


def match_pod(
    pods: Iterable[Mapping[str, Any]], node_name: str, device_ids: Sequence[str]
) -> Match:
    """The pod and container one container request of an Allocate call is for."""
    wanted = requested_gpus(device_ids)  # validates the ids
    size = len(device_ids)
    if not size:
        raise NoMatchingPodError("the Allocate request names no devices")
    matches, unreadable = _asking(pods, node_name, size)
    if len(matches) == 1 and not unreadable:
        return matches[0]
    if not matches:
        extra = (
            f"; skipped pods with unreadable annotations: {'; '.join(unreadable)}"
            if unreadable
            else ""
        )
        raise NoMatchingPodError(
            f"no pod on node {node_name} with {BIND_PHASE}=allocating has a next GPU "
            f"container asking {size} device(s) (request: {_describe(wanted)[:300]}){extra[:600]}"
        )
    who = ", ".join(m.key for m in matches)
    extra = f"; pods with unreadable annotations: {'; '.join(unreadable)}" if unreadable else ""
    raise AmbiguousPodError(
        f"pods {who} on node {node_name} all wait to allocate a container asking {size} "
        f"device(s){extra}; refusing to guess (the scheduler serializes such pods)"
    )


def preferred_gpus(
    pods: Iterable[Mapping[str, Any]], node_name: str, size: int
) -> Counter[str] | None:
    """GPU UUIDs (with multiplicity) GetPreferredAllocation should steer ``size`` ids to.

    Those of the next container of the unique candidate whose next container asks ``size``
    devices; None when there is no such unique candidate (or a candidate is unreadable).
    """
    if size <= 0:
        return None
    matches, unreadable = _asking(pods, node_name, size)
    if len(matches) != 1 or unreadable:
        return None
    return Counter(d.uuid for d in matches[0].devices)


def ambiguous(pod_a_annotations: Mapping[str, str], pod_b_annotations: Mapping[str, str]) -> bool:
    """Could an Allocate for one of these pods be mistaken for the other on one node?

    Pure, for the scheduler: True when some not-yet-allocated container of one pod asks
    the same number of devices as some not-yet-allocated container of the other, whatever
    their GPUs (the kubelet's request only shows the count). Every remaining container
    counts, not just the next one, because each pod's next container moves on as the
    kubelet admits it. Unreadable annotations count as ambiguous (the safe answer is to
    serialize).
    """
    try:
        a = to_allocate(pod_a_annotations)
        b = to_allocate(pod_b_annotations)
    except InvalidAnnotationError:
        return True
    counts_a = {len(c) for c in a if c}
    return any(len(c) in counts_a for c in b if c)


def _asking(
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


def _describe(wanted: Counter[str]) -> str:
    return ", ".join(f"{uuid}×{n}" if n > 1 else uuid for uuid, n in sorted(wanted.items()))
