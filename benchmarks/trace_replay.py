"""Trace replay: the FGD paper's protocol on the Alibaba GPU-sharing traces, per placement policy.

Weng et al. (USENIX ATC '23) replay a trace's pods on a 1213-node, 6212-GPU cluster in a seeded
order until the GPU demand that arrived reaches 130 % of the cluster's GPUs; pods never leave;
a pod that fits nowhere (GPU, CPU and memory) is dropped. The figure is the share of GPU capacity
allocated, at every 1 % of arrived demand and at the end. The data (nodes, four traces, the
paper's per-policy results and its arrival-order generator ``fgd_order.go``) is read from
``--data`` (default ``../shared/data/openb`` next to the repository); the orders are generated
once with ``go run`` and cached.

A pod in HAMi's terms: ``gpu_milli`` m < 1000 is one device of ``gpucores`` m/10 and
``gpumem-percentage`` m/10; whole GPUs are ``nvidia.com/gpu: n`` with ``gpucores: 100``;
``deviceSplitCount`` 10. Policies, each on the same cluster and arrivals:

- ``random``: any fitting node and GPU (checks the harness against the paper's Random row);
- ``fgd``: the paper's FGD as its simulator scores it (the trace's kinds of GPU pods known in
  advance, by count, CPU and GPU only; 100 × sigmoid score, random among the top) —
  Tessera's ``fragmentation`` rule with the paper's settings;
- ``hami-default``: HAMi's defaults (node binpack, GPU spread: the seed's scores) through
  Tessera's engine (``ClusterState`` + ``decide``); CPU-only pods where kube-scheduler's default
  profile puts them (``core.hostfit``: NodeResourcesFit LeastAllocated + BalancedAllocation);
- ``hami-best-pair``: node spread, GPU binpack (the best of HAMi's four pairs here), the same;
- ``tessera-gpu-pods``: Tessera's fragmentation policy (``core.fragmentation``: GPU, CPU and
  memory, the workload learned from the pods that ask, dropped ones too) through the engine
  for GPU pods, CPU-only pods as kube-scheduler places them (what a cluster gets where only
  GPU pods are scheduled by Tessera);
- ``tessera``: the fragmentation policy for every pod, CPU-only pods too (their CPU and memory
  strand a node's free GPUs).

The engine sees each GPU as a hami-core device of 1000 MiB and 100 cores (``gpumem-percentage``
m/10 asks m MiB), 10 slots, each node's CPU and memory as its allocatable; it must pick a node
the replay's own accounting lets the pod fit, and find one whenever there is one.

Run: ``python -m benchmarks.trace_replay [--traces default,cpu050] [--seeds 42,43,44]
[--policies tessera,fgd] [--jobs 2] [--json PATH] [--plot PATH] [--data DIR]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from api.hami.config import DeviceConfig
from api.hami.policy import GpuPolicy, GpuSortKey, Policy, ScoringWeights
from api.hami.register import GpuDevice
from scheduler_plugins.core import fragmentation as frag
from scheduler_plugins.core import hostfit, rules
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.hostonly import allocation, place_host_only
from scheduler_plugins.core.requests import ContainerRequest, PodAllocation, PodRequest
from scheduler_plugins.core.rules import HostAmounts
from scheduler_plugins.core.state import ClusterState

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

REPO: Final = Path(__file__).resolve().parent.parent
DEFAULT_DATA: Final = REPO.parent / "shared" / "data" / "openb"
RESULTS: Final = Path(__file__).resolve().parent / "results"
TRACES: Final = ("default", "gpushare40", "multigpu30", "cpu050")
SEEDS: Final = (42, 43, 44)
PAPER_SEEDS: Final = tuple(range(42, 52))
RATIO: Final = 1.3
MAX_GPUS: Final = 8
SPLIT: Final = 10  # HAMi's deviceSplitCount
MILLI: Final = 1000
MIB: Final = 1 << 20
PAPER_POLICIES: Final = {
    "01-Random": "Random",
    "02-DotProd": "DotProd",
    "03-GpuClustering": "GpuClustering",
    "04-GpuPacking": "GpuPacking",
    "05-BestFit": "BestFit",
    "06-FGD": "FGD",
}


class TraceError(Exception):
    """The trace data is missing or unreadable; the message names the file."""


@dataclass(frozen=True)
class Cluster:
    names: tuple[str, ...]
    cpu: F64  # millicores
    memory: F64  # bytes
    gpus: I64  # GPUs per node
    models: tuple[str, ...]


@dataclass(frozen=True)
class Pod:
    cpu: int  # millicores
    memory: int  # bytes
    gpus: int
    milli: int  # per device; 1000 = a whole GPU; 0 for CPU-only pods
    models: tuple[str, ...]  # allowed GPU models; () = any


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror}") from e


def _int(row: dict[str, str], key: str, path: Path) -> int:
    try:
        v = int(row[key])
    except (KeyError, ValueError):
        raise TraceError(f"{path}: row {row.get('name') or row.get('sn')}: bad {key}") from None
    if v < 0:
        raise TraceError(f"{path}: row {row.get('name') or row.get('sn')}: negative {key}")
    return v


def load_cluster(path: Path) -> Cluster:
    rows = _rows(path)
    gpus = np.array([_int(r, "gpu", path) for r in rows], np.int64)
    if (gpus > MAX_GPUS).any():
        raise TraceError(f"{path}: a node has more than {MAX_GPUS} GPUs")
    return Cluster(
        tuple(r["sn"] for r in rows),
        np.array([_int(r, "cpu_milli", path) for r in rows], np.float64),
        np.array([_int(r, "memory_mib", path) for r in rows], np.float64) * MIB,
        gpus,
        tuple(r.get("model", "") for r in rows),
    )


def load_pods(path: Path) -> list[Pod]:
    pods = []
    for r in _rows(path):
        n = _int(r, "num_gpu", path)
        m = min(_int(r, "gpu_milli", path), MILLI) if n else 0
        spec = tuple(s for s in (r.get("gpu_spec") or "").split("|") if s)
        pods.append(Pod(_int(r, "cpu_milli", path), _int(r, "memory_mib", path) * MIB, n, m, spec))
    return pods


def arrival_orders(data: Path, trace: str, seeds: Sequence[int], cache: Path) -> dict[int, I64]:
    """Per seed, the pods' row indexes in arrival order (the paper's generator, cached)."""
    out: dict[int, I64] = {}
    cache.mkdir(parents=True, exist_ok=True)
    missing = [s for s in seeds if not (cache / f"{trace}-{s}.txt").exists()]
    if missing:
        env = dict(os.environ, GOFLAGS="-mod=mod", GO111MODULE="off")
        cmd = [
            "go",
            "run",
            str(data / "fgd_order.go"),
            str(data / "openb_node_list_gpu_node.csv"),
            str(data / f"openb_pod_list_{trace}.csv"),
            str(RATIO),
            ",".join(map(str, missing)),
        ]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise TraceError(f"generating the arrival order failed: {detail.strip()}") from e
        for line in done.stdout.splitlines():
            seed, _, rest = line.partition(" ")
            (cache / f"{trace}-{seed}.txt").write_text(rest)
    for s in seeds:
        out[s] = np.array((cache / f"{trace}-{s}.txt").read_text().split(), np.int64)
    return out


# ----- the cluster as the replay keeps it ----------------------------------------------------


class Nodes:
    """Per node: CPU and memory left; per GPU: milli left (-1: no GPU) and devices held."""

    def __init__(self, c: Cluster) -> None:
        n = len(c.names)
        self.cluster = c
        self.cpu_left = c.cpu.copy()
        self.mem_left = c.memory.copy()
        cols = np.arange(MAX_GPUS)
        self.left = np.where(cols < c.gpus[:, None], MILLI, -1).astype(np.int64)
        self.slots = np.zeros((n, MAX_GPUS), np.int64)
        self.name_rank = np.arange(n, dtype=np.int64)
        self.model_of = np.array(c.models)
        self.total_milli = int(c.gpus.sum()) * MILLI
        self.used_milli = 0

    def fits(self, pod: Pod) -> npt.NDArray[np.bool_]:
        ok = (self.cpu_left >= pod.cpu) & (self.mem_left >= pod.memory)
        if pod.models:
            ok &= np.isin(self.model_of, pod.models)
        if pod.gpus:
            ok &= (self._gpu_fit(pod)).sum(axis=1) >= pod.gpus
        return ok

    def _gpu_fit(self, pod: Pod, rows: I64 | slice = slice(None)) -> npt.NDArray[np.bool_]:
        """The GPUs (of ``rows``) that can take one device: rules.core_checks in milli."""
        cap, used = self.amounts(rows)
        req = float(pod.milli)
        cores = pod.milli // 10
        return rules.fold(rules.core_checks(cap, used, req, cores), self.left[rows] >= 0)

    def amounts(self, rows: I64 | slice = slice(None)) -> tuple[rules.Amounts, rules.Amounts]:
        left = self.left[rows]
        has = left >= 0
        cap = rules.Amounts(
            np.where(has, SPLIT, 0).astype(np.float64),
            np.where(has, MILLI, 0).astype(np.float64),
            np.where(has, 100, 0).astype(np.float64),
        )
        used_milli = np.where(has, MILLI - left, 0).astype(np.float64)
        used = rules.Amounts(self.slots[rows].astype(np.float64), used_milli, used_milli / 10)
        return cap, used

    def free(self, rows: I64) -> F64:
        """Per GPU of ``rows``, its free share (NaN: no GPU): ``fragmentation``'s view."""
        cap, used = self.amounts(rows)
        share = frag.free_share(cap.slots, used.slots, cap.cores, used.cores, cap.mem, used.mem)
        return np.where(self.left[rows] >= 0, share, np.nan)

    def place(self, i: int, pod: Pod, columns: Sequence[int]) -> None:
        self.cpu_left[i] -= pod.cpu
        self.mem_left[i] -= pod.memory
        for g in columns:
            assert self.left[i, g] >= pod.milli and self.slots[i, g] < SPLIT, "double allocation"
            self.left[i, g] -= pod.milli
            self.slots[i, g] += 1
        self.used_milli += pod.milli * len(columns)


