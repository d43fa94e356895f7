"""Scrape time of the plugin server's ``/metrics`` on large clusters.

Clusters of N nodes × 8 GPUs (the node and pod mix of ``benchmarks.decision_latency``: 70%
hami-core, 30% MIG nodes; existing pods up to ``--pods-per-gpu`` per GPU, every MIG instance
with a runtime identity as the node agent writes it). Measured in the same run:

- Tessera: ``exposition`` of the plugin server's registry (``StateCollector`` reading the
  state at scrape time, plus the scheduling histograms); how long it holds the state lock
  (what a decision waiting for the lock would wait); the first scrape after a layout change
  (label text rebuilt); gzip of the body; and a real HTTP GET through ``MetricsServer`` from
  another process (plain and gzip).
- Empty: the same registry without the state collector (what the process costs anyway).
- Naive: what per-event instrumentation does — one labelled ``prometheus_client`` Gauge child
  per GPU and family, updated on every pod event (the per-event cost is what the scheduler's
  event path would pay), scraped with ``prometheus_client``'s ``generate_latest``. Both
  expositions must carry the same GPU series.

Target (issue): 5000 nodes × 8 GPUs scrape in well under a second.

Run: ``python -m benchmarks.metrics_scrape [--nodes 1000,5000] [--pods-per-gpu 2]
[--repeat 7] [--naive-max-nodes 5000] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import structlog
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from api.hami.config import DeviceConfig
from api.hami.devices import RuntimeIdentity
from benchmarks.decision_latency import GPUS_PER_NODE, make_nodes, make_pods
from scheduler_plugins.core.requests import PodAllocation
from scheduler_plugins.core.state import ClusterState, build_state
from scheduler_plugins.server.metrics import (
    GPU_GAUGES,
    MIB,
    MetricsServer,
    SchedulingMetrics,
    StateCollector,
    exposition,
)

DEFAULT_NODES = (1000, 5000)
DEFAULT_PODS_PER_GPU = 2
DEFAULT_REPEAT = 7
DEFAULT_SEED = 20240601
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "metrics_scrape.json"
TARGET_NODES = 5000
TARGET_S = 1.0
NAIVE_EVENTS = 2000


class Timing(TypedDict):
    samples: int
    median_s: float
    max_s: float
    cpu_median_s: float  # this process' CPU time: what the scrape costs apart from the load


class WallTiming(TypedDict):
    samples: int
    median_s: float
    max_s: float


class ConfigResult(TypedDict):
    nodes: int
    gpus: int
    pods: int
    mig_instances: int
    series: int
    body_bytes: int
    gzip_bytes: int
    build_s: float
    first_scrape_s: float
    first_scrape_cpu_s: float
    scrape: Timing
    lock_held: WallTiming
    gzip: Timing
    http_scrape: WallTiming | None
    http_scrape_gzip: WallTiming | None
    empty_registry_scrape: Timing
    naive_event_update_us: float | None
    naive_scrape_s: float | None
    ratio_naive_scrape: float | None


class Report(TypedDict):
    machine: dict[str, Any]
    target: dict[str, Any]
    results: list[ConfigResult]


# ----- cluster ---------------------------------------------------------------------------------


def with_runtime(pods: dict[str, PodAllocation]) -> dict[str, PodAllocation]:
    """Every MIG reservation realized: a runtime identity as the node agent records it."""
    out: dict[str, PodAllocation] = {}
    for n, (key, alloc) in enumerate(pods.items()):
        mig = tuple(
            replace(
                m,
                runtime=RuntimeIdentity(
                    f"MIG-{n:08x}-{i:04x}-4000-8000-{m.placement.start:012x}",
                    m.placement.start + 1,
                    0,
                ),
            )
            for i, m in enumerate(alloc.mig)
        )
        out[key] = replace(alloc, mig=mig)
    return out


def build(n_nodes: int, pods_per_gpu: int, seed: int) -> ClusterState:
    config = DeviceConfig()
    rng = random.Random(seed)
    nodes = make_nodes(n_nodes, config, rng)
    pods = make_pods(nodes, n_nodes * GPUS_PER_NODE * pods_per_gpu, config, rng)
    return build_state(config, nodes, with_runtime(pods))


class HoldTimer:
    """The state lock, recording how long each hold lasted."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._since = 0.0
        self.held: list[float] = []

    def __enter__(self) -> HoldTimer:
        self._lock.acquire()
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.held.append(time.perf_counter() - self._since)
        self._lock.release()


# ----- the naive way ---------------------------------------------------------------------------


