"""Which pod really holds which GPUs, after Allocate handed out one of interchangeable pods.

When several allocating pods of a node are interchangeable (``api.hami.matching``, rule 4:
one GPU container each, entries equal but for their GPU UUIDs, same selectors, resources and
HAMi-core switch), Allocate hands the kubelet's request the entry of the one whose GPUs the
request's ids name. The container the kubelet was admitting may belong to a sibling: its
limits and settings are its own either way, but the GPUs recorded in the two pods'
``hami.io/vgpu-devices-allocated`` are then swapped, and when one of them ends the scheduler
would free the GPU the other still uses.

The kubelet knows which container got which device ids: its PodResources API
(``/var/lib/kubelet/pod-resources/kubelet.sock``, ``List``). ``IdentityFixer`` keeps the
pods of every interchangeable hand-out *pending*, with the GPUs each request's ids were
given (``handed``); ``check`` lists PodResources and, for each pending pod the kubelet
already shows, compares the GPUs its container holds with the recorded ones:

- equal: done with that pod;
- different: the record is corrected in two rounds so that no GPU is ever counted below its
  real use: first every wrong pod records its old *and* its real GPUs (a GPU is counted at
  least once by whoever holds it), then, once that holds for all of them and the kubelet
  lists every pending pod (one not listed yet may be about to get the GPUs a wrong pod
  records now), each records its real GPUs only. Each write is a merge patch under the
  pod's resourceVersion (a conflict: the next check starts over).

A MIG container (interchangeable MIG pods ask one profile per device) is handed the
instance reserved for the pod chosen; its record (``hami.io/vgpu-mig-allocations``: GPU,
placement, runtime identity) is corrected with its devices in the same two rounds, the
first writing the old instances and then the real ones (the scheduler sees an overlap and
places nothing new on those GPUs until the second). The MIG manager hands an instance to
the pod whose record names its runtime identity (``MigManager.reconcile``), so neither
round destroys what a container runs on, and keeps every instance of a hand-out until its
pods are settled (``protected``): a pod of the pair may end first, recording the instance
the other runs on.

A pod the kubelet does not show yet stays pending (checked again at the next ``check``); a
pod gone from the node is dropped. ``corrections`` is the pure rule.

What is left: the hand-out record is kept in memory, so an agent restarted between a
hand-out and its check falls back to the GPUs named by the kubelet's ids (right whenever the
kubelet took GetPreferredAllocation's ids, as it does when they are free; for a MIG
container, the second half of its double record), and only for pods whose record shows the
first round's double entry (an interrupted correction); a swap not yet checked when the
agent restarts stays as recorded.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

import grpc
import structlog

from api.errors import InvalidAnnotationError, TemporaryError, TesseraError
from api.hami.devices import (
    ContainerDevices,
    DeviceAlloc,
    MigAllocation,
    decode_devices,
    decode_mig_allocations,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.keys import DEVICES_ALLOCATED, MIG_ALLOCATIONS
from api.kube.errors import ConflictError, KubeError, NotFoundError
from api.kube.objects import all_containers, annotations_of, as_object, finished, pod_key
from api.podresources.v1 import api_pb2
from api.sockets import rpc_failure
from node_agent.deviceplugin.ids import gpu_of
from node_agent.mig_records import container_reservations

if TYPE_CHECKING:
    from node_agent.allocator import PodApi

log = structlog.get_logger(__name__)

DEFAULT_POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
_LIST: Final = "/v1.PodResourcesLister/List"
LIST_TIMEOUT_S: Final = 5.0
MAX_HANDED: Final = 4096  # hand-outs remembered (oldest forgotten first)

# (pod namespace/name, container name) -> device ids of one resource
Held = Mapping[tuple[str, str], tuple[str, ...]]


class PodResourcesError(TemporaryError):
    """The kubelet's PodResources API could not be read."""


class PodResourcesLister(Protocol):
    def list(self, resource: str) -> Held: ...


class KubeletPodResources:
    """``List`` of the kubelet's PodResources API over its unix socket."""

    def __init__(self, socket_path: str = DEFAULT_POD_RESOURCES_SOCKET) -> None:
        self.socket_path = socket_path

    def list(self, resource: str) -> Held:
        with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
            call = channel.unary_unary(
                _LIST,
                request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=api_pb2.ListPodResourcesResponse.FromString,
            )
            try:
                answer = call(api_pb2.ListPodResourcesRequest(), timeout=LIST_TIMEOUT_S)
            except grpc.RpcError as e:
                detail = rpc_failure(e)
                raise PodResourcesError(
                    f"list pod resources at {self.socket_path}: {detail}"
                ) from e
        held: dict[tuple[str, str], tuple[str, ...]] = {}
        for pod in answer.pod_resources:
            for container in pod.containers:
                ids = [
                    i
                    for d in container.devices
                    if d.resource_name == resource
                    for i in d.device_ids
                ]
                if ids:
                    held[(f"{pod.namespace}/{pod.name}", container.name)] = tuple(ids)
        return held


