"""Gangs: what kube-scheduler decided for each PodGroup, said with what Tessera knows.

kube-scheduler 1.36 (feature gates GenericWorkload and GangScheduling) places a gang's
members in one cycle and records the outcome in the PodGroup's ``PodGroupScheduled``
condition. ``GangReporter`` watches PodGroups (only where the API server serves them) and, on
each change of that condition, counts ``tessera_gangs_total{outcome}`` and, for an
unschedulable gang, posts a ``TesseraGangUnschedulable`` Event on the PodGroup naming the
members whose GPU requests did not fit and why (``core.gangs.GangBook``, fed by PreFilter).
A member of an admitted gang released before it was bound (the shim's Unreserve says so)
counts the gang ``timed_out`` once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Final, Protocol

import structlog

from api.kube.client import Obj
from api.kube.errors import KubeError, NotFoundError
from api.kube.objects import as_object
from api.kube.reflector import DEFAULT_BACKOFF, Backoff, Kube, Reflector
from scheduler_plugins.core.gangs import (
    PODGROUP_API,
    GangBook,
    gang_policy,
    pod_gang,
    scheduled_condition,
)
from scheduler_plugins.server.events import EventRecorder, EventTarget

log = structlog.get_logger("tessera.plugin_server.gangs")

GROUP_VERSION: Final = PODGROUP_API
PODGROUPS: Final = f"/apis/{GROUP_VERSION}/podgroups"


class GangMetrics(Protocol):
    def count_gang(self, outcome: str) -> None: ...


class ServedKube(Kube, Protocol):
    def get(self, path: str) -> Any: ...


class GangReporter:
    """The gang book, the PodGroup watch, the gang metrics and Events."""

    def __init__(
        self,
        kube: ServedKube,
        events: EventRecorder | None,
        metrics: GangMetrics,
        *,
        watch_timeout_s: int = 60,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self._kube = kube
        self._events = events
        self._metrics = metrics
        self._book = GangBook()
        self._lock = threading.Lock()
        # PodGroup key -> its last PodGroupScheduled (status, reason), None before the first
        self._conditions: dict[str, tuple[str, str] | None] = {}
        self._reflector = Reflector(
            kube,
            PODGROUPS,
            on_list=self._listed,
            on_event=self._event,
            watch_timeout_s=watch_timeout_s,
            backoff=backoff,
        )
        self.watching = False

    def start(self) -> None:
        """Watch PodGroups when the API server serves them; else gangs are kube-scheduler's
        business alone (its GenericWorkload gate is off too: it refuses to start otherwise)."""
        try:
            self._kube.get(f"/apis/{GROUP_VERSION}")
        except NotFoundError:
            log.info("the API server serves no PodGroups; gang reports off", api=GROUP_VERSION)
            return
        except KubeError as e:
            log.warning(
                "cannot tell whether the API server serves PodGroups; watching anyway",
                api=GROUP_VERSION,
                error=str(e),
            )
        self._reflector.start()
        self.watching = True

    def stop(self) -> None:
        if self.watching:
            self._reflector.stop()

    # ----- from the servicer ---------------------------------------------------------------

    def offered(self, pod: Mapping[str, Any], key: str, why_not: str | None) -> None:
        """PreFilter decided ``pod``: record it when it is a gang member."""
        gang = pod_gang(pod)
        if gang is not None:
            with self._lock:
                self._book.offered(gang, key, why_not)

    def released(self, key: str) -> None:
        """Unreserve let member ``key`` of an admitted gang go before it was bound."""
        with self._lock:
            gang = self._book.released(key)
        if gang is not None:
            log.info("admitted gang lost a member before binding", gang=gang, pod=key)
            self._metrics.count_gang("timed_out")

    # ----- the PodGroup watch ---------------------------------------------------------------

    def _listed(self, items: list[Obj], listed_at: float) -> None:
        # A (re)list is the state as it is, not news: remember it without counting.
        with self._lock:
            self._conditions = {_key(pg): scheduled_condition(pg) for pg in items}

    def _event(self, typ: str, pg: Obj) -> None:
        key = _key(pg)
        if typ == "DELETED":
            with self._lock:
                self._conditions.pop(key, None)
                self._book.forget(key)
            return
        min_count, now = gang_policy(pg), scheduled_condition(pg)
        with self._lock:
            before = self._conditions.get(key)
            self._conditions[key] = now
            if min_count is None or now is None or now == before:
                return
            status, reason = now
            if status == "True":
                self._book.admitted(key)
                outcome, message = "admitted", None
            elif reason == "Unschedulable":
                outcome, message = "unschedulable", self._book.summary(key, min_count)
            else:
                return
        self._metrics.count_gang(outcome)
        log.info("gang " + outcome, gang=key, why=message)
        if message is not None and self._events is not None:
            meta = as_object(pg.get("metadata"))
            self._events.gang_unschedulable(
                EventTarget(
                    str(meta.get("namespace") or "default"),
                    str(meta.get("name", "")),
                    str(meta.get("uid", "")),
                    kind="PodGroup",
                    api_version=GROUP_VERSION,
                ),
                message,
            )


def _key(pg: Mapping[str, Any]) -> str:
    meta = as_object(pg.get("metadata"))
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"
