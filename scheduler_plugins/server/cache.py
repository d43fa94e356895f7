"""The plugin server's model of the cluster: a ``ClusterState`` kept current from watch events.

Owns three overlays on what the API shows:

- *assumed* reservations (Reserve) count at once, until the watch shows the pod carrying the
  annotations PreBind wrote (or the pod bound), or until Unreserve forgets them;
- *bind claims* (PreBind) mark a pod ``bind-phase: allocating`` on its node from the moment
  the patch is decided until the watch shows it bound there, so a second PreBind cannot slip
  in before then; an unbound pod's bind annotations alone block nothing (they may be left
  over from an attempt that never bound);
- *in flight*: pods reserved, claimed or allocating on a node, with the device counts their
  remaining containers ask; ``busy_nodes`` names the nodes where a new pod would have to wait
  for the node agent (``pod_matching.ambiguous``), so the scheduler can prefer others;
- a *generation* that changes with every change that can alter a decision, so a cached
  Decision is used only while it is still exact.

Everything here runs under one lock (``lock``): the core is single-threaded. The objects fed
in are the raw JSON dicts of the API; only annotations and phase are read, and an event that
changes neither is not parsed again.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import structlog

from node_agent.pod_matching import ambiguous, is_candidate, to_allocate
from scheduler_plugins import annotations as ann
from scheduler_plugins.config import DeviceConfig
from scheduler_plugins.errors import InvalidInputError
from scheduler_plugins.nodes import parse_node
from scheduler_plugins.pods import (
    PodAllocation,
    all_containers,
    annotations_of,
    counts_against_capacity,
    parse_allocation,
    pod_key,
)
from scheduler_plugins.state import ClusterState

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


@dataclass(frozen=True)
class _Assumed:
    node: str
    at: float
    counts: frozenset[int] | None  # device counts of its GPU containers (None: any)


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


class ClusterCache:
    """Nodes, pods, reservations and bind claims; every method takes ``lock`` itself."""

    def __init__(
        self, config: DeviceConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.state = ClusterState(config)
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._clock = clock
        self.generation = 0
        self._listeners: list[Callable[[], None]] = []
        self._settled_listeners: list[Callable[[str], None]] = []
        self._node_seen: dict[str, tuple[object, ...]] = {}
        self._pod_seen: dict[str, tuple[object, ...]] = {}
        # node -> pod key -> annotations, for pods the node agent sees as allocating there.
        self._allocating: dict[str, dict[str, Mapping[str, str]]] = {}
        self._allocating_node: dict[str, str] = {}
        self._claims: dict[str, Claim] = {}
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

    def _settled(self, key: str) -> None:
        for cb in self._settled_listeners:
            cb(key)

    def _mutating(self) -> None:
        self.generation += 1
        for cb in self._listeners:
            cb()

    def wait_changed(self, timeout_s: float) -> None:
        """Block (releasing the lock) until a pod or claim changes, or ``timeout_s`` passes."""
        with self._changed:
            self._changed.wait(max(timeout_s, 0.0))

    def _notify(self) -> None:
        self._changed.notify_all()

    # ----- nodes -------------------------------------------------------------------------

    def apply_node(self, node: Obj) -> None:
        meta = _dict(node.get("metadata"))
        name = str(meta.get("name", ""))
        if not name:
            return
        raw = _dict(meta.get("annotations")).get(ann.NODE_REGISTER)
        alloc = _dict(_dict(node.get("status")).get("allocatable"))
        fp = (raw, alloc.get("cpu"), alloc.get("memory"))
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
            self._mutating()
            self.state.upsert_node(
                name, info.devices, cpu_milli=info.cpu_milli, memory_bytes=info.memory_bytes
            )

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
        fp: tuple[object, ...] = (
            counts,
            spec.get("nodeName"),
            bool(meta.get("deletionTimestamp")),
            annotations.get(ann.VGPU_NODE),
            annotations.get(ann.BIND_TIME),
            annotations.get(ann.BIND_PHASE),
            annotations.get(ann.DEVICES_ALLOCATED),
            annotations.get(ann.DEVICES_TO_ALLOCATE),
            annotations.get(ann.MIG_ALLOCATIONS),
            json.dumps([c.get("resources") for c in all_containers(pod)], sort_keys=True),
        )
        with self.lock:
            if self._pod_seen.get(key) == fp:
                return
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
            try:
                alloc = parse_allocation(pod)
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
            self.state.upsert_pod(alloc, key)
            return
        self._mutating()
        self.state.upsert_pod(alloc, key)

    def _track_allocating(
        self, pod: Obj, key: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        before = self._allocating_node.pop(key, None)
        if before is not None:
            per_node = self._allocating.get(before, {})
            per_node.pop(key, None)
            if not per_node:
                self._allocating.pop(before, None)
        # Only a pod bound to the node is allocating there: the node agent sees no other. An
        # unbound pod's bind annotations are either this server's PreBind waiting for its
        # Bind (its claim stands for it) or left over from an attempt that never bound (a
        # server that died before Unreserve could take them back): those must not block.
        bound = _dict(pod.get("spec")).get("nodeName") == node
        if node and bound and is_candidate(pod, node):
            self._allocating.setdefault(node, {})[key] = dict(annotations)
            self._allocating_node[key] = node
        claim = self._claims.get(key)
        if (
            claim is not None
            and claim.node == node
            and bound
            and _carries(annotations, claim.annotations)
        ):
            del self._claims[key]  # the watch shows it bound with our patch
        self._notify()

    def delete_pod(self, pod: Obj) -> None:
        self.forget_pod(pod_key(pod))

    def forget_pod(self, key: str) -> None:
        with self.lock:
            self._settled(key)
            self._pod_seen.pop(key, None)
            self._assumed.pop(key, None)
            self._claims.pop(key, None)
            node = self._allocating_node.pop(key, None)
            if node is not None:
                per_node = self._allocating.get(node, {})
                per_node.pop(key, None)
                if not per_node:
                    self._allocating.pop(node, None)
            if self.state.allocation(key) is not None:
                self._mutating()
                self.state.remove_pod(key)
            self._notify()

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

    def assume(self, alloc: PodAllocation, counts: frozenset[int] | None = None) -> None:
        """Count ``alloc`` at once; ``counts`` are the device counts of the pod's GPU
        containers (for ``busy_nodes``; None: it clashes with any pod until PreBind)."""
        with self.lock:
            self._mutating()
            self.state.assume(alloc)
            self._assumed[alloc.key] = _Assumed(alloc.node, self._clock(), counts)

    def forget(self, key: str) -> bool:
        """Drop an assumed reservation (idempotent); a confirmed one stays."""
        with self.lock:
            self._assumed.pop(key, None)
            if not self.state.is_assumed(key):
                return False
            self._mutating()
            return self.state.forget(key)

    # ----- bind claims -------------------------------------------------------------------

    def blocking(self, node: str, key: str, annotations: Mapping[str, str]) -> list[str]:
        """Pods allocating on ``node`` that the node agent could not tell from ``key``."""
        with self.lock:
            others: dict[str, Mapping[str, str]] = dict(self._allocating.get(node, {}))
            for k, c in self._claims.items():
                if c.node == node:
                    others[k] = c.annotations
            others.pop(key, None)
            return sorted(k for k, a in others.items() if ambiguous(a, annotations))

    def busy_nodes(self, counts: frozenset[int]) -> set[str]:
        """Nodes where a pod whose GPU containers ask ``counts`` devices would wait at
        PreBind: a pod reserved, claimed or allocating there has a container still to
        allocate that asks one of those counts. Cheap: only pods in flight are looked at."""
        if not counts:
            return set()
        with self.lock:
            busy = {
                a.node
                for k, a in self._assumed.items()
                if k not in self._claims and _clash(a.counts, counts)
            }
            busy.update(
                c.node
                for c in self._claims.values()
                if c.node not in busy
                and _clash(
                    _remaining_counts(c.annotations.get(ann.DEVICES_TO_ALLOCATE, "")), counts
                )
            )
            for node, pods in self._allocating.items():
                if node not in busy and any(
                    _clash(_remaining_counts(a.get(ann.DEVICES_TO_ALLOCATE, "")), counts)
                    for a in pods.values()
                ):
                    busy.add(node)
            return busy

    def claim(self, key: str, node: str, annotations: Mapping[str, str]) -> None:
        with self.lock:
            before = self._claims.get(key)
            self._claims[key] = Claim(node, dict(annotations), self._clock())
            if before is not None and before.node != node:
                self._notify()  # an earlier attempt's claim on another node is gone

    def release_claim(self, key: str) -> None:
        with self.lock:
            if self._claims.pop(key, None) is not None:
                self._notify()

    def bound_to(self, key: str) -> str | None:
        """The node the watch last showed pod ``key`` bound to (None: unbound or unseen)."""
        with self.lock:
            seen = self._pod_seen.get(key)
            return str(seen[1]) if seen is not None and seen[1] else None

    def allocating(self, node: str) -> dict[str, Mapping[str, str]]:
        """Pods allocating on ``node`` (watched or claimed): key -> annotations."""
        with self.lock:
            out = dict(self._allocating.get(node, {}))
            out.update({k: c.annotations for k, c in self._claims.items() if c.node == node})
            return out
