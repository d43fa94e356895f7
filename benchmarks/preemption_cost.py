"""Preemption cost: what naming preemptible nodes adds to PreFilter, and what one FilterWhatIf
costs, on a cluster of 1000 nodes × 8 GPUs.

The cluster is full of low-priority pods (priority 0): every hami-core GPU holds two pods of
45% of its memory, every MIG GPU is filled with 1g instances (70% of the nodes hami-core,
30% MIG, the models of ``decision_latency``). Timed through the plugin server's lifecycle
(``Reservations``, under the cache's lock, as the servicer calls it; no gRPC):

- ``prefilter_plain``: PreFilter of a pod that fits nowhere (one GPU, 60% of its memory) at
  priority 0: no pod is below it, so no node is preemptible (decide, explain, and the check).
- ``prefilter_preemptible``: the same pod at priority 1000: every node is preemptible, the
  worst case (every node's low-priority devices taken away at once, every node evaluated).
- ``prefilter_fits_preemptible``: a pod that fits some nodes, at priority 1000: the other
  nodes are still looked at (kube-scheduler's other plugins may reject those that fit).
- ``what_if_removed``: FilterWhatIf on one 8-GPU node with all its pods removed (the dry run's
  first question), ``what_if_reprieve``: the same with one of them added back (each reprieve).

p50/p99 in ms of wall-clock and of the thread's CPU time (on a busy machine the wall clock
mostly measures waiting for a CPU). Results go to ``benchmarks/results/preemption.json`` and a
markdown table beside it.

Run: ``python -m benchmarks.preemption_cost [--nodes 1000] [--samples N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.keys import VGPU_MODE
from benchmarks.decision_latency import NodeSpec, make_nodes
from benchmarks.results_io import save_results
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.mig_policy import build_choice_table
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.reservations import Added, Reservations
from scheduler_plugins.logs import configure
from scheduler_plugins.server.malloc import tune_allocator

DEFAULT_NODES = 1000
DEFAULT_SAMPLES = 200
DEFAULT_SEED = 20240601
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_JSON = RESULTS / "preemption.json"
WARMUP = 5
LOW, HIGH = 0, 1000
# kube-scheduler dry-runs preemption on at least 100 nodes (or 10% of them) before choosing.
CANDIDATE_NODES = 100


class Percentiles(TypedDict):
    samples: int
    p50_ms: float
    p99_ms: float
    cpu_p50_ms: float
    cpu_p99_ms: float


class Report(TypedDict):
    machine: dict[str, Any]
    nodes: int
    gpus: int
    pods: int
    preemptible_nodes: int
    candidate_nodes: int  # DefaultPreemption's dry run: max(10% of nodes, 100), capped
    what_ifs_per_cycle: int
    results: dict[str, Percentiles]


def fill(nodes: Sequence[NodeSpec], config: DeviceConfig) -> list[PodAllocation]:
    """Low-priority pods filling every GPU: two of 45% memory on a hami-core GPU, 1g
    instances on every free placement of a MIG GPU."""
    pods: list[PodAllocation] = []
    for name, devices, _, _ in nodes:
        for d in devices:
            if d.mode == "mig":
                table = build_choice_table(d.mig_profiles, config.mig_placement_policy)
                mask = 0
                while (choice := table.choose(mask, 0)) is not None:
                    placement = table.placement(*choice)
                    mask |= placement.mask
                    profile = table.profiles[choice[0]]
                    mig = MigAllocation(0, 0, d.id, profile.name, placement)
                    pods.append(_pod(len(pods), name, (), (mig,)))
                continue
            for _ in range(2):
                device = DeviceAlloc(d.id, d.devmem * 45 // 100, 10)
                pods.append(_pod(len(pods), name, (device,), ()))
    return pods


def _pod(
    i: int, node: str, devices: tuple[DeviceAlloc, ...], mig: tuple[MigAllocation, ...]
) -> PodAllocation:
    return PodAllocation(
        f"low/p{i}", node, devices, mig, 1000, 4 * 2**30, uid=f"uid-low-{i}", priority=LOW
    )


def request(config: DeviceConfig, name: str, pct: int, priority: int) -> PodRequest:
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": pct}
    pod: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "bench", "uid": f"uid-{name}"},
        "spec": {
            "priority": priority,
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
    }
    if name.startswith("core"):
        pod["metadata"]["annotations"] = {VGPU_MODE: "hami-core"}
    return parse_request(pod, config)


def _timed(call: Callable[[], object], samples: int) -> Percentiles:
    wall: list[float] = []
    cpu: list[float] = []
    for i in range(WARMUP + samples):
        c, t = time.thread_time(), time.perf_counter()
        call()
        w, u = (time.perf_counter() - t) * 1000, (time.thread_time() - c) * 1000
        if i >= WARMUP:
            wall.append(w)
            cpu.append(u)
    p50, p99 = np.percentile(wall, [50, 99])
    c50, c99 = np.percentile(cpu, [50, 99])
    return Percentiles(
        samples=samples,
        p50_ms=round(float(p50), 3),
        p99_ms=round(float(p99), 3),
        cpu_p50_ms=round(float(c50), 3),
        cpu_p99_ms=round(float(c99), 3),
    )


def _nothing() -> PodRequest | None:
    return None  # the decision is held: the dry run sends no pod to read


class _NoWrites:
    """The lifecycle's Kubernetes client: never called here (no pod carries leftovers)."""

    def get(self, path: str) -> Any:
        raise AssertionError(f"unexpected GET {path}")

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        raise AssertionError(f"unexpected PATCH {path}")