@dataclass(frozen=True)
class Correction:
    """Pod ``pod``'s recorded devices of container ``container``: ``before`` -> ``after``;
    for a MIG container also its instances (``mig_before`` -> ``mig_after``: its entries of
    ``hami.io/vgpu-mig-allocations``, device indexes from 0)."""

    pod: Mapping[str, Any]
    key: str
    container: int
    before: ContainerDevices
    after: ContainerDevices
    mig_before: tuple[MigAllocation, ...] = ()
    mig_after: tuple[MigAllocation, ...] = ()

    @property
    def both(self) -> ContainerDevices:
        """Old and real devices together (the first round: nothing counted below its use);
        the record as it is when it holds the real ones already."""
        if self.mig_after:
            return self.before if self._mig_doubled else (*self.shape, *self.after)
        if Counter(d.uuid for d in self.after) <= Counter(d.uuid for d in self.before):
            return self.before
        return (*self.before, *self.after)

    @property
    def mig_both(self) -> tuple[MigAllocation, ...]:
        """Old and real MIG instances together (each device of the real ones after the old
        ones), as ``both``."""
        if not self.mig_after or self._mig_doubled:
            return self.mig_before
        n = len(self.after)
        return (*self.mig_before[:n], *_numbered(self.mig_after, self.container, n))

    @property
    def shape(self) -> ContainerDevices:
        """The recorded entry as the container asks it (a first round's double cut off)."""
        return self.before[: len(self.after)]

    @property
    def _mig_doubled(self) -> bool:
        n = len(self.mig_after)
        return len(self.mig_before) == 2 * n and _same_instances(
            self.mig_before[n:], self.mig_after
        )


def gpu_container(annotations: Mapping[str, str], *, obj: str = "") -> int | None:
    """The index of the pod's only GPU container by its recorded devices (None: not one)."""
    held = decode_devices(annotations.get(DEVICES_ALLOCATED, ""), obj=obj)
    gpu = [i for i, c in enumerate(held) if c]
    return gpu[0] if len(gpu) == 1 else None


def corrections(
    pods: Iterable[Mapping[str, Any]],
    pending: Iterable[str],
    real: Callable[[tuple[str, ...]], tuple[str, ...] | None],
    held: Held,
    real_mig: Callable[[tuple[str, ...]], tuple[MigAllocation, ...] | None] = lambda ids: None,
) -> tuple[list[Correction], set[str]]:
    """What to rewrite for the ``pending`` pods, and those settled (right, corrected or gone).

    ``real``: the GPUs (in entry order) a request's ids were really given (None: unknown);
    ``real_mig``: the MIG instances they were given (None: unknown or none). A pod whose
    recorded entry holds more devices than the kubelet's ids (a first round not followed by
    its second) is corrected to its real GPUs too; for a MIG container whose hand-out is not
    known (an agent restarted since), those are the second half of that double record,
    which holds the real instances after the old ones."""
    pending = set(pending)
    out: list[Correction] = []
    settled: set[str] = set()
    alive: set[str] = set()
    for pod in pods:
        key = pod_key(pod)
        if (
            key not in pending
            or finished(pod)
            or as_object(pod.get("metadata")).get("deletionTimestamp")
        ):
            continue
        alive.add(key)
        ann = annotations_of(pod)
        try:
            ci = gpu_container(ann, obj=f"pod {key}")
            recorded = decode_devices(ann.get(DEVICES_ALLOCATED, ""), obj=f"pod {key}")
        except InvalidAnnotationError as e:
            log.warning("identity.unreadable", pod=key, error=str(e))
            settled.add(key)
            continue
        containers = all_containers(pod)
        if ci is None or ci >= len(containers):
            settled.add(key)
            continue
        ids = held.get((key, str(containers[ci].get("name", ""))))
        if ids is None:
            continue  # the kubelet has not recorded it (yet): look again
        entry = recorded[ci]
        try:
            mig = _container_mig(ann, ci, obj=f"pod {key}")
        except InvalidAnnotationError as e:
            log.warning("identity.unreadable", pod=key, error=str(e))
            settled.add(key)
            continue
        if mig:
            fix = _mig_correction(pod, key, ci, entry, mig, len(ids), real_mig(ids))
            if fix is None:
                settled.add(key)
            else:
                out.append(fix)
            continue
        gpus = real(ids)
        shape = entry[: len(ids)]
        if gpus is None or len(gpus) != len(shape):
            settled.add(key)
            continue
        if Counter(d.uuid for d in entry) == Counter(gpus) and len(entry) == len(gpus):
            settled.add(key)
            continue
        after = tuple(
            DeviceAlloc(uuid, d.mem, d.cores, d.vendor) for uuid, d in zip(gpus, shape, strict=True)
        )
        out.append(Correction(pod, key, ci, entry, after))
    settled |= {k for k in pending if k not in alive}
    return out, settled