class NaiveGauges:
    """HAMi's per-GPU families as labelled Gauges, set on every pod event."""

    def __init__(self, state: ClusterState) -> None:
        self.registry = CollectorRegistry()
        self._gauges = {
            g.name: Gauge(
                g.name,
                g.documentation,
                ["device_index", "device_type", "device_uuid", "node", "zone"],
                registry=self.registry,
            )
            for g in GPU_GAUGES
        }
        self._labels: dict[tuple[str, str], tuple[str, ...]] = {}
        for name, entry in state.nodes.items():
            for d in entry.devices:
                self._labels[(name, d.id)] = (str(d.index), d.type, d.id, name, "vGPU")
        self._state = state
        for node, uuid in self._labels:
            self.update(node, uuid)

    def update(self, node: str, uuid: str) -> None:
        """What the event path pays per GPU a pod event touches."""
        entry = self._state.nodes[node]
        r = entry.rows[uuid]
        g = self._state.gpus
        labels = self._labels[(node, uuid)]
        mem, used_mem = float(g.mem[r]), float(g.used_mem[r])
        values = (
            mem * MIB,
            float(g.cores[r]),
            used_mem * MIB,
            float(g.used_slots[r]),
            float(g.used_cores[r]),
            used_mem * MIB,
            used_mem / mem if mem > 0 else 0.0,
        )
        for gauge, value in zip(self._gauges.values(), values, strict=True):
            gauge.labels(*labels).set(value)


_GPU_SAMPLE = re.compile(rb'^(\w+)\{.*?device_uuid="([^"]*)".*?node="([^"]*)"', re.MULTILINE)


def gpu_series(body: bytes) -> set[tuple[bytes, bytes, bytes]]:
    """(family, device_uuid, node) of every sample of HAMi's per-GPU families (label values
    here have nothing to escape; ``prometheus_client``'s parser takes minutes on 280k)."""
    names = {g.name.encode() for g in GPU_GAUGES}
    return {
        (m.group(1), m.group(2), m.group(3))
        for m in _GPU_SAMPLE.finditer(body)
        if m.group(1) in names
    }


# ----- measuring -------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], repeat: int) -> tuple[Timing, object]:
    times: list[float] = []
    cpu: list[float] = []
    out: object = None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return Timing(
        samples=repeat,
        median_s=round(float(np.median(times)), 5),
        max_s=round(max(times), 5),
        cpu_median_s=round(float(np.median(cpu)), 5),
    ), out


