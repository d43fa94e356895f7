"""List then watch one Kubernetes collection into callbacks (a client-side reflector).

List, hand the whole list to ``on_list``, then watch from the list's resourceVersion,
following bookmarks. A watch that ends on the server's timeout resumes from the last version
seen (``on_watch_end`` runs then: a natural place for periodic passes); 410 Gone, a broken
connection or any other error lists again, after a backoff that grows while errors last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from api.kube.client import Obj
from api.kube.errors import GoneError, KubeError

log = structlog.get_logger("tessera.kube.reflector")


class WatchStream(Protocol):
    """What ``KubeClient.watch`` returns: events until the stream ends; ``close`` from any
    thread ends it."""

    def __iter__(self) -> Iterator[Obj]: ...

    def close(self) -> None: ...


class Kube(Protocol):
    """The part of ``KubeClient`` the reflectors use."""

    def list(self, path: str) -> Obj: ...

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> WatchStream: ...


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.2
    max_s: float = 30.0
    factor: float = 2.0

    def delays(self) -> Iterable[float]:
        d = self.initial_s
        while True:
            yield d
            d = min(d * self.factor, self.max_s)


DEFAULT_BACKOFF = Backoff()


class Reflector:
    """List then watch one collection into callbacks, until ``stop()``."""

    def __init__(
        self,
        kube: Kube,
        path: str,
        *,
        on_list: Callable[[list[Obj], float], None],
        on_event: Callable[[str, Obj], None],
        watch_timeout_s: int = 60,
        backoff: Backoff = DEFAULT_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
        on_watch_end: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self._on_watch_end = on_watch_end
        self.synced = threading.Event()
        self.lists = 0  # completed lists (the first one, then every re-list)
        self._kube = kube
        self._on_list = on_list
        self._on_event = on_event
        self._watch_timeout_s = watch_timeout_s
        self._backoff = backoff
        self._clock = clock
        self._stop = threading.Event()
        self._interrupted = threading.Event()
        self._lock = threading.Lock()
        self._watch: WatchStream | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"reflector{self.path.replace('/', '-')}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.interrupt()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("reflector did not stop in time", path=self.path)

    def interrupt(self) -> None:
        """Break the current watch stream (as a dropped connection would): it lists again."""
        with self._lock:
            w = self._watch
            if w is not None:
                self._interrupted.set()
        if w is not None:
            w.close()

    def _run(self) -> None:
        delays = iter(self._backoff.delays())
        while not self._stop.is_set():
            try:
                rv = self._list()
                delays = iter(self._backoff.delays())
                self._watch_from(rv)
            except GoneError as e:
                log.info("watch version expired; listing again", path=self.path, error=str(e))
                continue
            except KubeError as e:
                delay = next(delays)
                log.warning(
                    "list/watch failed; listing again",
                    path=self.path,
                    error=str(e),
                    retry_in_s=delay,
                )
                self._stop.wait(delay)
            except Exception as e:  # a bug in a handler must not end the loop for good
                delay = next(delays)
                log.exception(
                    "reflector handler failed; listing again",
                    path=self.path,
                    error=repr(e),
                    retry_in_s=delay,
                )
                self._stop.wait(delay)

    def _list(self) -> str:
        listed_at = self._clock()
        answer = self._kube.list(self.path)
        items = [i for i in answer.get("items") or [] if isinstance(i, dict)]
        self._on_list(items, listed_at)
        self.lists += 1
        self.synced.set()
        rv = str((answer.get("metadata") or {}).get("resourceVersion", ""))
        log.debug("listed", path=self.path, items=len(items), resource_version=rv)
        return rv

    def _watch_from(self, rv: str) -> None:
        """Watch until stopped; returns to re-list only through an exception."""
        while not self._stop.is_set():
            w = self._kube.watch(self.path, rv or None, timeout_s=self._watch_timeout_s)
            with self._lock:
                self._watch = w
            try:
                for event in w:
                    typ = str(event.get("type", ""))
                    obj: Obj = event.get("object") or {}
                    version = (obj.get("metadata") or {}).get("resourceVersion")
                    if typ != "BOOKMARK":
                        self._on_event(typ, obj)
                    if version:
                        rv = str(version)
            finally:
                with self._lock:
                    self._watch = None
                w.close()
            if self._stop.is_set():
                return
            if self._on_watch_end is not None:
                self._on_watch_end()
            if self._interrupted.is_set():
                self._interrupted.clear()
                raise _Interrupted(f"watch {self.path} was interrupted")


class _Interrupted(KubeError):
    """The stream was cut from our side (``interrupt``): treated like a dropped connection."""