# ----- policies: (nodes, fitting rows, pod) -> (node, GPU columns) ---------------------------

Choice = tuple[int, list[int]]
Place = Callable[[Nodes, I64, Pod], Choice | None]
"""A policy sees every pod as it arrives, with the nodes that fit it (``cand``, maybe none:
the live scheduler is asked about a pod no node has room for too); None: it is dropped."""


def kube_default(nodes: Nodes, cand: I64, pod: Pod) -> Choice | None:
    """kube-scheduler's default score for a pod Tessera leaves to it (``core.hostfit``:
    NodeResourcesFit LeastAllocated + NodeResourcesBalancedAllocation), first of the top."""
    if not cand.size:
        return None
    c = nodes.cluster
    score = hostfit.kube_scores(
        HostAmounts(c.cpu[cand], c.memory[cand]),
        HostAmounts(c.cpu[cand] - nodes.cpu_left[cand], c.memory[cand] - nodes.mem_left[cand]),
        pod.cpu,
        pod.memory,
    )
    return int(cand[np.argmax(score)]), []


class Engine:
    """Tessera's engine on the replayed cluster: every GPU a hami-core device of 1000 MiB
    (``gpumem-percentage`` m/10 asks m MiB), ``deviceSplitCount`` slots, 100 cores."""

    def __init__(self, cluster: Cluster, config: DeviceConfig, cpu_pods: bool) -> None:
        self.state = ClusterState(config)
        self.cpu_pods = cpu_pods
        self.config = config
        self.index = {name: i for i, name in enumerate(cluster.names)}
        for i, name in enumerate(cluster.names):
            devices = tuple(
                GpuDevice(
                    f"{name}/{j}", j, SPLIT, MILLI, 100, cluster.models[i], 0, True, "hami-core"
                )
                for j in range(int(cluster.gpus[i]))
            )
            self.state.upsert_node(
                name, devices, cpu_milli=int(cluster.cpu[i]), memory_bytes=int(cluster.memory[i])
            )
        self.n = 0

    def place(self, nodes: Nodes, cand: I64, pod: Pod) -> Choice | None:
        if not pod.gpus and not self.cpu_pods:
            choice = kube_default(nodes, cand, pod)
            if choice is not None:
                self._assume(nodes.cluster.names[choice[0]], pod)
            return choice
        self.n += 1
        pct = pod.milli // 10
        req = PodRequest(
            key=f"replay/p{self.n}",
            uid=f"p{self.n}",
            containers=(ContainerRequest(0, "c", pod.gpus, 0, pct, pct),) if pod.gpus else (),
            container_count=1,
            modes=None,
            node_policy=self.config.default_node_policy,
            gpu_policy=self.config.default_gpu_policy,
            numa_bind=False,
            weights=ScoringWeights(),
            use_types=pod.models,
            nouse_types=(),
            use_uuids=(),
            nouse_uuids=(),
            cpu_milli=pod.cpu,
            memory_bytes=pod.memory,
        )
        if not cand.size:  # asked about as the live scheduler is (the workload counts it)
            if pod.gpus and decide(self.state, req).best_node() is not None:
                raise AssertionError(f"the engine finds a node for {pod} where none fits")
            return None
        if not pod.gpus:  # the rule the live scheduler applies to such a pod
            node = place_host_only(self.state, req).best()
            if node is None:
                raise AssertionError(f"the engine finds no node for {pod} where {cand.size} fit")
            self.state.assume(allocation(req, node))
            return self._checked(node, pod, cand), []
        decision = decide(self.state, req)
        node = decision.best_node()
        if node is None:
            raise AssertionError(f"the engine finds no node for {pod} where {cand.size} fit")
        i = self._checked(node, pod, cand)
        plan = decision.plan_for(node)
        assert plan is not None
        cols = [int(d.uuid.rpartition("/")[2]) for c in plan.containers for d in c]
        self.state.assume(plan.allocation(pod.cpu, pod.memory, uid=req.uid))
        return i, cols

    def _checked(self, node: str, pod: Pod, cand: I64) -> int:
        i = self.index[node]
        if i not in set(cand.tolist()):
            raise AssertionError(f"the engine chose {node}, which cannot hold {pod}")
        return i

    def _assume(self, node: str, pod: Pod) -> None:
        self.n += 1
        self.state.assume(PodAllocation(f"replay/p{self.n}", node, (), (), pod.cpu, pod.memory))


