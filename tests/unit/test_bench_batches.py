"""``wait_batch``: how often it looks at the watch while pods bind."""

from __future__ import annotations

import threading
import time

from scheduler_plugins.devtools.bench.batches import LOOK_INTERVAL_S, Batch, wait_batch
from scheduler_plugins.devtools.bench.workload import BenchPod, PodKind
from scheduler_plugins.devtools.progress import Progress

BIND_EVERY_S = LOOK_INTERVAL_S / 2


class StormWatch:
    """A watch whose every wait returns at once, as under a storm of pod events, and whose
    pods bind one every ``BIND_EVERY_S``."""

    def __init__(self, names: list[str]) -> None:
        self.failed: set[str] = set()
        self.snapshots = 0
        self._names = names
        self._start = time.monotonic()

    def snapshot(
        self,
    ) -> tuple[dict[str, float], dict[str, float], dict[str, str], dict[str, float]]:
        self.snapshots += 1
        n = 1 + int((time.monotonic() - self._start) / BIND_EVERY_S)
        bound = {name: 1.0 for name in self._names[:n]}
        running = {name: 1.0 for name in self._names[: n - 2]}  # two bound, not yet running
        return bound, {}, dict.fromkeys(bound, "node-a"), running

    def wait_changed(self, timeout_s: float) -> None:
        pass


def test_a_storm_of_watch_events_does_not_make_the_bench_look_at_every_one() -> None:
    pods = tuple(BenchPod(f"p{i}", PodKind.PLAIN) for i in range(9))
    batch = Batch("b", pods)
    fed = threading.Thread(target=lambda: None)
    fed.start()
    fed.join()
    watch = StormWatch([p.name for p in pods])
    wait_batch(
        watch,  # type: ignore[arg-type]
        batch,
        fed,
        wait_allocated=False,
        settle_s=30,
        timeout_s=30,
        progress=Progress("t", len(pods), enabled=False),
    )
    assert sorted(batch.bound) == [p.name for p in pods]
    # All bound after 8 × BIND_EVERY_S = 4 look intervals: about five looks and the final
    # one (a slower machine only looks less often). Looking at every event: thousands.
    assert watch.snapshots <= 8


def test_a_drain_can_wait_until_every_bound_pod_runs() -> None:
    """The drain's CPU window ends when the cluster is done with its pods: bound, and run
    (kwok's status write), which trails the binding."""
    pods = tuple(BenchPod(f"p{i}", PodKind.PLAIN) for i in range(5))
    batch = Batch("b", pods)
    fed = threading.Thread(target=lambda: None)
    fed.start()
    fed.join()
    watch = StormWatch([p.name for p in pods])
    wait_batch(
        watch,  # type: ignore[arg-type]
        batch,
        fed,
        wait_allocated=False,
        wait_running=True,
        settle_s=30,
        timeout_s=30,
        progress=Progress("t", len(pods), enabled=False),
    )
    assert sorted(batch.running) == [p.name for p in pods]  # not just once all were bound
