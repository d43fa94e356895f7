"""The list+watch loops that keep the ``ClusterCache`` current.

One ``Reflector`` (``api.kube.reflector``) per resource, nodes and pods.
``Watches.ready`` is set once both initial lists are in the cache: before that the server
does not answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from api.kube.client import Obj
from api.kube.reflector import (
    DEFAULT_BACKOFF,
    Backoff,
    Kube,
    Reflector,
    WatchStream,
)
from scheduler_plugins.core.cache import ClusterCache

log = structlog.get_logger("tessera.plugin_server.watch")

NODES = "/api/v1/nodes"
PODS = "/api/v1/pods"


def _cache_callbacks(
    cache: ClusterCache,
) -> tuple[
    Callable[[list[Obj], float], None],
    Callable[[str, Obj], None],
    Callable[[list[Obj], float], None],
    Callable[[str, Obj], None],
]:
    def nodes_listed(items: list[Obj], listed_at: float) -> None:
        cache.replace_nodes(items)

    def node_event(typ: str, obj: Obj) -> None:
        if typ == "DELETED":
            cache.delete_node(str((obj.get("metadata") or {}).get("name", "")))
        else:
            cache.apply_node(obj)

    def pods_listed(items: list[Obj], listed_at: float) -> None:
        cache.replace_pods(items, listed_at)

    def pod_event(typ: str, obj: Obj) -> None:
        if typ == "DELETED":
            cache.delete_pod(obj)
        else:
            cache.apply_pod(obj)

    return nodes_listed, node_event, pods_listed, pod_event


class Watches:
    """The node and pod reflectors feeding one cache; ``ready`` once both have listed."""

    def __init__(
        self,
        kube: Kube,
        cache: ClusterCache,
        *,
        watch_timeout_s: int = 60,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        nodes_listed, node_event, pods_listed, pod_event = _cache_callbacks(cache)
        self.nodes = Reflector(
            kube,
            NODES,
            on_list=nodes_listed,
            on_event=node_event,
            watch_timeout_s=watch_timeout_s,
            backoff=backoff,
        )
        self.pods = Reflector(
            kube,
            PODS,
            on_list=pods_listed,
            on_event=pod_event,
            watch_timeout_s=watch_timeout_s,
            backoff=backoff,
        )
        self.ready = threading.Event()
        self._waiter: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()
        self._waiter = threading.Thread(target=self._await_ready, name="watches-ready", daemon=True)
        self._waiter.start()

    def _await_ready(self) -> None:
        # Nodes first, so the pods' first apply finds their nodes (either order is correct).
        for r in (self.nodes, self.pods):
            while not r.synced.wait(0.1):
                if self._stop.is_set():
                    return
        self.ready.set()
        log.info("cluster state rebuilt from the API; serving")

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self.ready.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self.nodes.stop()
        self.pods.stop()
        if self._waiter is not None:
            self._waiter.join(5)


__all__ = ["DEFAULT_BACKOFF", "Backoff", "Kube", "Reflector", "WatchStream", "Watches"]