def _container_mig(ann: Mapping[str, str], ci: int, *, obj: str) -> tuple[MigAllocation, ...]:
    """Container ``ci``'s MIG entries, by device index."""
    value = ann.get(MIG_ALLOCATIONS)
    return container_reservations(value, ci, obj=obj) if value else ()


def _mig_correction(
    pod: Mapping[str, Any],
    key: str,
    ci: int,
    entry: ContainerDevices,
    mig: tuple[MigAllocation, ...],
    n: int,
    handed: tuple[MigAllocation, ...] | None,
) -> Correction | None:
    """The correction of a MIG container whose kubelet ids are ``n`` devices, given the
    instances those ids were handed (None: unknown); None when it records them already (or
    what it holds cannot be told)."""
    if handed is None or len(handed) != n:
        if len(mig) != 2 * n or len(entry) != 2 * n:
            return None  # not a first round's double: nothing known to fix
        handed = mig[n:]  # the real instances, after the old ones
    if len(mig) == n and _same_instances(mig, handed):
        return None
    if len(entry) < n or any(a.runtime is None for a in handed):
        return None
    shape = entry[:n]
    after = tuple(
        DeviceAlloc(a.gpu_uuid, d.mem, d.cores, d.vendor)
        for a, d in zip(handed, shape, strict=True)
    )
    return Correction(pod, key, ci, entry, after, mig, _numbered(handed, ci, 0))


def _same_instances(a: Sequence[MigAllocation], b: Sequence[MigAllocation]) -> bool:
    """The same MIG instances, device for device (their runtime identities)."""
    return len(a) == len(b) and all(
        x.runtime is not None and x.runtime == y.runtime for x, y in zip(a, b, strict=True)
    )


def _numbered(allocs: Sequence[MigAllocation], ci: int, first: int) -> tuple[MigAllocation, ...]:
    return tuple(
        replace(a, container_index=ci, device_index=first + k) for k, a in enumerate(allocs)
    )


@dataclass(frozen=True)
class _Handout:
    gpus: tuple[str, ...]
    mig: tuple[MigAllocation, ...]


