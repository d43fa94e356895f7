"""The plugin server's model of the cluster: a ``ClusterState`` kept current from watch events.

Owns three overlays on what the API shows:

- *assumed* reservations (Reserve) count at once, until the watch shows the pod carrying the
  annotations PreBind wrote (or the pod bound), or until Unreserve forgets them;
- *bind claims* (PreBind) mark a pod ``bind-phase: allocating`` on its node from the moment
  the patch is decided until the watch shows it bound there, so a second PreBind cannot slip
  in before then; an unbound pod's bind annotations alone block nothing (they may be left
  over from an attempt that never bound);
- *in flight*: pods reserved, claimed or allocating on a node, with the device counts their
  remaining containers ask; ``busy_per_node`` counts, per node of a layout, the pods a new
  pod would have to wait behind for the node agent (``pod_matching.ambiguous``), so the
  scheduler can prefer other nodes;
- a *generation* that changes with every change that can alter a decision, so a cached
  Decision is used only while it is still exact.

It also tells listeners what kube-scheduler's preemption does (``on_preemption``): a pod marked
for preemption (it keeps counting until the watch shows it gone, so its devices are never
handed out twice), an unbound pod nominated to a node.

Everything here runs under one lock (``lock``): the core is single-threaded. The objects fed
in are the raw JSON dicts of the API; only annotations and phase are read, and an event that
changes neither is not parsed again.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import structlog

from api.errors import InvalidInputError
from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.matching import interchange_key, interchangeable, is_candidate, to_allocate
from api.kube.objects import (
    all_containers,
    annotations_of,
    nominated_node,
    pod_key,
    preempted_by_scheduler,
)
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import PodAllocation, counts_against_capacity, parse_allocation
from scheduler_plugins.core.state import ClusterState

log = structlog.get_logger("tessera.plugin_server.cache")

Obj = Mapping[str, Any]


def _dict(v: object) -> dict[str, Any]:
    return cast("dict[str, Any]", v) if isinstance(v, dict) else {}


def _carries(annotations: Mapping[str, str], written: Mapping[str, str]) -> bool:
    """The pod shows the bind annotations we wrote (the watch has caught up with our patch)."""
    keys = (ann.VGPU_NODE, ann.BIND_TIME, ann.DEVICES_ALLOCATED)
    return all(annotations.get(k) == written.get(k) for k in keys)


@dataclass(frozen=True)
class Claim:
    """A PreBind that decided to write ``annotations`` (bind-phase allocating) on ``node``."""

    node: str
    annotations: Mapping[str, str]
    at: float
    interchange: str | None = None  # ``api.hami.matching.interchange_key`` of the pod


@dataclass(frozen=True)
class _Assumed:
    node: str
    at: float
    counts: frozenset[int] | None  # device counts of its GPU containers (None: any)
    interchange: str | None = None  # its interchange_key on that node


@functools.lru_cache(maxsize=4096)
def _remaining_counts(to_allocate_raw: str) -> frozenset[int] | None:
    """Device counts of the containers still to allocate (None: unreadable, so any)."""
    try:
        return frozenset(
            len(c) for c in to_allocate({ann.DEVICES_TO_ALLOCATE: to_allocate_raw}) if c
        )
    except InvalidInputError:
        return None


def _clash(counts: frozenset[int] | None, wanted: frozenset[int]) -> bool:
    return counts is None or not counts.isdisjoint(wanted)


_ANY: Final = -1  # busy-index key of a pod whose counts are unknown: it clashes with all
# Positions in a pod's fingerprint (``ClusterCache.apply_pod``).
_PREEMPTED: Final = 7
_NOMINATED: Final = 8


def _count_keys(counts: frozenset[int] | None) -> tuple[int, ...]:
    return (_ANY,) if counts is None else tuple(sorted(counts))


def _to_allocate_of(annotations: Mapping[str, str]) -> str:
    return annotations.get(ann.DEVICES_TO_ALLOCATE, "")


class ClusterCache:
    """Nodes, pods, reservations and bind claims; every method takes ``lock`` itself."""

    def __init__(self, config: DeviceConfig, *, clock: Callable[[], float]) -> None:
        self.state = ClusterState(config)
        self.lock = threading.RLock()
        self._clock = clock
        self.generation = 0
        self._listeners: list[Callable[[], None]] = []
        self._settled_listeners: list[Callable[[str], None]] = []
        self._legacy_listeners: list[Callable[[Obj, PodAllocation], object]] = []
        self._victim_listeners: list[Callable[[Obj, PodAllocation | None], object]] = []
        # Pods marked for preemption, until they are gone (``leaving``).
        self._leaving: set[str] = set()
        self._nominated_listeners: list[Callable[[Obj, str], object]] = []
        self._node_seen: dict[str, tuple[object, ...]] = {}
        self._pod_seen: dict[str, tuple[object, ...]] = {}
        # The allocation last parsed from each pod, with what it was parsed from (node, the
        # device annotations, the containers' resources): an event that changes only the
        # bind phase or the status reuses it instead of decoding the annotations again.
        self._parsed: dict[str, tuple[object, PodAllocation | None]] = {}
        # node -> pod key -> annotations, for pods the node agent sees as allocating there.
        self._allocating: dict[str, dict[str, Mapping[str, str]]] = {}
        self._allocating_node: dict[str, str] = {}
        # pod key -> its interchange_key, for the pods of ``_allocating``.
        self._interchange: dict[str, str | None] = {}
        self._claims: dict[str, Claim] = {}
        self._claims_on: dict[str, dict[str, Claim]] = {}  # node -> pod key -> claim
        # PreBinds waiting for a node wait on its own condition: a change on one node wakes
        # only the binds waiting there, not every waiter of the cluster.
        self._node_changed: dict[str, threading.Condition] = {}
        # The busy index, kept per pod as its overlays change: pod key -> (node, the device
        # counts it still asks, -1 standing for "unreadable: any"); per count, the in-flight
        # pods asking it on each node as an array over node slots (a slot per node name,
        # never reused), so PreFilter reads every node's count in one gather
        # (``busy_per_node``), and how many there are in all; the slots of the last
        # layout's node names.
        self._inflight: dict[str, tuple[str, tuple[int, ...], str | None]] = {}
        # In-flight pods that are interchangeable with others (their interchange_key):
        # key -> node -> how many; a pod alike waits for none of them.
        self._alike: dict[str, dict[str, int]] = {}
        self._slot_of: dict[str, int] = {}
        self._busy_arr: dict[int, npt.NDArray[np.int64]] = {}
        self._busy_total: dict[int, int] = {}
        self._layout_names: tuple[str, ...] | None = None
        self._layout_slots: npt.NDArray[np.intp] = np.zeros(0, np.intp)
        self._layout_index: dict[str, int] = {}  # built when an exemption needs it
        self._assumed: dict[str, _Assumed] = {}

    # ----- change tracking ---------------------------------------------------------------

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (under the lock) before any change that can alter a decision."""
        with self.lock:
            self._listeners.append(callback)

    def on_settled(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(pod key)`` (under the lock) when the watch shows a pod bound to a
        node or gone: from then on no scheduler will Unreserve it."""
        with self.lock:
            self._settled_listeners.append(callback)

    def on_legacy_mig(self, callback: Callable[[Obj, PodAllocation], object]) -> None:
        """Call ``callback(pod, allocation)`` (under the lock; keep it short) when a pod is
        read holding MIG devices HAMi <= v2.9 placed: their GPUs take no new work."""
        with self.lock:
            self._legacy_listeners.append(callback)

    def on_preemption(
        self,
        victim: Callable[[Obj, PodAllocation | None], object],
        nominated: Callable[[Obj, str], object],
    ) -> None:
        """Call ``victim(pod, what it holds)`` when the watch first shows a pod marked for
        preemption by kube-scheduler (``DisruptionTarget``, ``PreemptionByScheduler``; it keeps
        counting until it is gone), and ``nominated(pod, node)`` when it shows an unbound pod
        nominated to another node (kube-scheduler's preemption made room there for it, or it
        is about to be bound there), ``node`` "" when it no longer is (bound, or the
        nomination cleared). Under the lock; keep them short."""
        with self.lock:
            self._victim_listeners.append(victim)
            self._nominated_listeners.append(nominated)

    def leaving(self) -> frozenset[str]:
        """Pods kube-scheduler marked for preemption that are not gone yet: they still count
        (``state``), but a preemption what-if counts them as gone, as kube-scheduler does
        once it has seen them deleted (else it would preempt more pods for the same room)."""
        with self.lock:
            return frozenset(self._leaving)

    def _settled(self, key: str) -> None:
        for cb in self._settled_listeners:
            cb(key)

    def _mutating(self) -> None:
        self.generation += 1
        for cb in self._listeners:
            cb()

    def wait_changed(self, timeout_s: float, node: str) -> None:
        """Block (releasing the lock) until a pod or claim on ``node`` changes, or
        ``timeout_s`` passes."""
        with self.lock:
            cond = self._node_changed.setdefault(node, threading.Condition(self.lock))
            cond.wait(max(timeout_s, 0.0))

    def wake(self, node: str) -> None:
        """Wake whoever waits on ``node`` (``wait_changed``) to look again."""
        with self.lock:
            self._notify(node)

    def _notify(self, *nodes: str | None) -> None:
        for node in nodes:
            cond = self._node_changed.get(node) if node else None
            if cond is not None:
                cond.notify_all()

    # ----- nodes -------------------------------------------------------------------------

    def apply_node(self, node: Obj) -> None:
        meta = _dict(node.get("metadata"))
        name = str(meta.get("name", ""))
        if not name:
            return
        annotations = _dict(meta.get("annotations"))
        alloc = _dict(_dict(node.get("status")).get("allocatable"))
        fp = (
            annotations.get(ann.NODE_REGISTER),
            annotations.get(ann.DEVICE_CORDON),
            annotations.get(ann.NODE_PAIR_SCORES),
            alloc.get("cpu"),
            alloc.get("memory"),
        )
        with self.lock:
            if self._node_seen.get(name) == fp:
                return
            self._node_seen[name] = fp
            try:
                info = parse_node(node)
            except InvalidInputError as e:
                log.warning(
                    "node register annotation unreadable; node counts as GPU-less",
                    node=name,
                    error=str(e),
                )
                stripped = {**node, "metadata": {**meta, "annotations": {}}}
                info = parse_node(stripped)
            for warning in info.warnings:
                log.warning("node data unreadable", node=name, error=warning)
            self._mutating()
            self.state.upsert_node_info(info)

    def delete_node(self, name: str) -> None:
        with self.lock:
            self._node_seen.pop(name, None)
            if name in self.state.nodes:
                self._mutating()
                self.state.remove_node(name)

    def replace_nodes(self, nodes: Iterable[Obj]) -> None:
        """A fresh list: apply every node, drop those it no longer has."""
        with self.lock:
            listed: set[str] = set()
            for node in nodes:
                listed.add(str(_dict(node.get("metadata")).get("name", "")))
                self.apply_node(node)
            for name in [n for n in self._node_seen if n not in listed]:
                self.delete_node(name)
            for name in [n for n in self.state.nodes if n not in listed]:
                self.delete_node(name)

    # ----- pods --------------------------------------------------------------------------

    def apply_pod(self, pod: Obj) -> None:
        key = pod_key(pod)
        meta = _dict(pod.get("metadata"))
        spec = _dict(pod.get("spec"))
        annotations = annotations_of(pod)
        counts = counts_against_capacity(pod)
        node_name = str(spec.get("nodeName") or annotations.get(ann.VGPU_NODE) or "")
        # What parse_allocation reads (the node, the device annotations, the containers'
        # resources: repr, not a sorted JSON dump; the same object decodes to the same key
        # order, and a spurious difference costs only a re-parse) ...
        source = (
            node_name,
            meta.get("uid"),  # a recreated namesake is another pod (preemption names uids)
            annotations.get(ann.DEVICES_ALLOCATED),
            annotations.get(ann.MIG_ALLOCATIONS),
            repr([c.get("resources") for c in all_containers(pod)]),
            repr(spec.get("resources")),  # pod-level requests (``host_requests``)
        )
        # ... and what else the cache reads: an event that changes none of it is skipped.
        preempted = preempted_by_scheduler(pod)
        nominated = "" if spec.get("nodeName") else nominated_node(pod)
        fp: tuple[object, ...] = (
            counts,
            spec.get("nodeName"),
            bool(meta.get("deletionTimestamp")),
            annotations.get(ann.VGPU_NODE),
            annotations.get(ann.BIND_TIME),
            annotations.get(ann.BIND_PHASE),
            annotations.get(ann.DEVICES_TO_ALLOCATE),
            preempted,
            nominated,
            source,
        )
        with self.lock:
            before = self._pod_seen.get(key)
            if before == fp:
                return
            try:
                self._apply_pod(pod, key, fp, spec, annotations, counts, node_name)
            finally:
                self._refresh_inflight(key)
            # A pod marked for preemption still counts (its record stays until it is gone):
            # its devices are never handed out while it may still hold them.
            if preempted:
                self._leaving.add(key)
            else:
                self._leaving.discard(key)
            if preempted and (before is None or not before[_PREEMPTED]):
                held = self.state.allocation(key)
                for victim_cb in self._victim_listeners:
                    victim_cb(pod, held)
            if (before[_NOMINATED] if before is not None else "") != nominated:
                for nominated_cb in self._nominated_listeners:
                    nominated_cb(pod, nominated)

    def _apply_pod(
        self,
        pod: Obj,
        key: str,
        fp: tuple[object, ...],
        spec: Mapping[str, Any],
        annotations: Mapping[str, str],
        counts: bool,
        node_name: str,
    ) -> None:
        self._pod_seen[key] = fp
        if spec.get("nodeName"):
            self._settled(key)
        claim = self._claims.get(key)
        ours = claim is not None and _carries(annotations, claim.annotations)
        self._track_allocating(pod, key, node_name, annotations)
        if not counts:
            self._assumed.pop(key, None)
            if self.state.allocation(key) is not None:
                self._mutating()
                self.state.remove_pod(key)
            return
        source = fp[-1]
        parsed = self._parsed.get(key)
        try:
            if parsed is not None and parsed[0] == source:
                alloc = parsed[1]
            else:
                alloc = parse_allocation(pod)
                self._parsed[key] = (source, alloc)
                if alloc is not None and any(d.legacy is not None for d in alloc.devices):
                    for cb in self._legacy_listeners:
                        cb(pod, alloc)
        except InvalidInputError as e:
            # Fail closed: what the pod held before still counts.
            log.warning(
                "pod allocation unreadable; keeping its previous record",
                pod=key,
                node=node_name or None,
                error=str(e),
            )
            return
        self._record(key, alloc, seen_ours=bool(spec.get("nodeName")) or ours)

    def _record(self, key: str, alloc: PodAllocation | None, *, seen_ours: bool) -> None:
        if key in self._assumed:
            if alloc is None or not seen_ours:
                return  # annotations not visible yet (or stale ones of an earlier attempt)
            del self._assumed[key]
        current = self.state.allocation(key)
        if current == alloc and (alloc is None or not self.state.is_assumed(key)):
            return
        if current == alloc and alloc is not None:
            # Same devices, now confirmed: no usage changes, cached decisions stay exact.
            self.state.confirm(alloc)
            return
        self._mutating()
        self.state.upsert_pod(alloc, key)

    def _track_allocating(
        self, pod: Obj, key: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        blocked_before = self._blocking_entries(key)
        self._drop_allocating(key)
        # Only a pod bound to the node is allocating there: the node agent sees no other. An
        # unbound pod's bind annotations are either this server's PreBind waiting for its
        # Bind (its claim stands for it) or left over from an attempt that never bound (a
        # server that died before Unreserve could take them back): those must not block.
        bound = _dict(pod.get("spec")).get("nodeName") == node
        if node and bound and is_candidate(pod, node):
            self._allocating.setdefault(node, {})[key] = dict(annotations)
            self._allocating_node[key] = node
            self._interchange[key] = interchange_key(pod)
        claim = self._claims.get(key)
        if (
            claim is not None
            and claim.node == node
            and bound
            and _carries(annotations, claim.annotations)
        ):
            self._drop_claim(key)  # the watch shows it bound with our patch
        # Wake a node's waiting PreBinds only when what this pod blocks there changed: not
        # when the watch shows a claimed pod bound with what was claimed, nor for the status
        # updates of a pod done allocating (half the wakeups of a drain were for nothing).
        changed = blocked_before ^ self._blocking_entries(key)
        if changed:
            self._notify(*{n for n, _ in changed})

    def _blocking_entries(self, key: str) -> set[tuple[str, str]]:
        """What pod ``key`` blocks, as ``blocking`` sees it: (node, its to-allocate entry)
        for its claim and, on another node, for its watched allocation."""
        out: set[tuple[str, str]] = set()
        claim = self._claims.get(key)
        if claim is not None:
            out.add((claim.node, claim.annotations.get(ann.DEVICES_TO_ALLOCATE, "")))
        node = self._allocating_node.get(key)
        if node is not None and (claim is None or claim.node != node):
            out.add((node, self._allocating[node][key].get(ann.DEVICES_TO_ALLOCATE, "")))
        return out

    def _drop_allocating(self, key: str) -> str | None:
        self._interchange.pop(key, None)
        node = self._allocating_node.pop(key, None)
        if node is not None:
            per_node = self._allocating.get(node, {})
            per_node.pop(key, None)
            if not per_node:
                self._allocating.pop(node, None)
        return node

    def _drop_claim(self, key: str) -> Claim | None:
        claim = self._claims.pop(key, None)
        if claim is not None:
            on = self._claims_on.get(claim.node, {})
            on.pop(key, None)
            if not on:
                self._claims_on.pop(claim.node, None)
        return claim

    def delete_pod(self, pod: Obj) -> None:
        self.forget_pod(pod_key(pod))

    def forget_pod(self, key: str) -> None:
        with self.lock:
            self._leaving.discard(key)
            self._settled(key)
            self._pod_seen.pop(key, None)
            self._parsed.pop(key, None)
            self._assumed.pop(key, None)
            claim = self._drop_claim(key)
            node = self._drop_allocating(key)
            self._refresh_inflight(key)
            if self.state.allocation(key) is not None:
                self._mutating()
                self.state.remove_pod(key)
            self._notify(node, claim.node if claim is not None else None)

    def replace_pods(self, pods: Iterable[Obj], listed_at: float) -> None:
        """A fresh list sent at ``listed_at``: apply every pod, drop those it lacks.

        Reservations and claims made after the list was sent are kept: their pods may be
        newer than the list.
        """
        with self.lock:
            listed: set[str] = set()
            for pod in pods:
                listed.add(pod_key(pod))
                self.apply_pod(pod)
            stale = {k for k in self._pod_seen if k not in listed}
            stale |= {k for k, a in self._assumed.items() if a.at < listed_at}
            stale |= {k for k, c in self._claims.items() if c.at < listed_at}
            for key in stale - listed:
                self.forget_pod(key)
            for alloc in list(self.state.allocations()):
                if alloc.key not in listed and alloc.key not in self._assumed:
                    self.forget_pod(alloc.key)

    # ----- reservations ------------------------------------------------------------------

    def assume(
        self,
        alloc: PodAllocation,
        counts: frozenset[int] | None = None,
        interchange: str | None = None,
    ) -> None:
        """Count ``alloc`` at once; ``counts`` are the device counts of the pod's GPU
        containers (for ``busy_nodes``; None: it clashes with any pod until PreBind),
        ``interchange`` its interchange_key there (pods alike do not wait for it)."""
        with self.lock:
            self._mutating()
            self.state.assume(alloc)
            self._assumed[alloc.key] = _Assumed(alloc.node, self._clock(), counts, interchange)
            self._refresh_inflight(alloc.key)

    def forget(self, key: str) -> bool:
        """Drop an assumed reservation (idempotent); a confirmed one stays."""
        with self.lock:
            self._assumed.pop(key, None)
            self._refresh_inflight(key)
            if not self.state.is_assumed(key):
                return False
            self._mutating()
            return self.state.forget(key)

    # ----- bind claims -------------------------------------------------------------------

    def blocking(
        self,
        node: str,
        key: str,
        annotations: Mapping[str, str],
        interchange: str | None = None,
    ) -> list[str]:
        """Pods allocating on ``node`` that the node agent could not tell from ``key``
        (``pod_matching.ambiguous``, with the parsed counts cached): not those
        interchangeable with it (``interchange``: its ``interchange_key``)."""
        with self.lock:
            others = self.allocating(node)
            others.pop(key, None)
            wanted = _remaining_counts(annotations.get(ann.DEVICES_TO_ALLOCATE, ""))
            return sorted(
                k
                for k, a in others.items()
                if (
                    wanted is None
                    or _clash(_remaining_counts(a.get(ann.DEVICES_TO_ALLOCATE, "")), wanted)
                )
                and not interchangeable(interchange, self._interchange_of(k))
            )

    def _interchange_of(self, key: str) -> str | None:
        claim = self._claims.get(key)
        if claim is not None:
            return claim.interchange
        return self._interchange.get(key)

    def busy_nodes(self, counts: frozenset[int]) -> dict[str, int]:
        """Nodes where a pod whose GPU containers ask ``counts`` devices would wait at
        PreBind, with (about) how many pods it would wait behind: pods reserved, claimed or
        allocating there with a container still to allocate that asks one of those counts
        (a pod asking several of them counts once per count). Read from the busy arrays
        with a loop over every node seen: for tests and diagnostics (PreFilter reads
        ``busy_per_node``)."""
        if not counts:
            return {}
        with self.lock:
            wanted = [c for c in (_ANY, *counts) if self._busy_total.get(c)]
            if not wanted:
                return {}
            total = self._busy_arr[wanted[0]].copy()
            for c in wanted[1:]:
                total += self._busy_arr[c]
            return {node: n for node, slot in self._slot_of.items() if (n := int(total[slot]))}

    def has_alike(self) -> bool:
        """Some in-flight pod is interchangeable with others (``busy_per_node`` may exempt)."""
        with self.lock:
            return bool(self._alike)

    def busy_per_node(
        self, counts: frozenset[int], names: tuple[str, ...], interchange: str | None = None
    ) -> npt.NDArray[np.int64] | None:
        """``busy_nodes`` as an array aligned with ``names`` (a layout's node names: the
        slots of the last names asked are kept), less the in-flight pods interchangeable
        with a pod whose interchange_key is ``interchange``; None when no node is busy."""
        if not counts:
            return None
        with self.lock:
            wanted = [c for c in (_ANY, *counts) if self._busy_total.get(c)]
            if not wanted:
                return None
            if names is not self._layout_names:
                # First: a new name's slot may grow (replace) the arrays.
                self._layout_slots = np.fromiter(map(self._slot, names), np.intp, len(names))
                self._layout_names = names
                self._layout_index = {}
            slots = self._layout_slots
            arrays = [self._busy_arr[c] for c in wanted]
            out = arrays[0][slots]  # a new array: safe to hand out
            for more in arrays[1:]:
                out += more[slots]
            alike = self._alike.get(interchange) if interchange is not None else None
            if alike:
                if not self._layout_index:
                    self._layout_index = {n: i for i, n in enumerate(names)}
                for node, n in alike.items():
                    i = self._layout_index.get(node)
                    if i is not None:
                        out[i] = max(out[i] - n, 0)  # each counted once, under its one count
            return out

    def _slot(self, node: str) -> int:
        """Node ``node``'s slot in the busy arrays (caller holds the lock)."""
        slot = self._slot_of.get(node)
        if slot is None:
            slot = self._slot_of[node] = len(self._slot_of)
            for c, arr in self._busy_arr.items():
                if slot >= arr.size:
                    self._busy_arr[c] = np.concatenate([arr, np.zeros(arr.size, np.int64)])
        return slot

    def _busy_add(self, c: int, node: str, delta: int) -> None:
        slot = self._slot(node)  # first: a new slot may grow (replace) the arrays
        arr = self._busy_arr.get(c)
        if arr is None:
            arr = self._busy_arr[c] = np.zeros(max(64, 2 * len(self._slot_of)), np.int64)
        arr[slot] += delta
        self._busy_total[c] = self._busy_total.get(c, 0) + delta

    def _refresh_inflight(self, key: str) -> None:
        """Re-derive pod ``key``'s entry in the busy index from its overlays: its claim
        (what PreBind wrote) first, else the watch's allocating annotations, else its
        reservation's counts."""
        entry: tuple[str, tuple[int, ...], str | None] | None = None
        claim = self._claims.get(key)
        allocating_on = self._allocating_node.get(key)
        assumed = self._assumed.get(key)
        if claim is not None:
            counts = _count_keys(_remaining_counts(_to_allocate_of(claim.annotations)))
            entry = (claim.node, counts, claim.interchange)
        elif allocating_on is not None:
            annotations = self._allocating.get(allocating_on, {}).get(key, {})
            counts = _count_keys(_remaining_counts(_to_allocate_of(annotations)))
            entry = (allocating_on, counts, self._interchange.get(key))
        elif assumed is not None:
            entry = (assumed.node, _count_keys(assumed.counts), assumed.interchange)
        if entry is not None and not entry[1]:
            entry = None  # nothing left to allocate: it blocks nobody
        before = self._inflight.get(key)
        if before == entry:
            return
        if before is not None:
            node, counts, alike = before
            for c in counts:
                self._busy_add(c, node, -1)
            if alike is not None:
                per_node = self._alike[alike]
                per_node[node] -= 1
                if not per_node[node]:
                    del per_node[node]
                    if not per_node:
                        del self._alike[alike]
            del self._inflight[key]
        if entry is not None:
            self._inflight[key] = entry
            node, counts, alike = entry
            for c in counts:
                self._busy_add(c, node, 1)
            if alike is not None:  # a key means one GPU container: counted under one count
                per_node = self._alike.setdefault(alike, {})
                per_node[node] = per_node.get(node, 0) + 1

    def claim(
        self,
        key: str,
        node: str,
        annotations: Mapping[str, str],
        interchange: str | None = None,
    ) -> None:
        with self.lock:
            before = self._drop_claim(key)
            claim = Claim(node, dict(annotations), self._clock(), interchange)
            self._claims[key] = claim
            self._claims_on.setdefault(node, {})[key] = claim
            self._refresh_inflight(key)
            if before is not None and before.node != node:
                self._notify(before.node)  # an earlier attempt's claim there is gone

    def release_claim(self, key: str) -> None:
        with self.lock:
            claim = self._drop_claim(key)
            self._refresh_inflight(key)
            if claim is not None:
                self._notify(claim.node)

    def drop_unbound(self, key: str) -> None:
        """The bind annotations of unbound pod ``key`` were taken off it: stop counting them
        now rather than when the watch shows it (a bound pod keeps its record)."""
        with self.lock:
            if self.bound_to(key) is not None or key in self._assumed or key in self._claims:
                return
            self._pod_seen.pop(key, None)  # its next event is applied in full
            if self.state.allocation(key) is not None:
                self._mutating()
                self.state.remove_pod(key)
            self._refresh_inflight(key)

    def bound_to(self, key: str) -> str | None:
        """The node the watch last showed pod ``key`` bound to (None: unbound or unseen)."""
        with self.lock:
            seen = self._pod_seen.get(key)
            return str(seen[1]) if seen is not None and seen[1] else None

    def allocating(self, node: str) -> dict[str, Mapping[str, str]]:
        """Pods allocating on ``node`` (watched or claimed): key -> annotations."""
        with self.lock:
            out = dict(self._allocating.get(node, {}))
            out.update({k: c.annotations for k, c in self._claims_on.get(node, {}).items()})
            return out