def fgd_paper(pods: Sequence[Pod], seed: int) -> Place:
    """FGD as the paper's simulator scores it: the trace's kinds of GPU pods by count (CPU
    and GPU only, the most frequent ``fragmentation.MAX_KINDS``), 100 × sigmoid score,
    random among the top. (Its simulator's default keeps the kinds covering 60 % of the pods;
    here that allocates about 90 % on the default trace, far below the paper's FGD row, and
    every kind about 94.7 %: the kinds are what the paper's runs must have used.)"""
    counts = Counter(frag.pod_shape(p.cpu, 0, p.gpus, p.milli / MILLI) for p in pods if p.gpus)
    mix = frag.TaskMix.of(counts, coverage=1.0)
    rng = np.random.default_rng(seed)

    def place(nodes: Nodes, cand: I64, pod: Pod) -> Choice | None:
        if not cand.size:
            return None
        free = nodes.free(cand)
        shape = frag.Shape(pod.cpu, 0, pod.gpus, pod.milli / MILLI if pod.gpus else 0.0)
        d = frag.placement_delta(free, nodes.cpu_left[cand], np.full(len(cand), np.inf), mix, shape)
        s = frag.scores(d.delta)
        k = int(rng.choice(np.flatnonzero(s == s.max())))
        return int(cand[k]), [int(g) for g in d.columns[k] if g >= 0]

    return place