class IdentityFixer:
    """Pending interchangeable hand-outs of one node, checked against PodResources."""

    def __init__(
        self,
        node_name: str,
        kube: PodApi,
        lister: PodResourcesLister,
        resource_name: str,
    ) -> None:
        self.node_name = node_name
        self._kube = kube
        self._lister = lister
        self._resource = resource_name
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._handed: dict[frozenset[str], _Handout] = {}
        # MIG UUID -> the interchangeable pods it was handed out among (``protected``).
        self._guarded: dict[str, frozenset[str]] = {}
        self.wake = threading.Event()
        self.corrected = 0

    def handed(
        self,
        ids: Sequence[str],
        gpus: Sequence[str],
        pods: Iterable[str] = (),
        *,
        mig: Sequence[MigAllocation] = (),
        pod: str = "",
    ) -> None:
        """An Allocate gave the request ``ids`` the entry of pod ``pod`` on ``gpus`` (and the
        MIG instances ``mig``, with their runtime identities); ``pods``: the interchangeable
        pods it was chosen among (now pending), none when it named its pod. The instances
        are guarded (``protected``) while a pod of the hand-out is pending, also when ``pod``
        was the last of an earlier hand-out's pods to allocate (the kubelet's container may be
        the other's)."""
        pods = tuple(pods)
        with self._lock:
            self._handed[frozenset(ids)] = _Handout(tuple(gpus), tuple(mig))
            while len(self._handed) > MAX_HANDED:
                del self._handed[next(iter(self._handed))]
            self._pending.update(pods)
            among = frozenset(pods) | ({pod} if pod in self._pending else set())
            if among:
                for a in mig:
                    if a.runtime is not None:
                        self._guarded[a.runtime.mig_uuid] = among
        if pods:
            self.wake.set()

    def pending(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def protected(self) -> frozenset[str]:
        """MIG UUIDs handed out among interchangeable pods of which some is still pending:
        until the kubelet shows who holds it, the pods' records may name the wrong pod (one
        that ended while the other runs on it), so the MIG manager must keep it
        (``MigManager.protect``)."""
        with self._lock:
            for uuid in [u for u, pods in self._guarded.items() if not pods & self._pending]:
                del self._guarded[uuid]
            return frozenset(self._guarded)

    def adopt(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """After a restart: pods whose record holds more devices than their one GPU container
        asks (a correction interrupted between its rounds) are checked again."""
        found: set[str] = set()
        for pod in pods:
            ann = annotations_of(pod)
            key = pod_key(pod)
            try:
                ci = gpu_container(ann, obj=f"pod {key}")
                entry = decode_devices(ann.get(DEVICES_ALLOCATED, ""))[ci] if ci is not None else ()
            except InvalidAnnotationError:
                continue
            if ci is None:
                continue
            asked = _asked(all_containers(pod), ci, self._resource)
            if asked is not None and len(entry) > asked:
                found.add(key)
        if found:
            with self._lock:
                self._pending.update(found)
            self.wake.set()

    def check(self) -> bool:
        """One look (``IdentityFixer`` above); True when nothing is left pending."""
        with self._lock:
            if not self._pending:
                return True
            handed = dict(self._handed)
            keys = set(self._pending)

        def given(ids: tuple[str, ...]) -> tuple[str, ...] | None:
            known = handed.get(frozenset(ids))
            if known is not None:
                return known.gpus
            try:
                return tuple(gpu_of(i)[0] for i in ids)
            except TesseraError:
                return None

        def given_mig(ids: tuple[str, ...]) -> tuple[MigAllocation, ...] | None:
            known = handed.get(frozenset(ids))
            return known.mig if known is not None and known.mig else None

        held = self._lister.list(self._resource)
        answer = self._kube.list("/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}")
        pods = list(answer.get("items") or [])
        fixes, settled = corrections(pods, keys, given, held, given_mig)
        done: set[str] = set(settled)
        # Round one: every wrong pod counts its old and its real GPUs. Round two (the real
        # ones alone) only once round one holds for all of them and the kubelet lists every
        # pending pod: an unlisted one may not hold yet what it will get, the GPUs a wrong
        # pod records now, so they must stay counted until it is listed.
        unlisted = keys - settled - {f.key for f in fixes}
        ready = all(
            (f.both == f.before and f.mig_both == f.mig_before)
            or self._write(f, f.both, f.mig_both, f.pod)
            for f in fixes
        )
        for f in fixes if ready and not unlisted else ():
            if self._write(f, f.after, f.mig_after, None):
                done.add(f.key)
                self.corrected += 1
                log.info(
                    "identity.corrected",
                    pod=f.key,
                    node=self.node_name,
                    container=f.container,
                    recorded=[d.uuid for d in f.before],
                    holds=[d.uuid for d in f.after],
                    mig=[a.runtime.mig_uuid for a in f.mig_after if a.runtime is not None],
                )
        with self._lock:
            self._pending -= done
            return not self._pending

    def _write(
        self,
        fix: Correction,
        entry: ContainerDevices,
        mig: tuple[MigAllocation, ...],
        pod: Mapping[str, Any] | None,
    ) -> bool:
        """Record ``entry`` (and MIG instances ``mig``) for the fix's container, when the pod
        still records what the fix expects: its first read (``pod``) or the first round."""
        path = f"/api/v1/namespaces/{fix.key.replace('/', '/pods/', 1)}"
        obj = f"pod {fix.key}"
        try:
            current = pod if pod is not None else self._kube.get(path)
            meta = as_object(current.get("metadata"))
            ann = annotations_of(current)
            recorded = list(decode_devices(ann.get(DEVICES_ALLOCATED, ""), obj=obj))
            if fix.container >= len(recorded):
                return False
            first = pod is not None
            expected = fix.before if first else fix.both
            expected_mig = fix.mig_before if first else fix.mig_both
            if recorded[fix.container] != expected or (
                fix.mig_after and _container_mig(ann, fix.container, obj=obj) != expected_mig
            ):
                return False  # changed since it was read: the next check starts over
            recorded[fix.container] = entry
            patch = {DEVICES_ALLOCATED: encode_devices(tuple(recorded))}
            if fix.mig_after:
                others = [
                    a
                    for a in decode_mig_allocations(ann.get(MIG_ALLOCATIONS, ""), obj=obj)
                    if a.container_index != fix.container
                ]
                patch[MIG_ALLOCATIONS] = encode_mig_allocations([*others, *mig])
            self._kube.merge_patch(
                path,
                {"metadata": {"annotations": patch}},
                resource_version=meta.get("resourceVersion"),
            )
            return True
        except (ConflictError, NotFoundError):
            return False
        except (KubeError, InvalidAnnotationError) as e:
            log.warning("identity.write_failed", pod=fix.key, node=self.node_name, error=str(e))
            return False


def _asked(containers: Sequence[Mapping[str, Any]], ci: int, resource: str) -> int | None:
    if ci >= len(containers):
        return None
    limits = as_object(as_object(containers[ci].get("resources")).get("limits"))
    try:
        return int(str(limits.get(resource)))
    except ValueError:
        return None