# A scraper in its own process, as Prometheus is: a client thread in this process would
# contend with the server thread for the GIL on every socket buffer's worth of the body.
_SCRAPER = """
import json, sys, time, urllib.request
url, n, headers = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
times = []
for _ in range(n):
    t = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=300) as r:
        r.read()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def _http_timing(url: str, repeat: int, gzipped: bool) -> WallTiming:
    headers = {"Accept-Encoding": "gzip"} if gzipped else {}
    argv = [sys.executable, "-c", _SCRAPER, url, str(repeat), json.dumps(headers)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1200)
    times: list[float] = json.loads(out.stdout)
    return WallTiming(
        samples=len(times),
        median_s=round(float(np.median(times)), 5),
        max_s=round(max(times), 5),
    )


def run_config(
    n_nodes: int,
    pods_per_gpu: int,
    repeat: int,
    seed: int,
    naive: bool,
    naive_events: int = NAIVE_EVENTS,
    http: bool = True,
) -> ConfigResult:
    t0 = time.perf_counter()
    state = build(n_nodes, pods_per_gpu, seed)
    build_s = time.perf_counter() - t0
    lock = HoldTimer()
    registry = CollectorRegistry()
    SchedulingMetrics(registry)
    collector = StateCollector(state, lock)
    registry.register(collector)

    t, c = time.perf_counter(), time.process_time()
    body = exposition(registry)  # builds the label text of this layout
    first_s = time.perf_counter() - t
    first_cpu = time.process_time() - c
    lock.held.clear()
    scrape, _ = _timed(lambda: exposition(registry), repeat)
    held = lock.held[:]
    gz_timing, gz = _timed(lambda: gzip.compress(body, compresslevel=1), repeat)
    assert isinstance(gz, bytes)
    empty = CollectorRegistry()
    SchedulingMetrics(empty)
    empty_timing, _ = _timed(lambda: exposition(empty), repeat)
    http_timing = http_gz_timing = None
    if http:
        with MetricsServer(registry, "127.0.0.1", 0) as server:
            url = f"http://{server.address}/metrics"
            http_timing = _http_timing(url, repeat, gzipped=False)
            http_gz_timing = _http_timing(url, repeat, gzipped=True)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    mig = body.count(b"\nhami_node_gpu_mig_instance_info{")

    naive_us: float | None = None
    naive_s: float | None = None
    if naive:
        gauges = NaiveGauges(state)
        gpus = [(n, u) for n, e in state.nodes.items() for u in e.rows]
        rng = random.Random(seed)
        events = [rng.choice(gpus) for _ in range(naive_events)]
        t = time.perf_counter()
        for node, uuid in events:
            gauges.update(node, uuid)
        naive_us = round((time.perf_counter() - t) / naive_events * 1e6, 2)
        t = time.perf_counter()
        naive_body = generate_latest(gauges.registry)
        naive_s = round(time.perf_counter() - t, 3)
        ours, theirs = gpu_series(body), gpu_series(naive_body)
        assert ours == theirs, f"expositions differ: {len(ours ^ theirs)} series"

    return ConfigResult(
        nodes=n_nodes,
        gpus=len(state.gpus.node[state.gpus.node >= 0]),
        pods=sum(1 for _ in state.allocations()),
        mig_instances=mig,
        series=series,
        body_bytes=len(body),
        gzip_bytes=len(gz),
        build_s=round(build_s, 2),
        first_scrape_s=round(first_s, 4),
        first_scrape_cpu_s=round(first_cpu, 4),
        scrape=scrape,
        lock_held=WallTiming(
            samples=len(held),
            median_s=round(float(np.median(held)), 5),
            max_s=round(max(held), 5),
        ),
        gzip=gz_timing,
        http_scrape=http_timing,
        http_scrape_gzip=http_gz_timing,
        empty_registry_scrape=empty_timing,
        naive_event_update_us=naive_us,
        naive_scrape_s=naive_s,
        ratio_naive_scrape=round(naive_s / scrape["median_s"], 1) if naive_s else None,
    )


def run(
    nodes: Sequence[int] = DEFAULT_NODES,
    pods_per_gpu: int = DEFAULT_PODS_PER_GPU,
    repeat: int = DEFAULT_REPEAT,
    seed: int = DEFAULT_SEED,
    naive_max_nodes: int = TARGET_NODES,
    progress: Callable[[ConfigResult], None] | None = None,
) -> Report:
    machine: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    results: list[ConfigResult] = []
    for n in nodes:
        r = run_config(n, pods_per_gpu, repeat, seed, naive=n <= naive_max_nodes)
        results.append(r)
        if progress is not None:
            progress(r)
    machine["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    at_target = [r for r in results if r["nodes"] == TARGET_NODES]
    return Report(
        machine=machine,
        target={
            "nodes": TARGET_NODES,
            "scrape_s": TARGET_S,
            "met": bool(at_target) and all(r["scrape"]["median_s"] < TARGET_S for r in at_target),
        },
        results=results,
    )


HEADER = (
    f"{'nodes':>6} {'GPUs':>6} {'pods':>6} {'series':>7} {'MiB':>5} | {'scrape s':>8} "
    f"{'max':>6} {'cpu':>6} {'lock':>6} {'first':>6} {'http':>6} {'gzip':>6} {'empty':>7} | "
    f"{'naive s':>7} {'x':>5} {'event us':>8}"
)


def _median(t: Timing | WallTiming | None) -> str:
    return f"{t['median_s']:>6.3f}" if t is not None else f"{'-':>6}"


def format_row(r: ConfigResult) -> str:
    naive = (
        f"{r['naive_scrape_s']:>7.2f} {r['ratio_naive_scrape']:>4.0f}x "
        f"{r['naive_event_update_us']:>8.1f}"
        if r["naive_scrape_s"] is not None
        else f"{'-':>7} {'-':>5} {'-':>8}"
    )
    return (
        f"{r['nodes']:>6} {r['gpus']:>6} {r['pods']:>6} {r['series']:>7} "
        f"{r['body_bytes'] / 2**20:>5.1f} | {r['scrape']['median_s']:>8.3f} "
        f"{r['scrape']['max_s']:>6.3f} {r['scrape']['cpu_median_s']:>6.3f} "
        f"{r['lock_held']['median_s']:>6.3f} "
        f"{r['first_scrape_s']:>6.3f} {_median(r['http_scrape'])} "
        f"{_median(r['http_scrape_gzip'])} {r['empty_registry_scrape']['median_s']:>7.4f} "
        f"| {naive}"
    )


def format_table(report: Report) -> str:
    lines = [HEADER, "-" * len(HEADER), *(format_row(r) for r in report["results"])]
    target, machine = report["target"], report["machine"]
    lines.append(
        f"target: scrape < {target['scrape_s']} s at {target['nodes']} nodes: "
        f"{'met' if target['met'] else 'NOT met'}; load average "
        f"{machine['loadavg_1m_at_start']} -> {machine['loadavg_1m_at_end']} on "
        f"{machine['cpus']} CPUs"
    )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1000,5000, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_scrape")
    parser.add_argument("--nodes", type=_ints, default=DEFAULT_NODES)
    parser.add_argument("--pods-per-gpu", type=int, default=DEFAULT_PODS_PER_GPU)
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT)
    parser.add_argument(
        "--naive-max-nodes",
        type=int,
        default=TARGET_NODES,
        help="skip the (slow) naive baseline above this many nodes",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.pods_per_gpu < 0:
        parser.error("--pods-per-gpu must not be negative")
    print(HEADER)
    print("-" * len(HEADER))
    logging_before = structlog.get_config()
    # The metrics server logs every request at debug level; the table is the output here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        report = run(
            args.nodes,
            args.pods_per_gpu,
            args.repeat,
            args.seed,
            args.naive_max_nodes,
            progress=lambda r: print(format_row(r), flush=True),
        )
    finally:
        structlog.configure(**logging_before)
    print(format_table(report).splitlines()[-1])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
