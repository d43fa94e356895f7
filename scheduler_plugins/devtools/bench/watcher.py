"""When each benchmark pod was bound, from one list + watch of the benchmark namespace.

``creationTimestamp`` has one-second resolution, so latencies are measured on this process's
monotonic clock: the runner records when it sent each create, and ``PodTimes`` when the watch
first showed the pod bound (``spec.nodeName``), for Tessera when the node agent finished
(``hami.io/bind-phase: success``), and when it ran (``status.phase: Running``, kwok's status
write on the fake nodes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from api.hami import keys as ann
from api.kube.reflector import Kube, Reflector

Obj = Mapping[str, Any]


class PodTimes:
    """Thread-safe record of the pods of one namespace; ``start`` / ``stop`` the watch."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_timeout_s: int = 60,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.bound_at: dict[str, float] = {}
        self.allocated_at: dict[str, float] = {}
        self.running_at: dict[str, float] = {}
        self.failed: set[str] = set()
        self.node_of: dict[str, str] = {}
        self.live: set[str] = set()
        self._reflector = Reflector(
            kube,
            f"/api/v1/namespaces/{namespace}/pods",
            on_list=self._listed,
            on_event=self._event,
            watch_timeout_s=watch_timeout_s,
        )

    def start(self, timeout_s: float = 60.0) -> None:
        self._reflector.start()
        if not self._reflector.synced.wait(timeout_s):
            self._reflector.stop()
            raise TimeoutError(f"pod watch of {self._reflector.path} not synced in {timeout_s}s")

    def stop(self) -> None:
        self._reflector.stop()

    # Reading ------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(bound, allocated) so far."""
        with self._lock:
            return len(self.bound_at), len(self.allocated_at)

    def snapshot(
        self,
    ) -> tuple[dict[str, float], dict[str, float], dict[str, str], dict[str, float]]:
        """Copies of (bound_at, allocated_at, node_of, running_at)."""
        with self._lock:
            return (
                dict(self.bound_at),
                dict(self.allocated_at),
                dict(self.node_of),
                dict(self.running_at),
            )

    def live_names(self) -> set[str]:
        with self._lock:
            return set(self.live)

    def wait_changed(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait(timeout_s)

    # Feeding ------------------------------------------------------------------------------

    def _listed(self, pods: list[dict[str, Any]], listed_at: float) -> None:
        for pod in pods:
            self._event("ADDED", pod)

    def _event(self, event_type: str, pod: Obj) -> None:
        now = self._clock()
        meta = pod.get("metadata") or {}
        name = str(meta.get("name", ""))
        with self._changed:
            if event_type == "DELETED":
                self.live.discard(name)
            else:
                self.live.add(name)
                node = (pod.get("spec") or {}).get("nodeName")
                if node:
                    self.bound_at.setdefault(name, now)
                    self.node_of[name] = str(node)
                if (pod.get("status") or {}).get("phase") == "Running":
                    self.running_at.setdefault(name, now)
                phase = (meta.get("annotations") or {}).get(ann.BIND_PHASE)
                if phase == "success":
                    self.allocated_at.setdefault(name, now)
                elif phase == "failed":
                    self.failed.add(name)
            self._changed.notify_all()