def random_policy(seed: int) -> Place:
    rng = np.random.default_rng(seed)

    def place(nodes: Nodes, cand: I64, pod: Pod) -> Choice | None:
        if not cand.size:
            return None
        i = int(rng.choice(cand))
        fit = np.flatnonzero(nodes._gpu_fit(pod, np.array([i]))[0])
        return i, [int(g) for g in rng.permutation(fit)[: pod.gpus]] if pod.gpus else []

    return place


POLICIES: Final = (
    "random",
    "fgd",
    "hami-default",
    "hami-best-pair",
    "tessera-gpu-pods",
    "tessera",
)


ENGINE_CONFIGS: Final = {
    "hami-default": DeviceConfig(default_node_policy=Policy.BINPACK),
    "hami-best-pair": DeviceConfig(
        default_node_policy=Policy.SPREAD, default_gpu_policy=GpuPolicy((GpuSortKey.BINPACK,))
    ),
    "tessera-gpu-pods": DeviceConfig(default_node_policy=Policy.FRAGMENTATION),
    "tessera": DeviceConfig(default_node_policy=Policy.FRAGMENTATION),
}


def make_policy(
    name: str,
    pods: Sequence[Pod],
    seed: int,
    cluster_engine: Callable[[DeviceConfig, bool], Place],
) -> Place:
    """The policy ``name`` on a cluster: the engine's (``cluster_engine``: Tessera's engine
    with a device config, scoring CPU-only pods too or leaving them to kube-scheduler) or
    the replay's own baselines."""
    if name == "random":
        return random_policy(seed)
    if name == "fgd":
        return fgd_paper(pods, seed)
    if name in ENGINE_CONFIGS:
        return cluster_engine(ENGINE_CONFIGS[name], name == "tessera")
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")