def run(n_nodes: int, samples: int, seed: int) -> Report:
    config = DeviceConfig()
    nodes = make_nodes(n_nodes, config, random.Random(seed))
    cache = ClusterCache(config, clock=time.monotonic)
    state = cache.state
    for name, devices, cpu, mem in nodes:
        state.upsert_node(name, devices, cpu_milli=cpu, memory_bytes=mem)
    pods = fill(nodes, config)
    for alloc in pods:
        state.upsert_pod(alloc, alloc.key)
    life = Reservations(
        cache,
        _NoWrites(),
        wall_clock=time.time,
        clock=time.monotonic,
        cpu_clock=time.thread_time,
    )
    stuck = request(config, "any-60pct", 60, LOW)
    fits = request(config, "core-10pct", 10, HIGH)
    offer = life.offer(replace(stuck, priority=HIGH), {}, {}, 0)
    assert not offer.nodes and len(offer.preemptible) == n_nodes, len(offer.preemptible)
    assert not life.offer(stuck, {}, {}, 0).preemptible
    assert life.offer(fits, {}, {}, 0).nodes

    # One hami-core node: what the shim's dry run asks there.
    node = next(name for name, devices, _, _ in nodes if devices[0].mode == "hami-core")
    on_node = state.pods_on(node)
    uids = [a.uid for a in on_node]
    high = replace(stuck, priority=HIGH)
    decision_id = life.offer(high, {}, {}, 0).decision_id
    ident = high.uid
    assert life.what_if(ident, high.key, decision_id, _nothing, node, uids, []).fits
    reprieve = [Added(uids[0], None)]

    gc.collect()
    results = {
        "prefilter_plain": _timed(lambda: life.offer(stuck, {}, {}, 0), samples),
        "prefilter_preemptible": _timed(lambda: life.offer(high, {}, {}, 0), samples),
        "prefilter_fits_preemptible": _timed(lambda: life.offer(fits, {}, {}, 0), samples),
    }
    decision_id = life.offer(high, {}, {}, 0).decision_id
    results["what_if_removed"] = _timed(
        lambda: life.what_if(ident, high.key, decision_id, _nothing, node, uids, []), samples
    )
    results["what_if_reprieve"] = _timed(
        lambda: life.what_if(ident, high.key, decision_id, _nothing, node, uids, reprieve), samples
    )
    candidates = sorted(offer.preemptible)[:CANDIDATE_NODES]

    def preemption_cycle() -> int:
        """PreFilter, then DefaultPreemption's dry run as the shim forwards it: per candidate
        node one what-if with every lower-priority pod removed, then one per victim added
        back (kube-scheduler's reprieve: kept if the pod still fits). Returns the calls."""
        did = life.offer(high, {}, {}, 0).decision_id
        calls = 0
        for name in candidates:
            victims = [a.uid for a in state.pods_on(name) if a.priority < HIGH]
            calls += 1
            if not life.what_if(ident, high.key, did, _nothing, name, victims, []).fits:
                continue
            kept: list[str] = []
            for uid in victims:
                calls += 1
                # The shim nets a victim added back against its removal: only the pods
                # still removed travel.
                gone = [u for u in victims if u not in (*kept, uid)]
                if life.what_if(ident, high.key, did, _nothing, name, gone, []).fits:
                    kept.append(uid)
        return calls

    calls_per_cycle = preemption_cycle()
    results["preemption_cycle"] = _timed(preemption_cycle, max(3, samples // 100))
    return Report(
        machine={
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        },
        nodes=n_nodes,
        gpus=sum(len(d) for _, d, _, _ in nodes),
        pods=len(pods),
        preemptible_nodes=len(offer.preemptible),
        candidate_nodes=len(candidates),
        what_ifs_per_cycle=calls_per_cycle,
        results=results,
    )


def markdown(report: Report) -> str:
    lines = [
        f"Preemption cost at {report['nodes']} nodes ({report['gpus']} GPUs, {report['pods']} "
        f"low-priority pods; {report['preemptible_nodes']} preemptible nodes for the stuck pod; "
        f"load average {report['machine']['loadavg_1m']} on {report['machine']['cpus']} CPUs)",
        "",
        "| call | p50 ms | p99 ms | CPU p50 ms | CPU p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['cpu_p50_ms']:.3f} "
            f"| {r['cpu_p99_ms']:.3f} |"
        )
    lines.append(
        f"\npreemption_cycle: PreFilter, then DefaultPreemption's dry run over "
        f"{report['candidate_nodes']} candidate nodes as the shim forwards it "
        f"({report['what_ifs_per_cycle']} FilterWhatIf calls; gRPC not included)."
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    configure("console", "warning")  # not a line per unschedulable PreFilter
    tune_allocator()  # as the plugin server runs
    report = run(args.nodes, args.samples, args.seed)
    save_results(args.json, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
