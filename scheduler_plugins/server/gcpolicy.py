"""Python's cyclic GC for a long-running plugin server: full collections walk new objects only.

The plugin server holds every node and pod of the cluster as Python objects. A full
(generation 2) collection walks all of them with the GIL held: 236 ms for the state of 5000
nodes and 10k pods on the benchmark machine, and the running server paused 180-340 ms every
20-30 s in a 5000-node benchmark, every RPC waiting. Almost all of that state is long-lived
and acyclic (decoded JSON, dataclasses); reference counting frees it when it goes.

``OldObjectsFrozen`` freezes (``gc.freeze``) what survives: once the state is first built,
and after each full collection since, so the next one walks only what was allocated after.
Cycles among frozen objects that become garbage are not collected while frozen: every
``full_every_s`` it unfreezes everything and collects once in full (the old pause, that
rarely), then freezes again. Call ``tick`` often (the server's main loop, every second).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

import structlog

log = structlog.get_logger("tessera.gc")

FULL_EVERY_S: Final = 3600.0


class GcModule(Protocol):
    """The part of the ``gc`` module used (injected in tests)."""

    def collect(self, generation: int = 2) -> int: ...

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...

    def get_stats(self) -> list[dict[str, Any]]: ...

    def get_freeze_count(self) -> int: ...


class OldObjectsFrozen:
    def __init__(
        self,
        ready: Callable[[], bool],
        *,
        full_every_s: float = FULL_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        gc_module: GcModule = gc,
    ) -> None:
        if not full_every_s > 0:
            raise ValueError(f"full_every_s must be > 0, got {full_every_s}")
        self._ready = ready
        self._full_every_s = full_every_s
        self._clock = clock
        self._gc = gc_module
        self._full_at: float | None = None  # when the last full collection of everything ran
        self._gen2_seen = 0

    def tick(self) -> None:
        if self._full_at is None:
            if self._ready():  # the state is built: collect it all once, then freeze it
                self._collect_all("state built")
            return
        if self._clock() - self._full_at >= self._full_every_s:
            self._collect_all("periodic")
            return
        gen2 = self._gen2_collections()
        if gen2 != self._gen2_seen:
            # A full collection walked what was allocated since the last freeze: freeze
            # its survivors too.
            self._gen2_seen = gen2
            self._gc.freeze()

    def _collect_all(self, why: str) -> None:
        started = time.perf_counter()
        self._gc.unfreeze()
        freed = self._gc.collect(2)
        self._gc.freeze()
        self._full_at = self._clock()
        self._gen2_seen = self._gen2_collections()
        log.info(
            "gc.frozen",
            why=why,
            freed=freed,
            frozen=self._gc.get_freeze_count(),
            pause_ms=round((time.perf_counter() - started) * 1000.0, 1),
        )

    def _gen2_collections(self) -> int:
        return int(self._gc.get_stats()[2]["collections"])


__all__ = ["FULL_EVERY_S", "GcModule", "OldObjectsFrozen"]
