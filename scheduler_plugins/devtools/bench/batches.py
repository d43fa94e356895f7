"""Batches of benchmark pods: create them on client threads, wait until they settle, and
turn what the watch saw into numbers (latency, throughput, queue drain, node bursts).

The send time of each create and the watch time of each binding, both on this process's
monotonic clock, give the scheduling latency (``creationTimestamp`` has one-second
resolution).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

from api.kube.errors import ConflictError, KubeError
from scheduler_plugins.devtools.bench import stats
from scheduler_plugins.devtools.bench.errors import BenchError
from scheduler_plugins.devtools.bench.watcher import PodTimes
from scheduler_plugins.devtools.bench.workload import BenchPod, kind_counts
from scheduler_plugins.devtools.progress import Progress

log = structlog.get_logger(__name__)

NAMESPACE: Final = "tessera-bench"
PODS_PATH: Final = f"/api/v1/namespaces/{NAMESPACE}/pods"
BATCH_LABEL: Final = "tessera.dev/bench"
CREATE_ATTEMPTS: Final = 5
CDF_POINTS: Final = 101
# How often ``wait_batch`` looks at most. Each look copies what the watch saw of every pod in
# the batch: looking at every watch event (several per pod) made the bench's own CPU grow
# with pods × events, taken from the cluster it measures on the same cores.
LOOK_INTERVAL_S: Final = 0.1

Obj = dict[str, Any]
Json = dict[str, Any]


class Creator(Protocol):
    """What a batch needs of the API client."""

    def post(self, path: str, body: object) -> Any: ...


class Renderer(Protocol):
    """Turns a benchmark pod into the manifest for one scheduler."""

    def manifest(self, pod: BenchPod, *, namespace: str, labels: Mapping[str, str]) -> Obj: ...


@dataclass
class Batch:
    """One set of pods created together and what the watch saw of them."""

    label: str
    pods: tuple[BenchPod, ...]
    sent: dict[str, float] = field(default_factory=dict)
    create_errors: list[str] = field(default_factory=list)
    bound: dict[str, float] = field(default_factory=dict)
    allocated: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    done_at: float = 0.0

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pods]

    def collect(self, watch: PodTimes) -> None:
        bound, allocated, nodes, running = watch.snapshot()
        names = set(self.names)
        self.bound = {n: t for n, t in bound.items() if n in names}
        self.allocated = {n: t for n, t in allocated.items() if n in names}
        self.nodes = {n: v for n, v in nodes.items() if n in names}
        self.running = {n: t for n, t in running.items() if n in names}


def create_batch(
    api: Creator,
    scheduler: Renderer,
    batch: Batch,
    *,
    workers: int,
    rate: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> threading.Thread:
    """Start creating the batch's pods on ``workers`` threads (at most ``rate`` per second
    when given); returns the feeding thread."""
    labels = {BATCH_LABEL: batch.label}
    lock = threading.Lock()
    start = clock()

    def create(item: tuple[int, BenchPod]) -> None:
        index, pod = item
        if rate:
            time.sleep(max(0.0, start + index / rate - clock()))
        manifest = scheduler.manifest(pod, namespace=NAMESPACE, labels=labels)
        delay = 0.2
        for attempt in range(CREATE_ATTEMPTS):
            sent = clock()
            try:
                api.post(PODS_PATH, manifest)
            except ConflictError:
                pass  # an earlier attempt got through before its answer was lost
            except KubeError as e:
                if attempt == CREATE_ATTEMPTS - 1:
                    with lock:
                        batch.create_errors.append(f"{pod.name}: {e}")
                    return
                time.sleep(delay)
                delay *= 2
                continue
            with lock:
                batch.sent[pod.name] = sent
            return

    def feed() -> None:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="create") as pool:
            list(pool.map(create, enumerate(batch.pods)))

    thread = threading.Thread(target=feed, name=f"create-{batch.label}", daemon=True)
    thread.start()
    return thread


def wait_batch(
    watch: PodTimes,
    batch: Batch,
    feeder: threading.Thread,
    *,
    wait_allocated: bool,
    settle_s: float,
    timeout_s: float,
    progress: Progress,
    clock: Callable[[], float] = time.monotonic,
    wait_running: bool = False,
) -> None:
    """Until every pod is bound (and, with ``wait_allocated``, every bound GPU pod has its
    node agent's answer; with ``wait_running``, every bound pod but those whose allocation
    failed runs), or nothing changed for ``settle_s`` after the last create, or
    ``timeout_s``."""
    total = len(batch.pods)
    gpu = {p.name for p in batch.pods if p.gpus}
    start = clock()
    last_change = start
    seen = (-1, -1, -1)
    looked = start - LOOK_INTERVAL_S
    while True:
        time.sleep(max(0.0, looked + LOOK_INTERVAL_S - clock()))
        feeding = feeder.is_alive()
        looked = clock()
        batch.collect(watch)
        failed = watch.failed & gpu
        bound = len(batch.bound)
        answered = len((batch.allocated.keys() | failed) & gpu & batch.bound.keys())
        running = len((batch.running.keys() | failed) & batch.bound.keys())
        now = clock()
        rate = bound / (now - start) if now > start else 0.0
        progress.update(
            bound, f"created {len(batch.sent)}  bound {bound}  {rate:.0f}/s  allocated {answered}"
        )
        if (bound, answered, running) != seen:
            seen = (bound, answered, running)
            last_change = now
        gpu_bound = len(gpu & batch.bound.keys())
        complete = (
            bound + len(batch.create_errors) >= total
            and (not wait_allocated or answered >= gpu_bound)
            and (not wait_running or running >= bound)
        )
        if not feeding and complete:
            break
        if not feeding and now - last_change > settle_s:
            break
        if now - start > timeout_s:
            log.warning("bench.batch_timeout", batch=batch.label, bound=bound, total=total)
            break
        watch.wait_changed(0.25)
    feeder.join()
    batch.collect(watch)
    batch.done_at = clock()
    progress.close(len(batch.bound), f"bound {len(batch.bound)} of {total}")


def batch_json(batch: Batch, *, failed: set[str]) -> Json:
    """The numbers of one batch (times relative to its first create)."""
    if not batch.sent:
        raise BenchError(f"batch {batch.label}: no pod could be created: {batch.create_errors[:3]}")
    first = min(batch.sent.values())
    last_sent = max(batch.sent.values())
    bound_times = list(batch.bound.values())
    latency = stats.latencies(batch.sent, batch.bound)
    gpu = {p.name for p in batch.pods if p.gpus}
    alloc = stats.latencies({n: t for n, t in batch.bound.items() if n in gpu}, batch.allocated)
    series = stats.rate_series(bound_times, start=first)
    create_span = last_sent - first
    summary = stats.summarize_seconds(latency)
    return {
        "pods": len(batch.pods),
        "kinds": kind_counts(batch.pods),
        "created": len(batch.sent),
        "create_errors": batch.create_errors[:10],
        "bound": len(batch.bound),
        "allocated": len(batch.allocated.keys() & gpu),
        "allocation_failed": len(failed & gpu),
        "pending": len(batch.pods) - len(batch.bound),
        "create_rate_pods_per_s": round(len(batch.sent) / create_span, 1) if create_span else None,
        "throughput_pods_per_s": round(stats.throughput(first, bound_times), 2)
        if bound_times
        else 0.0,
        "steady_pods_per_s": round(stats.steady_rate(series), 2),
        "wall_s": round(batch.done_at - first, 2),
        "last_bound_s": round(max(bound_times) - first, 3) if bound_times else None,
        "latency_ms": summary.to_json() if summary else None,
        "latency_cdf_ms": _cdf_ms(latency),
        "allocation_ms": s.to_json() if (s := stats.summarize_seconds(alloc)) else None,
        "rate_series": series,
    }


def _cdf_ms(values: Sequence[float]) -> list[float]:
    if not values:
        return []
    ms = sorted(v * 1000.0 for v in values)
    return [round(stats.percentile(ms, q), 3) for q in range(CDF_POINTS)]


# Process and metrics sampling ------------------------------------------------------------------


def drain_json(
    batch: Batch,
    resumed: float,
    *,
    cpu_s: Mapping[str, float],
    requests: list[Json],
    committed: Mapping[str, float] | None = None,
    watch_events: Mapping[str, float] | None = None,
) -> Json:
    """How fast a queue of pods was bound once the scheduler started (``resumed``).

    ``committed``: when the scheduler's Binding of each pod was committed (its log, on this
    process's monotonic clock). When it names every pod the watch saw bound, the drain is
    timed by it (the watch trails it by however far the cluster's event stream is behind),
    and the watch's own figure is kept beside it; otherwise by the watch.
    """
    watched = sorted(batch.bound.values())
    committed = committed or {}
    by_log = bool(committed) and batch.bound.keys() <= committed.keys()
    times = sorted(committed[n] for n in batch.bound) if by_log else watched
    series = stats.rate_series(times, start=resumed)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    bound = len(times)
    watched_span = watched[-1] - watched[0] if len(watched) > 1 else 0.0
    return {
        "pods": len(batch.pods),
        "created": len(batch.sent),
        "bound": bound,
        "pending": len(batch.pods) - bound,
        "bound_times": "scheduler log" if by_log else "watch",
        "watched_pods_per_s": round((bound - 1) / watched_span, 2) if watched_span > 0 else None,
        "watch_lag_last_s": round(watched[-1] - times[-1], 2) if by_log and times else None,
        "first_bound_s": round(times[0] - resumed, 2) if times else None,
        "drain_s": round(times[-1] - resumed, 2) if times else None,
        # From the first binding: the scheduler's start-up (informer sync) is not scheduling.
        "drain_pods_per_s": round((bound - 1) / span, 2) if span > 0 else None,
        "steady_pods_per_s": round(stats.steady_rate(series), 2),
        "rate_series": series,
        "cpu_ms_per_pod": {c: round(v * 1000.0 / bound, 2) for c, v in cpu_s.items()}
        if bound
        else {},
        "api_requests": requests,
        "watch_events_per_pod": dict(watch_events or {}),
    }


def burst_json(label: str, what: str, batch: Batch) -> Json:
    first = min(batch.sent.values()) if batch.sent else 0.0
    offsets = sorted(round(t - first, 3) for t in batch.bound.values())
    alloc = sorted(round(t - first, 3) for t in batch.allocated.values())
    return {
        "label": label,
        "what": what,
        "pods": len(batch.pods),
        "bound": len(batch.bound),
        "all_bound_s": offsets[-1] if len(offsets) == len(batch.pods) else None,
        "all_allocated_s": alloc[-1] if alloc and len(alloc) == len(batch.pods) else None,
        "bound_offsets_s": offsets,
        "nodes": sorted(set(batch.nodes.values())),
    }