# ----- the replay ----------------------------------------------------------------------------


@dataclass
class Run:
    trace: str
    seed: int
    policy: str
    allocation: float  # % of GPU capacity at the end
    curve: list[float]  # % allocated after each 1 % of arrived demand, 0..130
    dropped: dict[str, int]
    pods: int
    seconds: float


def replay(cluster: Cluster, pods: Sequence[Pod], order: Sequence[int], place: Place) -> Run:
    nodes = Nodes(cluster)
    arrived = 0
    curve = [0.0]
    dropped: Counter[str] = Counter()
    t0 = time.process_time()
    for idx in order:
        pod = pods[idx]
        cand = np.flatnonzero(nodes.fits(pod))
        choice = place(nodes, cand, pod)
        if (choice is None) != (cand.size == 0):
            raise AssertionError(f"the policy dropped {pod} where {cand.size} nodes fit")
        if choice is not None:
            i, cols = choice
            if pod.gpus and len(cols) != pod.gpus:
                raise AssertionError(f"policy placed {len(cols)} of {pod.gpus} devices")
            nodes.place(i, pod, cols)
        else:
            kind = "cpu" if not pod.gpus else "shared" if pod.milli < MILLI else f"{pod.gpus}-gpu"
            dropped[kind] += 1
        arrived += pod.milli * pod.gpus
        while len(curve) <= int(arrived * 100 / nodes.total_milli) and len(curve) <= 130:
            curve.append(100.0 * nodes.used_milli / nodes.total_milli)
    while len(curve) <= 130:
        curve.append(100.0 * nodes.used_milli / nodes.total_milli)
    final = 100.0 * nodes.used_milli / nodes.total_milli
    return Run(
        "",
        0,
        "",
        round(final, 3),
        [round(x, 3) for x in curve],
        dict(dropped),
        len(order),
        round(time.process_time() - t0, 2),
    )


def _one(args: tuple[Path, str, int, str, list[int]]) -> Run:
    data, trace, seed, policy, order = args
    cluster = load_cluster(data / "openb_node_list_gpu_node.csv")
    pods = load_pods(data / f"openb_pod_list_{trace}.csv")

    def engine(config: DeviceConfig, cpu_pods: bool) -> Place:
        return Engine(cluster, config, cpu_pods).place

    run = replay(cluster, pods, order, make_policy(policy, pods, seed, engine))
    run.trace, run.seed, run.policy = trace, seed, policy
    return run


def paper_rows(data: Path) -> dict[tuple[str, str, int], float]:
    """(trace, paper policy, seed) -> % allocated at 130 %."""
    out = {}
    for r in _rows(data / "expected_allocation.csv"):
        trace = r["workload"].removeprefix("openb_pod_list_")
        name = PAPER_POLICIES.get(r["sc_policy"])
        if name is not None:
            out[(trace, name, int(r["seed"]))] = float(r["130"])
    return out


def summarize(runs: Sequence[Run], paper: dict[tuple[str, str, int], float]) -> dict[str, Any]:
    traces = sorted({r.trace for r in runs}, key=TRACES.index)
    table: dict[str, Any] = {}
    for t in traces:
        mine = [r for r in runs if r.trace == t]
        seeds = sorted({r.seed for r in mine})
        row: dict[str, Any] = {
            "seeds": seeds,
            "tessera_policies": {},
            "paper_same_seeds": {},
            "paper_all_seeds": {},
        }
        for p in POLICIES:
            vals = [r.allocation for r in mine if r.policy == p]
            if vals:
                row["tessera_policies"][p] = round(float(np.mean(vals)), 2)
        for name in PAPER_POLICIES.values():
            same = [paper[(t, name, s)] for s in seeds if (t, name, s) in paper]
            every = [paper[(t, name, s)] for s in PAPER_SEEDS if (t, name, s) in paper]
            if same:
                row["paper_same_seeds"][name] = round(float(np.mean(same)), 2)
            if every:
                row["paper_all_seeds"][name] = round(float(np.mean(every)), 2)
        table[t] = row
    return table


