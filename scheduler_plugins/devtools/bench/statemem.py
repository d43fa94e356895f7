"""The plugin server's memory and decision time at a cluster size, without a cluster
(``tessera bench --state-only``).

A fresh process tunes malloc as the plugin server does, builds the server's ``ClusterCache``
from the objects its watches would deliver — the benchmark's fake nodes, then its pods, each
placed by the scheduling core (``decide`` + ``plan_for``) and written as bound with the
annotations PreBind and the node agent leave (``bind-phase: success``) — and reports its RSS
and the time of further decisions on the full state (``decide`` + best node + its plan, as
``benchmarks/decision_latency.py`` times them). It is the server's state and core
without gRPC, the watch threads and the apiserver: a floor under the real process's RSS,
which the cluster phases measure directly (at sizes this machine can run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Final

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.devices import encode_devices
from scheduler_plugins.core.binding import bind_annotations
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.devtools.bench import procstat, stats
from scheduler_plugins.devtools.bench.errors import BenchError
from scheduler_plugins.devtools.bench.workload import (
    BenchPod,
    bench_profile,
    generate,
    tessera_manifest,
)
from scheduler_plugins.devtools.cluster.nodes import NodeProfile, node_object, plan
from scheduler_plugins.server.malloc import tune_allocator

NAMESPACE: Final = "tessera-bench"
DECISIONS: Final = 500
Json = dict[str, Any]


def measure(
    nodes: int,
    pods: int,
    *,
    seed: int,
    profile: NodeProfile | None = None,
    decisions: int = DECISIONS,
    cache: ClusterCache | None = None,
) -> Json:
    """Build the cache in this process and measure it (``main`` runs it in a fresh process,
    with malloc tuned as the plugin server tunes it). ``cache``: build into this one (empty,
    default device config) instead of a new one, to keep it."""
    config = DeviceConfig()
    start = procstat.sample(os.getpid())
    cache = cache if cache is not None else ClusterCache(config, clock=time.monotonic)
    now = time.time()
    for name, group in plan(profile or bench_profile(), nodes, 0):
        cache.apply_node(node_object(name, group, config, now=now))
    t0 = time.monotonic()
    placed_on = place(cache, generate(pods, seed=seed), config, now=now)
    placed = len(placed_on)
    unplaced = pods - placed
    load_s = time.monotonic() - t0
    loaded = procstat.sample(os.getpid())
    seconds: list[float] = []
    for pod in generate(decisions, seed=seed + 1, prefix="probe"):
        if not pod.gpus:
            continue
        request = parse_request(tessera_manifest(pod, namespace=NAMESPACE, labels={}), config)
        t = time.perf_counter()
        decision = decide(cache.state, request)
        best = decision.best_node()
        if best is not None:
            decision.plan_for(best)  # what Reserve asks of the same decision
        seconds.append(time.perf_counter() - t)
    summary = stats.summarize_seconds(seconds)
    if start is None or loaded is None:
        raise BenchError("cannot read this process's /proc entries")
    return {
        "nodes": nodes,
        "pods": pods,
        "placed": placed,
        "unplaced": unplaced,
        "load_s": round(load_s, 1),
        "rss_mib_empty": round(start.rss_kib / 1024, 1),
        "rss_mib_loaded": round(loaded.rss_kib / 1024, 1),
        "peak_rss_mib": round(loaded.hwm_kib / 1024, 1),
        "decision_ms": summary.to_json() if summary else None,
    }


def place(
    cache: ClusterCache,
    workload: tuple[BenchPod, ...],
    config: DeviceConfig,
    *,
    now: float,
) -> dict[str, str]:
    """Place ``workload`` in order by the scheduling core (``decide``, its best node, the
    plan) and apply each as bound with the annotations PreBind and the node agent leave;
    CPU-only pods go round the nodes. Returns pod name -> node of those placed."""
    names = sorted(cache.state.nodes)
    out: dict[str, str] = {}
    for i, pod in enumerate(workload):
        manifest = tessera_manifest(pod, namespace=NAMESPACE, labels={})
        manifest["metadata"]["uid"] = f"uid-{i}"
        request = parse_request(manifest, config)
        if not request.wants_gpu:
            manifest["spec"]["nodeName"] = names[i % len(names)]
        else:
            decision = decide(cache.state, request)
            node = decision.best_node()
            planned = decision.plan_for(node) if node is not None else None
            if planned is None:
                continue
            written = bind_annotations(planned, bind_time=int(now))
            written[ann.BIND_PHASE] = "success"
            written[ann.DEVICES_TO_ALLOCATE] = encode_devices(tuple(() for _ in planned.containers))
            manifest["metadata"]["annotations"] = {
                **manifest["metadata"].get("annotations", {}),
                **written,
            }
            manifest["spec"]["nodeName"] = planned.node
        cache.apply_pod(manifest)
        out[pod.name] = manifest["spec"]["nodeName"]
    return out


def offline_nodes_used(
    workload: tuple[BenchPod, ...], nodes: int, profile: NodeProfile | None = None
) -> int:
    """How many nodes the GPU pods of ``workload`` take when the scheduling core places them
    one after another on an empty cluster of ``nodes`` (the cluster default policy): what a
    scheduler that never waits would reach, next to the drains' counts."""
    config = DeviceConfig()
    cache = ClusterCache(config, clock=time.monotonic)
    now = time.time()
    for name, group in plan(profile or bench_profile(), nodes, 0):
        cache.apply_node(node_object(name, group, config, now=now))
    on = place(cache, workload, config, now=now)
    return len({on[p.name] for p in workload if p.gpus and p.name in on})


def measure_in_subprocess(nodes: int, pods: int, *, seed: int, timeout_s: float) -> Json:
    """``measure`` in a fresh Python process, so its RSS is the cache's alone."""
    argv = [sys.executable, "-m", __name__, str(nodes), str(pods), str(seed)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"state measurement ({nodes} nodes) ran past {timeout_s:.0f}s") from e
    if proc.returncode != 0:
        raise BenchError(
            f"state measurement ({nodes} nodes) failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}"
        )
    out: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("nodes", type=int)
    p.add_argument("pods", type=int)
    p.add_argument("seed", type=int)
    args = p.parse_args(argv)
    tune_allocator()
    print(json.dumps(measure(args.nodes, args.pods, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
