"""Kubernetes Events that say why a pending GPU pod cannot be placed, why a placed one keeps
its GPU from new work, or which pods kube-scheduler preempted for a GPU pod.

kube-scheduler writes the PodScheduled condition from the status the shim returns; this adds a
Warning Event (reason ``TesseraUnschedulable``) with the per-node-class explanation, at most
once per ``min_interval_s`` per pod unless the explanation changes. A pod holding MIG devices
HAMi <= v2.9 placed gets one (reason ``TesseraLegacyMigDevice``) when the plugin server reads
it, with what to do. When kube-scheduler preempts pods for a GPU pod, the pod gets a Normal
Event (reason ``TesseraPreemption``) naming the victims, their node and GPUs or MIG slices and
which of its needs they were blocking (``PreemptionReporter``, which also counts
``tessera_preemptions_total``/``tessera_preemption_victims_total``). A gang kube-scheduler
could not place gets a Warning Event on its PodGroup (reason ``TesseraGangUnschedulable``)
naming the members that did not fit and why (``server/gangs.py``). Posting happens on a
worker thread so a slow apiserver never delays a scheduling cycle; when the queue is full the
event is dropped (the next cycle records it again).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from api.errors import InvalidInputError
from api.kube.errors import KubeError
from api.kube.objects import as_object, pod_key, pod_priority
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.preemptions import (
    DEFAULT_SETTLE_S,
    DEFAULT_WINDOW_S,
    Nominee,
    Preemption,
    PreemptionTracker,
    Victim,
    blocking_needs,
)
from scheduler_plugins.core.requests import PodAllocation, parse_request

log = structlog.get_logger("tessera.plugin_server.events")

REASON = "TesseraUnschedulable"
LEGACY_MIG_REASON = "TesseraLegacyMigDevice"
PREEMPTION_REASON = "TesseraPreemption"
GANG_REASON = "TesseraGangUnschedulable"
COMPONENT = "tessera-plugin-server"
_MAX_MESSAGE = 1024
_MAX_PODS_REMEMBERED = 10_000


class EventPoster(Protocol):
    def post(self, path: str, body: object) -> Any: ...


@dataclass(frozen=True)
class EventTarget:
    """The object an Event is about: a pod unless told otherwise."""

    namespace: str
    name: str
    uid: str
    kind: str = "Pod"
    api_version: str = "v1"

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> EventTarget:
        meta = as_object(pod.get("metadata"))
        return cls(
            str(meta.get("namespace") or "default"),
            str(meta.get("name", "")),
            str(meta.get("uid", "")),
        )


class EventRecorder:
    def __init__(
        self,
        kube: EventPoster,
        *,
        min_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        queue_size: int = 256,
    ) -> None:
        self._kube = kube
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(queue_size)
        self._last: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._instance = socket.gethostname()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("event queue full at stop; pending events dropped")
        self._thread.join(timeout_s)
        self._thread = None

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued event was posted (or failed); for tests and shutdown."""
        deadline = self._clock() + timeout_s
        while self._queue.unfinished_tasks and self._clock() < deadline:
            time.sleep(0.01)

    def unschedulable(self, pod: EventTarget, message: str) -> bool:
        """Queue a Warning Event for ``pod``; False when rate-limited or the queue is full."""
        return self._record(pod, REASON, message, "Warning")

    def preempted(self, pod: EventTarget, message: str) -> bool:
        """Queue a Normal Event for ``pod``: kube-scheduler preempted pods for it."""
        return self._record(pod, PREEMPTION_REASON, message, "Normal")

    def gang_unschedulable(self, gang: EventTarget, message: str) -> bool:
        """Queue a Warning Event for a PodGroup kube-scheduler could not place: which members
        did not fit and why."""
        return self._record(gang, GANG_REASON, message, "Warning")

    def legacy_mig(self, pod: EventTarget, alloc: PodAllocation) -> bool:
        """Queue a Warning Event: ``pod`` holds MIG devices HAMi <= v2.9 placed."""
        slots = ", ".join(d.written_uuid for d in alloc.devices if d.legacy is not None)
        gpus = ", ".join(sorted({d.uuid for d in alloc.devices if d.legacy is not None}))
        return self._record(
            pod,
            LEGACY_MIG_REASON,
            f"holds MIG devices HAMi <= v2.9 placed on node {alloc.node} ({slots}), whose "
            f"placement Tessera cannot know: GPU {gpus} takes no new work while the pod runs. "
            "Delete the pod to have it scheduled again with a reserved MIG placement",
            "Warning",
        )

    def _record(self, pod: EventTarget, reason: str, message: str, kind: str) -> bool:
        key = f"{reason}/{pod.uid or f'{pod.namespace}/{pod.name}'}"
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and last[1] == message and now - last[0] < self._min_interval_s:
                return False
            self._last[key] = (now, message)
            self._last.move_to_end(key)
            while len(self._last) > _MAX_PODS_REMEMBERED:
                self._last.popitem(last=False)
        try:
            self._queue.put_nowait(self._event(pod, reason, message, kind))
        except queue.Full:
            log.warning("event queue full; event dropped", pod=f"{pod.namespace}/{pod.name}")
            return False
        return True

    def _event(self, pod: EventTarget, reason: str, message: str, kind: str) -> dict[str, Any]:
        ts = datetime.fromtimestamp(self._wall_clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE - 1] + "…"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {
                "apiVersion": pod.api_version,
                "kind": pod.kind,
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": pod.uid,
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                ns = event["metadata"]["namespace"]
                self._kube.post(f"/api/v1/namespaces/{ns}/events", event)
            except KubeError as e:
                obj = event["involvedObject"] if event else {}
                log.warning(
                    "cannot record event",
                    pod=f"{obj.get('namespace')}/{obj.get('name')}",
                    error=str(e),
                )
            finally:
                self._queue.task_done()


class PreemptionMetrics(Protocol):
    def count_preemption(self, needs: Sequence[str], victims: int) -> None: ...


class PreemptionReporter:
    """Reports kube-scheduler's preemptions for GPU pods: the cache tells it, from the watch,
    the pods marked for preemption and the pods nominated to a node; a worker pairs them
    (``core.preemptions``) every ``interval_s`` and, per preemption, queues an Event on the
    preemptor and counts it. A pod that cannot be read is left out; nothing one object does
    stops the rest."""

    def __init__(
        self,
        cache: ClusterCache,
        events: EventRecorder,
        metrics: PreemptionMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float = DEFAULT_SETTLE_S,
        window_s: float = DEFAULT_WINDOW_S,
        interval_s: float = 1.0,
    ) -> None:
        self._cache = cache
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._interval_s = interval_s
        self._tracker = PreemptionTracker(settle_s=settle_s, window_s=window_s)  # cache lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        cache.on_preemption(self._victim, self._nominated)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="preemptions", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def tick(self) -> int:
        """Report the preemptions due now; how many."""
        reports: list[Preemption] = []
        with self._cache.lock:
            for p in self._tracker.due(self._clock()):
                try:
                    p = replace(p, blocking=blocking_needs(self._cache.state, p))
                except Exception as e:  # report it anyway, without the why
                    log.warning(
                        "cannot tell what preempted pods were blocking",
                        pod=p.preemptor.key,
                        node=p.node,
                        error=repr(e),
                    )
                reports.append(p)
        for p in reports:
            namespace, _, name = p.preemptor.key.partition("/")
            self._events.preempted(EventTarget(namespace, name, p.preemptor.uid), p.describe())
            self._metrics.count_preemption(p.needs(), len(p.victims))
            log.info(
                "preemption",
                pod=p.preemptor.key,
                node=p.node,
                victims=[v.key for v in p.victims],
                needs=p.needs(),
            )
        return len(reports)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.tick()
            except Exception as e:  # the next tick tries again
                log.exception("preemption report failed", error=repr(e))

    # ----- from the watch (under the cache's lock) ------------------------------------------

    def _victim(self, pod: Mapping[str, Any], held: PodAllocation | None) -> None:
        try:
            if held is None or not held.holds_gpus:
                return  # it frees nothing Tessera counts: kube-scheduler's business
            self._tracker.victim(Victim(pod_key(pod), pod_priority(pod), held, self._clock()))
        except Exception as e:
            log.warning("preempted pod left out", pod=pod_key(pod), error=repr(e))

    def _nominated(self, pod: Mapping[str, Any], node: str) -> None:
        if not node:
            self._tracker.withdrawn(pod_key(pod))
            return
        try:
            request = parse_request(pod, self._cache.state.config)
        except InvalidInputError:
            return  # not a pod Tessera places
        except Exception as e:
            log.warning("nominated pod left out", pod=pod_key(pod), node=node, error=repr(e))
            return
        if request.wants_gpu:
            target = EventTarget.of(pod)
            self._tracker.nominated(Nominee(request.key, target.uid, node, request, self._clock()))
