"""MIG reservation records on pods: the node's desired set, and runtime identities written back.

``desired_from_pods`` turns the pods the API listed (plain JSON dicts) into the
``DesiredSet`` the MIG manager reconciles against: every ``hami.io/vgpu-mig-allocations``
entry of the pods on this node that are not deleting and not Succeeded/Failed, and the GPUs
those pods hold through HAMi <= v2.9 MIG slots (``GPU-…[t-s]`` in their devices), which
restart adoption must not clean. Reading is
all-or-nothing: one malformed record (bad JSON, partial runtime identity, duplicate slot,
two pods reserving overlapping placements of one GPU) makes the whole set unreadable
(``desired`` None, with the reason), because a partial set would authorize destroying
instances of the pods left out.

``container_reservations`` and ``with_runtime`` are the allocator's side: the entries of one
container in device order, and the annotation value with their runtime identities filled in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from api.errors import InvalidAnnotationError
from api.hami.devices import (
    MigAllocation,
    RuntimeIdentity,
    container_mig,
    decode_devices,
    decode_mig_allocations,
    encode_mig_allocations,
)
from api.hami.keys import DEVICES_ALLOCATED, MIG_ALLOCATIONS, VGPU_NODE
from node_agent.mig_manager import UNREADABLE, DesiredSet, Reservation

TERMINAL_PHASES: Final = ("Succeeded", "Failed")


@dataclass(frozen=True)
class DesiredRead:
    """The desired set, or None with the reason it could not be read."""

    desired: DesiredSet | None
    reason: str = ""

    @classmethod
    def unreadable(cls, reason: str = UNREADABLE) -> DesiredRead:
        return cls(None, reason)


def desired_from_pods(
    pods: Iterable[Mapping[str, Any]], *, node_name: str | None = None
) -> DesiredRead:
    """The desired set of the pods on ``node_name`` (None: the caller already filtered)."""
    reservations: list[Reservation] = []
    held: set[str] = set()
    try:
        for pod in pods:
            live = _live(pod, node_name)
            if live is None:
                continue
            key, annotations = live
            reservations.extend(_reservations(key, annotations))
            held.update(_legacy_gpus(key, annotations))
    except (InvalidAnnotationError, _MalformedPod) as e:
        return DesiredRead.unreadable(str(e))
    conflict = _overlap(reservations)
    if conflict:
        return DesiredRead.unreadable(conflict)
    return DesiredRead(DesiredSet.of(reservations, held))


class _MalformedPod(ValueError):
    pass


def _live(pod: Mapping[str, Any], node_name: str | None) -> tuple[str, Mapping[str, Any]] | None:
    """(namespace/name, annotations) of a pod that holds what it was given on ``node_name``;
    None for a deleting or finished pod, or one on another node."""
    if not isinstance(pod, Mapping):
        raise _MalformedPod(f"pod list item is not an object: {type(pod).__name__}")
    meta = _obj(pod, "metadata", "pod")
    key = f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"
    annotations = _obj(meta, "annotations", f"pod {key} metadata")
    if MIG_ALLOCATIONS not in annotations and DEVICES_ALLOCATED not in annotations:
        return None
    if meta.get("deletionTimestamp"):
        return None
    if _obj(pod, "status", f"pod {key}").get("phase") in TERMINAL_PHASES:
        return None
    if node_name is not None:
        node = _obj(pod, "spec", f"pod {key}").get("nodeName") or annotations.get(VGPU_NODE)
        if node != node_name:
            return None
    return key, annotations


def _reservations(key: str, annotations: Mapping[str, Any]) -> list[Reservation]:
    value = annotations.get(MIG_ALLOCATIONS)
    if value is None:
        return []
    if not isinstance(value, str):
        raise _MalformedPod(f"pod {key}: annotation {MIG_ALLOCATIONS} is not a string")
    return [Reservation(key, a) for a in decode_mig_allocations(value, obj=f"pod {key}")]


def _legacy_gpus(key: str, annotations: Mapping[str, Any]) -> set[str]:
    """GPUs the pod holds through MIG slots of HAMi's <= v2.9 layouts (``GPU-…[t-s]``)."""
    value = annotations.get(DEVICES_ALLOCATED)
    if value is None:
        return set()
    if not isinstance(value, str):
        raise _MalformedPod(f"pod {key}: annotation {DEVICES_ALLOCATED} is not a string")
    if "[" not in value:
        return set()  # no legacy slot (a malformed value is the scheduler's to report)
    devices = decode_devices(value, key=DEVICES_ALLOCATED, obj=f"pod {key}")
    return {d.uuid for container in devices for d in container if d.legacy is not None}


def _obj(parent: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    v = parent.get(name)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise _MalformedPod(f"{where}: {name} is not an object")
    return v


def _overlap(reservations: Sequence[Reservation]) -> str:
    """Why two reservations of one GPU overlap, or ""."""
    seen: dict[str, list[Reservation]] = {}
    for r in reservations:
        a = r.allocation
        for other in seen.get(a.gpu_uuid, []):
            if other.allocation.placement.mask & a.placement.mask:
                o = other.allocation
                return (
                    f"pod {r.pod} container {a.container_index} device {a.device_index} and pod"
                    f" {other.pod} container {o.container_index} device {o.device_index} reserve"
                    f" overlapping placements on GPU {a.gpu_uuid}"
                )
        seen.setdefault(a.gpu_uuid, []).append(r)
    return ""


def container_reservations(
    annotation_value: str, container_index: int, *, obj: str = ""
) -> tuple[MigAllocation, ...]:
    """The entries of ``container_index``, in ascending device index."""
    return container_mig(decode_mig_allocations(annotation_value, obj=obj), container_index)


def with_runtime(
    annotation_value: str,
    container_index: int,
    identities: Sequence[RuntimeIdentity],
    *,
    obj: str = "",
) -> str:
    """The annotation value with ``identities`` (in ``container_reservations`` order) filled in
    for ``container_index``; other entries and the entry order are kept."""
    allocs = decode_mig_allocations(annotation_value, obj=obj)
    mine = sorted(
        (i for i, a in enumerate(allocs) if a.container_index == container_index),
        key=lambda i: allocs[i].device_index,
    )
    if len(mine) != len(identities):
        raise InvalidAnnotationError(
            MIG_ALLOCATIONS,
            f"container {container_index} has {len(mine)} MIG entr(y/ies) but"
            f" {len(identities)} runtime identit(y/ies) were given",
            obj=obj,
        )
    out = list(allocs)
    for i, identity in zip(mine, identities, strict=True):
        out[i] = replace(allocs[i], runtime=identity)
    return encode_mig_allocations(out)
