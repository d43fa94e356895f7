"""Simulated node agents for kwok's fake nodes, all in one process.

kwok runs no kubelet, so nothing calls Allocate on a fake node. ``KwokAgents`` stands in:
per fake node (``kwok.x-k8s.io/node: fake``) a ``SimulatedNvml`` with the GPUs the node's
``hami.io/node-nvidia-register`` names (model from ``type``, same UUIDs, MIG on in mig
mode), a ``MigManager`` and an ``Allocator``. It watches pods; for a pod bound to a fake
node with ``bind-phase: allocating`` it runs the allocator's flow for each container in
order (the device ids the kubelet would send are derived from the to-allocate entry),
writing the same annotations a real node would. When pods end (deleted, Succeeded,
Failed) and after every watch round it reconciles, so MIG instances of ended pods are
destroyed. With ``state_dir`` each node's simulated NVML state survives restarts and is
adopted on start.

A fake node whose register annotation says ``"mode":"mps"`` also gets a ``SimulatedMps``
daemon per GPU (files under ``<state-dir>/<node>.mps``, where a test drops its fault files;
in memory without ``state_dir``), started (or adopted) when its agent starts and checked
every ``mps_check_interval_s`` (0.5 s) on the node's queue like any of its work. When a
GPU's daemon health changes, the node's ``hami.io/node-nvidia-register`` is patched: the
health flag of that GPU and nothing else (``with_gpu_health``), under a resourceVersion
precondition, so the scheduler stops or starts offering the GPU; when a daemon is back,
the node's pods still allocating are looked at again.

One watch of the pods bound to a node (``BOUND_PODS``: a pending pod's events never reach
the agents) feeds a ``PodIndex`` (pods by node, newest version of each), and the allocators
read the pods of their node from it instead of listing them from the API: an allocation
costs one patch. The index is at least as fresh as the event that asked for the work (the
watch delivers events in order and the index is updated before the work is queued), and
every patch answer goes into it at once, so a pod's next container sees its last one done.
Work runs on a pool of threads, serially per node (``NodeQueues``): nodes never wait for
each other, and repeated events for one pod collapse into one look at its newest version.
An event after which the pod has nothing to do (kwok marking an allocated pod running)
queues no look at all.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

import structlog

from api.errors import InvalidAnnotationError, TesseraError
from api.hami.catalog import find_model
from api.hami.config import DeviceConfig
from api.hami.keys import BIND_PHASE, DEVICES_TO_ALLOCATE, NODE_REGISTER
from api.hami.register import decode
from api.kube.client import KubeClient, modified_pod_head
from api.kube.errors import ApiError, ConflictError, NotFoundError
from api.kube.objects import annotations_of, pod_key
from api.kube.reflector import Reflector, WatchStream
from node_agent.allocator import Allocator
from node_agent.mig_manager import MigManager
from node_agent.mig_records import TERMINAL_PHASES, desired_from_pods
from node_agent.mps.manager import MpsDaemons
from node_agent.mps.simulated import SimulatedMps
from node_agent.nvml.simulated import CreationHold, SimulatedGpuSpec, SimulatedNvml

log = structlog.get_logger(__name__)

KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
MAX_CONTAINERS: Final = 256
DEFAULT_WORKERS: Final = 64
"""Threads allocating for the fake nodes (each node's work stays serial). A real node's agent
patches its own pods beside every other node's; one process standing in for all of them
keeps that many patches in flight. Measured in 1000-node default-mix queue drains
(``tessera bench``, alternating): 16 threads drained 127.6 and 147.8 pods/s, 64 drained
157.7 and 166.1, binding to allocation p50 8.8 s -> 6.5 s; 128 and 256 no better (166.5,
147.3): the process's own CPU share is the limit then."""
_NODE_FIELD: Final = "spec.nodeName="
_RECONCILE: Final = ""  # queue item: reconcile the node (no pod)
_START: Final = "start"  # queue item: start the node's agent (no pod key lacks a "/")
_MPS_CHECK: Final = "mps"  # queue item: check the node's MPS daemons
DEFAULT_MPS_CHECK_S: Final = 0.5
# A node not in the last node list is looked up alone (GET) until this long after that
# list; then the next miss lists every node again (one paged LIST instead of a GET each).
NODE_RELIST_S: Final = 30.0
_NODE_PAGE: Final = 500
JSON_PATCH: Final = "application/json-patch+json"
_TEST_FAILED: Final = 422  # a JSON patch "test" op that does not hold
_HISTORY: Final = 4  # versions of each pod's metadata the index remembers
_GUARDED_METADATA: Final = ("uid", "resourceVersion", "annotations")  # what guarded_ops reads
_SPEC_KEPT: Final = ("nodeName", "initContainers", "containers")
BOUND_PODS: Final = "spec.nodeName!="
"""The pods the agents list and watch: those bound to a node (kube-scheduler's own selector
for assigned pods). A pending pod's events (its creation, the scheduler's writes before the
binding) never reach them; a pod arrives when it is bound, as ADDED."""

Obj = dict[str, Any]


# The pod index ---------------------------------------------------------------------------------


def _version(pod: Mapping[str, Any]) -> int | None:
    rv = (pod.get("metadata") or {}).get("resourceVersion")
    try:
        return int(rv) if rv is not None else None
    except (TypeError, ValueError):
        return None


def _node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def slim(pod: Mapping[str, Any]) -> Obj:
    """What the allocator and the MIG records read of a pod: metadata without managedFields,
    the node, the containers and the phase (the index holds every pod of the cluster)."""
    meta = {k: v for k, v in (pod.get("metadata") or {}).items() if k != "managedFields"}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    return {
        "kind": "Pod",
        "metadata": meta,
        "spec": {k: spec[k] for k in _SPEC_KEPT if k in spec},
        "status": {k: status[k] for k in ("phase",) if k in status},
    }


class PodIndex:
    """The newest version seen of every pod (``slim``), by node (``spec.nodeName``);
    thread-safe.

    Fed by watch events and by the answers of this process's own writes, which may arrive
    in either order: an object older than the one held (by resourceVersion, an etcd
    revision on the dev cluster) is ignored, and so is one older than the pod's deletion.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, Obj] = {}
        self._by_node: dict[str, dict[str, Obj]] = {}
        self._deleted_at: dict[str, int] = {}  # key -> resourceVersion of its deletion
        # key -> the last few versions' uid and annotations: what a writer read may be a
        # step behind the newest.
        self._history: dict[str, OrderedDict[str, Mapping[str, Any]]] = {}
        # node -> the count of pod changes at its last one (``changed_at``); a fresh list
        # moves every node to ``_listed_at``.
        self._changes = 0
        self._changed: dict[str, int] = {}
        self._listed_at = 0
        self.echoes = 0  # watch events ``holds`` kept from being decoded: own writes
        self.settled = 0  # ... and versions of pods done allocating that do not end them

    def offer(self, pod: Mapping[str, Any]) -> bool:
        """Keep ``pod`` unless a newer version (or its deletion) is already known."""
        if not isinstance(pod, Mapping) or pod.get("kind", "Pod") != "Pod":
            return False
        key = pod_key(pod)
        new = _version(pod)
        with self._lock:
            old = self._pods.get(key)
            old_v = _version(old) if old is not None else self._deleted_at.get(key)
            if new is not None and old_v is not None and new <= old_v:
                return False
            self._deleted_at.pop(key, None)
            self._drop(key)
            item = slim(pod)
            meta = item["metadata"]
            self._pods[key] = item
            versions = self._history.setdefault(key, OrderedDict())
            versions[str(meta.get("resourceVersion"))] = {
                k: meta[k] for k in _GUARDED_METADATA if k in meta
            }
            while len(versions) > _HISTORY:
                versions.popitem(last=False)
            node = _node_of(item)
            if node:
                self._by_node.setdefault(node, {})[key] = item
                self._changed_on(node)
            return True

    def delete(self, pod: Mapping[str, Any]) -> None:
        key = pod_key(pod)
        with self._lock:
            self._drop(key)
            self._history.pop(key, None)
            version = _version(pod)
            if version is not None:
                self._deleted_at[key] = version

    def replace_all(self, pods: list[Obj]) -> None:
        """A fresh list: it is the whole truth (a re-list after a watch gap).

        Swapped in at once: a reconcile running meanwhile must never see a half-filled
        index (a pod missing from it is a pod whose MIG instances may be destroyed). A pod
        known in a newer version than the listed one (the answer to this process's own
        write, made while the list was on its way) keeps that version.
        """
        fresh = PodIndex()
        for pod in pods:
            fresh.offer(pod)
        with self._lock:
            for key, known in self._pods.items():
                if key in fresh._pods:
                    fresh.offer(known)  # taken only if newer than the listed version
                    old = self._history.get(key, OrderedDict())
                    merged = OrderedDict(old)
                    merged.update(fresh._history.get(key, {}))
                    while len(merged) > _HISTORY:
                        merged.popitem(last=False)
                    fresh._history[key] = merged
            self._pods, self._by_node = fresh._pods, fresh._by_node
            self._deleted_at, self._history = {}, fresh._history
            self._changes += 1
            self._listed_at, self._changed = self._changes, {}

    def get(self, key: str) -> Obj | None:
        with self._lock:
            return self._pods.get(key)

    def holds(self, line: bytes) -> bool:
        """Whether a raw watch event need not be decoded: a pod's MODIFIED version this
        index already holds (or an older one, or one older than the pod's deletion), which
        ``offer`` would ignore: in practice the echo of this process's own patch, whose
        answer went into the index first and whose writer goes on from it (counted in
        ``echoes``); or a newer version of a pod its agent is done with that neither ends
        nor deletes it: kwok's status writes marking an allocated pod running (counted in
        ``settled``). The index keeps the version it has then: what the agents read of a
        pod done allocating (its node, annotations, phase) changes only when it ends, and
        what it has is newer than anything this process wrote to it."""
        head = modified_pod_head(line)
        if head is None:
            return False
        key, version = head
        with self._lock:
            pod = self._pods.get(key)
            held = _version(pod) if pod is not None else self._deleted_at.get(key)
            if held is None:
                return False
            if version <= held:
                self.echoes += 1
                return True
            if pod is None or not _allocated(pod) or _may_end(line):
                return False
            self.settled += 1
            return True

    def metadata_at(self, key: str, resource_version: str) -> Mapping[str, Any] | None:
        """The pod's uid and annotations as they were at ``resource_version``, if still
        remembered."""
        with self._lock:
            versions = self._history.get(key)
            return None if versions is None else versions.get(resource_version)

    def on_node(self, node: str) -> list[Obj]:
        with self._lock:
            return list(self._by_node.get(node, {}).values())

    def changed_at(self, node: str) -> int:
        """A mark that moves whenever a pod on ``node`` changes (comes, goes, or is
        replaced by a newer version) or a fresh list replaces the index: equal marks, the
        same pods."""
        with self._lock:
            return max(self._changed.get(node, 0), self._listed_at)

    def _changed_on(self, node: str) -> None:
        self._changes += 1
        self._changed[node] = self._changes

    def _drop(self, key: str) -> None:
        old = self._pods.pop(key, None)
        if old is not None:
            node = _node_of(old)
            pods = self._by_node.get(node)
            if pods is not None:
                pods.pop(key, None)
                if not pods:
                    self._by_node.pop(node, None)
            if node:
                self._changed_on(node)


class IndexedPodApi:
    """The allocator's ``PodApi``: the pods of a node come from the index; reads and writes
    go to the API and their answers update the index.

    A patch of annotations under a resourceVersion precondition is sent as a JSON patch that
    tests exactly the annotations it changes (their values at that version) and the pod's
    uid, instead of the whole object's version: kwok's own status updates of a freshly bound
    pod then no longer fail the agent's patch, while a change of what the allocator read
    still does (as a ``ConflictError``, so it re-reads and retries as before).
    """

    def __init__(self, kube: KubeClient, index: PodIndex) -> None:
        self._kube = kube
        self._index = index

    def get(self, path: str) -> Any:
        obj = self._kube.get(path)
        if isinstance(obj, Mapping):
            self._index.offer(obj)
        return obj

    def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]:
        if path == "/api/v1/pods" and field_selector and field_selector.startswith(_NODE_FIELD):
            node = field_selector[len(_NODE_FIELD) :]
            if node and "," not in node:
                return {"items": self._index.on_node(node)}
        return self._kube.list(path, field_selector=field_selector)

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any:
        ops = guarded_ops(self._read_at(path, resource_version), patch)
        if ops is None:
            obj = self._kube.merge_patch(path, patch, resource_version=resource_version)
        else:
            try:
                obj = self._kube.request("PATCH", path, ops, content_type=JSON_PATCH)
            except ApiError as e:
                if e.status != _TEST_FAILED:
                    raise
                raise ConflictError(e.method, path, 409, "Conflict", e.message) from e
        if isinstance(obj, Mapping):
            self._index.offer(obj)
        return obj

    def _read_at(self, path: str, resource_version: str | None) -> Mapping[str, Any] | None:
        """The pod at ``path`` as indexed at ``resource_version`` (its metadata)."""
        parts = path.split("/")
        if resource_version is None or len(parts) != 7 or parts[5] != "pods":
            return None
        meta = self._index.metadata_at(f"{parts[4]}/{parts[6]}", resource_version)
        return None if meta is None else {"metadata": meta}


def guarded_ops(pod: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> list[Obj] | None:
    """A JSON patch setting the annotations of ``patch`` (a merge patch of annotations only)
    that first tests ``pod``'s uid and the current values of those annotations; None when
    ``patch`` is anything else or ``pod`` is unknown."""
    if pod is None or set(patch) != {"metadata"}:
        return None
    meta = patch["metadata"]
    if not isinstance(meta, Mapping) or set(meta) != {"annotations"}:
        return None
    wanted = meta["annotations"]
    if not isinstance(wanted, Mapping) or not all(isinstance(v, str) for v in wanted.values()):
        return None
    pod_meta = pod.get("metadata") or {}
    current = pod_meta.get("annotations") or {}
    uid = pod_meta.get("uid")
    if not uid or not current:
        return None
    ops: list[Obj] = [{"op": "test", "path": "/metadata/uid", "value": uid}]
    for key, value in wanted.items():
        where = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        if key in current:
            ops.append({"op": "test", "path": where, "value": current[key]})
        # Absent keys are only ever written by this agent's serial per-node work.
        ops.append({"op": "add", "path": where, "value": value})
    return ops


class BoundPods:
    """The pod collection as the agents' reflector lists and watches it: only pods bound to
    a node (``BOUND_PODS``), so the apiserver sends, and the agents decode, a pod's events
    from its binding on; ``skip`` (``PodIndex.holds``) keeps the events of versions the
    index holds already from being decoded. A skipped event does not advance the version
    the reflector resumes from: after a reconnect it may come again and is skipped again."""

    def __init__(self, kube: KubeClient, skip: Callable[[bytes], bool] | None = None) -> None:
        self._kube = kube
        self._skip = skip

    def list(self, path: str) -> Obj:
        return self._kube.list(path, field_selector=BOUND_PODS)

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> WatchStream:
        return self._kube.watch(
            path, resource_version, field_selector=BOUND_PODS, timeout_s=timeout_s, skip=self._skip
        )


# Per-node serial work on a shared pool -----------------------------------------------------------


class NodeQueues:
    """Items queued per node, run by ``handler`` on ``workers`` threads: one node's items in
    order and one at a time, different nodes in parallel. An item already waiting is not
    queued twice (the handler reads the newest state when it runs).

    A node with items goes on one shared queue of nodes once, until its items run out; the
    threads take nodes from it. (A thread pool's future per submission cost the periodic
    pass, a submission per MIG node, more than the reconcile it queued.)"""

    def __init__(self, handler: Callable[[str, str], None], *, workers: int) -> None:
        self._handler = handler
        self._workers = max(1, workers)
        self._lock = threading.Lock()
        self._pending: dict[str, OrderedDict[str, None]] = {}
        self._running: set[str] = set()
        self._ready: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, node: str, item: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending.setdefault(node, OrderedDict())[item] = None
            if node in self._running:
                return
            self._running.add(node)
            if not self._threads:  # started at the first item, as a pool starts its threads
                self._threads = [
                    threading.Thread(target=self._serve, name=f"kwok-{i}", daemon=True)
                    for i in range(self._workers)
                ]
                for t in self._threads:
                    t.start()
        self._ready.put(node)

    def _serve(self) -> None:
        while (node := self._ready.get()) is not None:
            self._drain(node)

    def _drain(self, node: str) -> None:
        while True:
            with self._lock:
                items = self._pending.get(node)
                if not items or self._closed:
                    self._pending.pop(node, None)
                    self._running.discard(node)
                    return
                item, _ = items.popitem(last=False)
            try:
                self._handler(node, item)
            except Exception as e:  # one bad item must not stop the node's queue
                log.exception("kwok.work_failed", node=node, item=item, error=repr(e))

    def idle(self) -> bool:
        with self._lock:
            return not self._running

    def close(self) -> None:
        """Items not started are dropped; an item running finishes first."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._ready.put(None)
        for t in threads:
            t.join()


# The agents ------------------------------------------------------------------------------------


class ReconcileMarks(NamedTuple):
    """What a node's reconcile reads, as counts that move when it changes."""

    pods: int  # the pod index's change mark for the node
    gpus: int  # the simulated GPUs' changes
    mig: int  # the MIG manager's record changes (``MigManager.changes``)


@dataclass
class FakeNode:
    name: str
    backend: SimulatedNvml
    mig: MigManager
    allocator: Allocator
    has_mig: bool = False
    mps: MpsDaemons | None = None
    mps_backend: SimulatedMps | None = None
    mps_gpus: tuple[str, ...] = ()
    # GPU -> health as the node's register annotation says it (what the scheduler sees).
    published: dict[str, bool] = field(default_factory=dict)
    # What the last reconcile that found nothing to do read: the node's pods' mark, the
    # simulated GPUs' and the manager's change counts (``KwokAgents.reconcile``).
    settled_at: ReconcileMarks | None = None


class KwokAgents:
    """One simulated agent per fake node: those there at start are started once the first
    pod list is indexed, a later node's when a pod first lands on it."""

    def __init__(
        self,
        kube: KubeClient,
        config: DeviceConfig,
        *,
        state_dir: Path | None = None,
        watch_timeout_s: int = 10,
        workers: int = DEFAULT_WORKERS,
        mps_check_interval_s: float = DEFAULT_MPS_CHECK_S,
    ) -> None:
        self._kube = kube
        self._config = config
        self._state_dir = state_dir
        self._watch_timeout_s = watch_timeout_s
        self._mps_check_s = mps_check_interval_s
        self._mps_halt = threading.Event()
        self._mps_thread: threading.Thread | None = None
        self._nodes: dict[str, FakeNode | None] = {}
        self._lock = threading.Lock()
        self._reflector: Reflector | None = None
        self.pods = PodIndex()
        self._pod_api = IndexedPodApi(kube, self.pods)
        self._queues = NodeQueues(self._work, workers=workers)
        self._hold = CreationHold.from_env()  # None outside the fault tests
        # The fake nodes of the last node list not built yet: name -> their annotations.
        self._listed_nodes: dict[str, Mapping[str, str]] = {}
        self._listed_at: float | None = None
        self._list_lock = threading.Lock()
        self._started_all = False  # set by the reflector's thread at the first pod list

    # Per node -----------------------------------------------------------------------------

    def node(self, name: str) -> FakeNode | None:
        """The agent of fake node ``name`` (built on first use); None for other nodes."""
        with self._lock:
            if name in self._nodes:
                return self._nodes[name]
        agent = self._build(name)
        with self._lock:
            self._nodes.setdefault(name, agent)
            return self._nodes[name]

    def started(self) -> set[str]:
        """The fake nodes whose agent has started."""
        with self._lock:
            return {name for name, agent in self._nodes.items() if agent is not None}

    def _from_node_list(self, name: str) -> Mapping[str, str] | None:
        """The annotations of fake node ``name`` from a node list: the last one, or a new
        one when it lacks the node and is ``NODE_RELIST_S`` old. None: not listed (or the
        list failed), so look it up alone. A burst landing on thousands of nodes costs a
        few paged lists, not a GET per node."""
        with self._list_lock:
            found = self._listed_nodes.pop(name, None)
            if found is not None:
                return found
            now = time.monotonic()
            if self._listed_at is not None and now - self._listed_at < NODE_RELIST_S:
                return None
            self._list_nodes(now)
            return self._listed_nodes.pop(name, None)

    def _list_nodes(self, now: float) -> None:
        """One paged LIST: the fake nodes without an agent yet (caller holds the list lock)."""
        self._listed_at = now
        try:
            items = self._kube.list("/api/v1/nodes", limit=_NODE_PAGE).get("items") or []
        except TesseraError as e:
            log.warning("kwok.node_list_failed", error=str(e))
            return
        with self._lock:
            built = set(self._nodes)
        listed: dict[str, Mapping[str, str]] = {}
        for item in items:
            meta = item.get("metadata") or {}
            ann = meta.get("annotations") or {}
            node_name = meta.get("name")
            if node_name not in built and _is_fake(ann):
                listed[str(node_name)] = {
                    KWOK_NODE_ANNOTATION: ann[KWOK_NODE_ANNOTATION],
                    NODE_REGISTER: ann[NODE_REGISTER],
                }
        self._listed_nodes = listed

    def start_all(self) -> None:
        """Start the agent of every fake node there is now, each on its node's queue, as a
        real node's agent starts when the node boots rather than at its first pod. Runs
        once the first pod list is indexed: an agent's start adopts what its node's pods
        hold."""
        with self._list_lock:
            self._list_nodes(time.monotonic())
            names = list(self._listed_nodes)
        for name in names:
            self._queues.submit(name, _START)
        log.info("kwok.node_agents_starting", nodes=len(names))

    def _build(self, name: str) -> FakeNode | None:
        ann = self._from_node_list(name)
        if ann is None:
            try:
                node = self._kube.get(f"/api/v1/nodes/{name}")
            except NotFoundError:
                return None
            ann = (node.get("metadata") or {}).get("annotations") or {}
        if not _is_fake(ann):
            return None
        devices = sorted(decode(ann[NODE_REGISTER], obj=f"node {name}"), key=lambda d: d.index)
        specs = [
            SimulatedGpuSpec(
                find_model(d.type).name, uuid=d.id, numa=d.numa, mig_enabled=d.mode == "mig"
            )
            for d in devices
        ]
        state = self._state_dir / f"{name}.json" if self._state_dir else None
        backend = SimulatedNvml(specs, state, node_name=name, hold=self._hold)
        backend.init()
        mig = MigManager(backend, node_name=name)
        mode = devices[0].mode if devices else None
        mps_backend: SimulatedMps | None = None
        mps: MpsDaemons | None = None
        if mode == "mps":
            root = self._state_dir / f"{name}.mps" if self._state_dir else None
            mps_backend = SimulatedMps(root, node_name=name)
            mps = MpsDaemons(mps_backend, node_name=name)
        allocator = Allocator(
            name, self._pod_api, backend, mig, self._config, operating_mode=mode, mps=mps
        )
        read = desired_from_pods(self.pods.on_node(name), node_name=name)
        mig.adopt_on_start(read.desired, reason=read.reason)
        node = FakeNode(
            name,
            backend,
            mig,
            allocator,
            has_mig=any(s.mig_enabled for s in specs),
            mps=mps,
            mps_backend=mps_backend,
            mps_gpus=tuple(d.id for d in devices) if mps is not None else (),
            published={d.id: d.health for d in devices},
        )
        if mps is not None:
            self.check_mps(node)  # start (or adopt) the daemons as the node's agent starts
        log.info("kwok.node_agent_started", node=name, gpus=len(specs), mode=mode)
        return node

    def allocate(self, node: FakeNode, namespace: str, name: str) -> None:
        """Every remaining container of the pod, in order, as the kubelet would."""
        for _ in range(MAX_CONTAINERS):
            if node.allocator.allocate_next(namespace, name) is None:
                return

    def reconcile(self, node: FakeNode) -> None:
        """Reconcile the node's MIG instances with its pods; skipped when what it reads (the
        node's pods, its simulated GPUs, the manager's records) has not changed since one
        that found nothing to do, which this one would repeat: the periodic pass then
        costs three counts per node, not a look at each of its GPUs. A simulated GPU
        changes only through its backend, which counts; a real node's agent, whose GPUs can
        change behind its back, reconciles every time."""
        seen = self._marks(node)
        if seen == node.settled_at:
            return
        read = desired_from_pods(self.pods.on_node(node.name), node_name=node.name)
        report = node.mig.reconcile(read.desired, reason=read.reason, as_of=seen.mig)
        node.settled_at = seen if report.settled else None

    def _marks(self, node: FakeNode) -> ReconcileMarks:
        """What a reconcile of ``node`` reads, as marks that move when it changes."""
        return ReconcileMarks(
            self.pods.changed_at(node.name), node.backend.changes, node.mig.changes
        )

    def check_mps(self, node: FakeNode) -> None:
        """One check of the node's MPS daemons (restarting those down), then the register
        annotation brought in line with their health."""
        mps = node.mps
        if mps is None:
            return
        try:
            mps.sync(node.mps_gpus)
        except TesseraError as e:
            log.warning("kwok.mps_check_failed", node=node.name, error=str(e))
            return
        self._publish_mps_health(node, mps.health())

    def _publish_mps_health(self, node: FakeNode, health: Mapping[str, bool]) -> None:
        wanted = {gpu: health.get(gpu, False) for gpu in node.mps_gpus}
        if wanted == node.published:
            return
        path = f"/api/v1/nodes/{node.name}"
        try:
            obj = self._kube.get(path)
            meta = obj.get("metadata") or {}
            value = (meta.get("annotations") or {}).get(NODE_REGISTER)
            if not isinstance(value, str):
                raise InvalidAnnotationError(NODE_REGISTER, "is missing", obj=f"node {node.name}")
            new = with_gpu_health(value, wanted, obj=f"node {node.name}")
            if new != value:
                self._kube.merge_patch(
                    path,
                    {"metadata": {"annotations": {NODE_REGISTER: new}}},
                    resource_version=meta.get("resourceVersion"),
                )
        except TesseraError as e:  # a conflict or an API hiccup: the next check retries
            log.warning("kwok.mps_health_not_published", node=node.name, error=str(e))
            return
        back = any(up and not node.published.get(gpu, False) for gpu, up in wanted.items())
        node.published = wanted
        log.info(
            "kwok.mps_health_published",
            node=node.name,
            unhealthy=sorted(gpu for gpu, up in wanted.items() if not up),
        )
        if back:  # pods refused while a daemon was down get their Allocate now
            for pod in self.pods.on_node(node.name):
                if annotations_of(pod).get(BIND_PHASE) == "allocating" and _has_pending(pod):
                    self._queues.submit(node.name, pod_key(pod))

    # Events -------------------------------------------------------------------------------

    def handle(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """React to one pod event (also used for the listed pods, as ADDED): index it at
        once, and queue a look at it on its node when there is something to do."""
        if event_type == "DELETED":
            self.pods.delete(pod)
        else:
            self.pods.offer(pod)
        node_name = _node_of(pod)
        key = pod_key(pod)
        # A version after which the pod has nothing to do (kwok marking an allocated pod
        # running) wakes no worker.
        if node_name and _pod_work(self.pods.get(key), node_name) is not None:
            self._queues.submit(node_name, key)

    def _work(self, node_name: str, key: str) -> None:
        node = self.node(node_name)
        if node is None:
            return
        try:
            if key == _START:
                return
            if key == _RECONCILE:
                self.reconcile(node)
                return
            if key == _MPS_CHECK:
                self.check_mps(node)
                return
            work = _pod_work(self.pods.get(key), node_name)
            if work == "reconcile" and node.has_mig:
                self.reconcile(node)
            elif work == "allocate":
                namespace, _, name = key.partition("/")
                self.allocate(node, namespace, name)
        except TesseraError as e:
            log.warning("kwok.pod_failed", node=node_name, pod=key, error=str(e))

    def pass_all(self) -> None:
        """Queue a reconcile of every fake node with MIG GPUs known so far (the periodic
        pass), but for those a reconcile would skip (``reconcile``): looked at here, they
        cost no worker a wake-up."""
        with self._lock:
            nodes = [n for n in self._nodes.values() if n is not None and n.has_mig]
        for node in nodes:
            if self._marks(node) != node.settled_at:
                self._queues.submit(node.name, _RECONCILE)

    def mps_pass(self) -> None:
        """Queue a check of every fake mps node's daemons known so far (the periodic pass)."""
        with self._lock:
            nodes = [n.name for n in self._nodes.values() if n is not None and n.mps is not None]
        for name in nodes:
            self._queues.submit(name, _MPS_CHECK)

    def idle(self) -> bool:
        """Nothing queued or running (for tests and benchmarks)."""
        return self._queues.idle()

    def _mps_loop(self) -> None:
        while not self._mps_halt.wait(self._mps_check_s):
            self.mps_pass()

    # Loop ---------------------------------------------------------------------------------

    def _listed(self, pods: list[dict[str, Any]], listed_at: float) -> None:
        self.pods.replace_all(pods)
        for pod in pods:
            node_name = _node_of(pod)
            if node_name:
                self._queues.submit(node_name, pod_key(pod))
        if not self._started_all:
            self._started_all = True
            threading.Thread(target=self.start_all, name="kwok-start", daemon=True).start()

    def start(self) -> None:
        """List + watch the pods bound to a node (``BoundPods``; relists on 410 Gone, backs
        off on errors); every watch stream that ends also runs the periodic reconcile pass."""
        self._reflector = Reflector(
            BoundPods(self._kube, self.pods.holds),
            "/api/v1/pods",
            on_list=self._listed,
            on_event=self.handle,
            on_watch_end=self.pass_all,
            watch_timeout_s=self._watch_timeout_s,
        )
        self._reflector.start()
        self._mps_halt.clear()
        self._mps_thread = threading.Thread(target=self._mps_loop, name="kwok-mps", daemon=True)
        self._mps_thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loops and the workers, and shut every simulated NVML session down (the
        simulated MPS daemons keep running, as a real node's outlive its agent)."""
        if self._reflector is not None:
            self._reflector.stop(timeout_s)
            self._reflector = None
        self._mps_halt.set()
        if self._mps_thread is not None:
            self._mps_thread.join(timeout_s)
            self._mps_thread = None
        self._queues.close()
        with self._lock:
            nodes = [n for n in self._nodes.values() if n is not None]
        for node in nodes:
            node.backend.shutdown()
        log.info(
            "kwok.node_agents_stopped",
            nodes=len(nodes),
            echoes_not_decoded=self.pods.echoes,
            settled_not_decoded=self.pods.settled,
        )

    def __enter__(self) -> KwokAgents:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# A GPU object's top-level health member as a Go encoder writes it: after another member,
# so it starts with a comma. Inside a JSON string a quote is always escaped, so ``,"`` never
# occurs there and this cannot match string content.
_HEALTH_MEMBER: Final = re.compile(r',\s*"health"\s*:\s*(true|false)')


def with_gpu_health(value: str, health: Mapping[str, bool], *, obj: str = "") -> str:
    """``value`` (a ``hami.io/node-nvidia-register`` annotation) with the health flag of each
    GPU in ``health`` set as given, every other byte kept: the other GPUs' objects, the
    text between them, and the rest of that GPU's object. A healthy GPU gets
    ``,"health":true`` (added last, HAMi's field order, when absent); an unhealthy one has
    the member removed (HAMi leaves false out). Raises ``InvalidAnnotationError`` for a
    value that does not decode."""
    decode(value, obj=obj)  # validated whole first: the scan below trusts its structure
    decoder = json.JSONDecoder()
    out: list[str] = []
    pos = value.index("[") + 1
    out.append(value[:pos])
    while True:
        start = _skip_ws(value, pos)
        if value[start] == "]":
            out.append(value[pos:])
            return "".join(out)
        out.append(value[pos:start])
        item, end = decoder.raw_decode(value, start)
        text = value[start:end]
        gpu = item.get("id")
        if gpu in health and bool(item.get("health", False)) != health[gpu]:
            text = _set_health(text, health[gpu], "health" in item, obj=obj)
        out.append(text)
        sep = _skip_ws(value, end)
        out.append(value[end : sep + 1])  # whitespace and the "," or "]"
        if value[sep] == "]":
            out.append(value[sep + 1 :])
            return "".join(out)
        pos = sep + 1


def _skip_ws(text: str, pos: int) -> int:
    while text[pos] in " \t\r\n":
        pos += 1
    return pos


def _set_health(text: str, healthy: bool, present: bool, *, obj: str) -> str:
    members = list(_HEALTH_MEMBER.finditer(text))
    if len(members) != int(present):
        raise InvalidAnnotationError(
            NODE_REGISTER,
            "a GPU object's health member is not where an encoder writes it (after another "
            "member, once)",
            obj=obj,
        )
    if not members:
        return text[:-1] + ',"health":true}'  # absent means false: only ever set to true
    m = members[0]
    if healthy:
        return text[: m.start(1)] + "true" + text[m.end(1) :]
    return text[: m.start()] + text[m.end() :]


def _is_fake(annotations: Mapping[str, str]) -> bool:
    """A kwok node Tessera simulates: marked fake, with its GPUs registered."""
    return annotations.get(KWOK_NODE_ANNOTATION) == "fake" and NODE_REGISTER in annotations


def _ended(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return (
        bool(meta.get("deletionTimestamp"))
        or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES
    )


def _pod_work(
    pod: Mapping[str, Any] | None, node_name: str
) -> Literal["allocate", "reconcile"] | None:
    """What node ``node_name``'s agent has to do for a pod as the index holds it (None:
    gone): reconcile the node's MIG instances when the pod is gone, moved or ended, allocate
    it while it is allocating with containers left, else nothing."""
    if pod is None or _node_of(pod) != node_name or _ended(pod):
        return "reconcile"
    if annotations_of(pod).get(BIND_PHASE) == "allocating" and _has_pending(pod):
        return "allocate"
    return None


def _allocated(pod: Mapping[str, Any]) -> bool:
    """Its agent allocated every container: nothing left to do until the pod ends."""
    return annotations_of(pod).get(BIND_PHASE) == "success" and not _has_pending(pod)


# Raw bytes of a pod event that may end the pod (``_ended``: deleting, or a terminal
# phase): unescaped, so a string value that merely contains them (escaped quotes) never
# matches; a version that has one is decoded.
_ENDING: Final = (
    b'"deletionTimestamp"',
    *(b'"phase":"%s"' % phase.encode() for phase in TERMINAL_PHASES),
)


def _may_end(line: bytes) -> bool:
    return any(mark in line for mark in _ENDING)


def _has_pending(pod: Mapping[str, Any]) -> bool:
    """Some container's to-allocate entry is not empty yet."""
    return bool(annotations_of(pod).get(DEVICES_TO_ALLOCATE, "").strip(";"))