def format_table(summary: dict[str, Any]) -> str:
    lines = []
    for t, row in summary.items():
        lines.append(f"### {t} (seeds {', '.join(map(str, row['seeds']))})\n")
        lines.append("| policy | GPU allocated at 130 % | vs paper's FGD (same seeds) |")
        lines.append("| --- | --- | --- |")
        fgd = row["paper_same_seeds"].get("FGD")
        for p, v in row["tessera_policies"].items():
            vs = f"{v - fgd:+.2f}" if fgd is not None else "-"
            lines.append(f"| {p} (this run) | {v:.2f} | {vs} |")
        for name, v in row["paper_same_seeds"].items():
            every = row["paper_all_seeds"].get(name)
            lines.append(f"| paper {name} | {v:.2f} (10 seeds: {every:.2f}) | |")
        lines.append("")
    return "\n".join(lines)


def plot(runs: Sequence[Run], data: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paper_curves: dict[tuple[str, str], list[list[float]]] = {}
    seeds = {r.seed for r in runs}
    for r in _rows(data / "expected_allocation.csv"):
        name = PAPER_POLICIES.get(r["sc_policy"])
        if name in ("FGD", "BestFit") and int(r["seed"]) in seeds:
            t = r["workload"].removeprefix("openb_pod_list_")
            paper_curves.setdefault((t, name), []).append([float(r[str(i)]) for i in range(131)])
    traces = sorted({r.trace for r in runs}, key=TRACES.index)
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    x = np.arange(131)
    for ax, t in zip(axes[0], traces, strict=True):
        for p in POLICIES:
            curves = [r.curve for r in runs if r.trace == t and r.policy == p]
            if curves:
                ax.plot(x, np.mean(curves, axis=0), label=p)
        for name in ("FGD", "BestFit"):
            if (t, name) in paper_curves:
                ax.plot(x, np.mean(paper_curves[(t, name)], axis=0), "--", label=f"paper {name}")
        ax.set_xlim(80, 130)
        ax.set_ylim(75, 100)
        ax.set_title(t)
        ax.set_xlabel("arrived GPU demand, % of capacity")
        ax.set_ylabel("GPU allocated, % of capacity")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _names(text: str, valid: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {bad or text!r}; valid: {', '.join(valid)}"
        )
    return names


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers: {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--traces", type=lambda s: _names(s, TRACES, "trace"), default=list(TRACES))
    ap.add_argument("--seeds", type=_seeds, default=list(SEEDS))
    ap.add_argument(
        "--policies", type=lambda s: _names(s, POLICIES, "policy"), default=list(POLICIES)
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "tessera"
        / "openb-order",
    )
    ap.add_argument("--json", type=Path, default=RESULTS / "trace_replay.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "trace_replay.png")
    args = ap.parse_args(argv)
    if not (args.data / "openb_node_list_gpu_node.csv").exists():
        print(f"trace data not found in {args.data} (--data DIR)", file=sys.stderr)
        return 2
    try:
        jobs = []
        for t in args.traces:
            orders = arrival_orders(args.data, t, args.seeds, args.cache)
            for s in args.seeds:
                for p in args.policies:
                    jobs.append((args.data, t, s, p, orders[s].tolist()))
        # the slow policies first, so the pool ends together
        jobs.sort(key=lambda j: -("tessera" in j[3]))
        with ProcessPoolExecutor(max(1, args.jobs)) as pool:
            runs = list(pool.map(_one, jobs))
        paper = paper_rows(args.data)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = summarize(runs, paper)
    text = format_table(summary)
    print(text)
    report = {"summary": summary, "runs": [r.__dict__ for r in runs]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    args.json.with_suffix(".md").write_text("# Trace replay\n\n" + text + "\n")
    plot(runs, args.data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
