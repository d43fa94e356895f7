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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from api.errors import InvalidAnnotationError
from api.hami.devices import (
    ContainerDevices,
    PodDevices,
    decode_bind_time,
    decode_devices,
)
from api.hami.keys import BIND_PHASE, BIND_TIME, DEVICES_TO_ALLOCATE, VGPU_NODE
from api.kube.objects import annotations_of, as_object, finished, pod_key


@dataclass(frozen=True)
class Match:
    """The pod an Allocate request is for, and which of its containers."""

    pod: Mapping[str, Any]
    key: str  # namespace/name
    container_index: int
    devices: ContainerDevices


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
