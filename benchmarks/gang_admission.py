"""Gang admission latency: 100 gangs of 8 whole-GPU pods against the same pods without a gang,
in one run on one dev cluster of 1000 fake nodes.

One cluster (real etcd + kube-apiserver + kwok, nodes of ``examples/cluster-profile.yaml``)
with Tessera's stack (plugin server, ``tessera-scheduler``, kwok node agent; no admission
webhook: the pods are written for ``hami-scheduler`` already). Every pod asks one whole GPU of
a hami-core node (``nvidia.com/gpu: 1``, ``nvidia.com/gpumem: 40000``, 1 CPU, 1Gi). After a
warm-up (20 groups of each kind, not measured), ``--rounds`` rounds each run two phases one
after the other (plain first in even rounds, gang first in odd ones: neither always has the
cluster freshly emptied), each of ``--gangs`` groups of ``--size`` pods, created group after
group as fast as the apiserver takes them (a group's pods in parallel on ``--workers``
threads):

- ``plain``: the groups' pods are independent pods;
- ``gang``: each group is a PodGroup (``scheduling.k8s.io/v1alpha2``, gang ``minCount`` =
  ``--size``) created just before its members, which name it in ``spec.schedulingGroup``:
  kube-scheduler places the members in one cycle (all or nothing), then binds them.

One list+watch of the phase's pods (by its label) records when each pod was first seen bound
(``spec.nodeName``) on this process's monotonic clock. Per phase:

- a group's admission latency: from sending its first pod's create to the last of its pods
  seen bound; p50/p90/p99/max/mean in ms over the groups of every round;
- the drain: from the phase's first create to its last pod bound (seconds), and pods/s;
  the median of the rounds';
- a group's bind spread: from the first to the last of its members seen bound (seconds);
- groups left partly bound when the phase ended (a gang must be all or nothing);
- the CPU time of each of the cluster's processes from the phase's first create until its
  last pod was bound, in ms per pod (less moved by the machine's load than latency is).

Then the ratios gang/plain, also per round (on a busy machine they move from one round to
the next). A phase's pods (and PodGroups) are deleted (grace period 0) before the next phase
starts. Results go to ``benchmarks/results/gang_admission.json`` and a markdown table beside
it; error and warning lines in the stack's logs are counted.

Run: ``python -m benchmarks.gang_admission [--nodes 1000] [--gangs 100] [--size 8]
[--workers 8] [--rounds 3] [--json PATH] [--logs DIR]`` (needs the dev cluster's binaries:
``make tools``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypedDict

from api.hami.keys import VGPU_MODE
from api.kube.client import KubeClient, Obj, Watch
from api.kube.errors import KubeError
from api.kube.reflector import Reflector
from benchmarks.results_io import save_results
from scheduler_plugins.devtools.bench.procstat import ProcFormatError, parse_stat
from scheduler_plugins.devtools.bench.stats import summarize_seconds
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.cluster import COMPONENTS, Cluster
from scheduler_plugins.devtools.cluster.layout import GANG_API, ClusterSettings, repo_root
from scheduler_plugins.devtools.cluster.nodes import add_nodes, load_profile, wait_ready
from scheduler_plugins.devtools.cluster.stack import (
    SCHEDULER_NAME,
    STACK,
    metrics_address,
    start_stack,
)
from scheduler_plugins.devtools.cluster.testing import settings_in
from scheduler_plugins.logs import configure

DEFAULT_NODES: Final = 1000
DEFAULT_GANGS: Final = 100
DEFAULT_SIZE: Final = 8
DEFAULT_WORKERS: Final = 8
DEFAULT_ROUNDS: Final = 3
WARMUP_GROUPS: Final = 20  # per kind, unmeasured
RESULTS: Final = Path(__file__).resolve().parent / "results"
DEFAULT_JSON: Final = RESULTS / "gang_admission.json"
PROFILE: Final = repo_root() / "examples" / "cluster-profile.yaml"

NAMESPACE: Final = "default"
PODS_PATH: Final = f"/api/v1/namespaces/{NAMESPACE}/pods"
PODGROUPS_PATH: Final = f"/apis/{GANG_API}/namespaces/{NAMESPACE}/podgroups"
PHASE_LABEL: Final = "tessera.dev/bench-phase"
GROUP_LABEL: Final = "tessera.dev/bench-group"
PLAIN, GANG, WARMUP = "plain", "gang", "warmup"
LIMITS: Final[Mapping[str, object]] = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 40000}
REQUESTS: Final[Mapping[str, object]] = {"cpu": "1", "memory": "1Gi"}
GANG_OUTCOMES: Final = re.compile(r'^tessera_gangs_total\{outcome="([^"]+)"\} (\S+)$')
# klog's error and warning lines ("E1202 11:16:50.123 ...") and structlog's (console or JSON).
ERROR_LINE: Final = re.compile(r'^E\d{4} |"level": ?"(error|critical)"|\[(error|critical)\s*\]')
WARNING_LINE: Final = re.compile(r'^W\d{4} |"level": ?"warning"|\[warning\s*\]')
PHASE_TIMEOUT_S: Final = 900.0
SETTLE_S: Final = 120.0  # give up on a phase once nothing was bound for this long


# What is reported ----------------------------------------------------------------------------


class Spread(TypedDict):
    p50_s: float | None
    max_s: float | None


class RoundResult(TypedDict):
    load_1m: float | None  # when the phase started
    bound: int
    create_s: float  # first create sent -> last create answered
    p50_ms: float | None  # admission latency per group
    p99_ms: float | None
    drain_s: float | None  # first create sent -> last pod bound
    pods_per_s: float | None
    cpu_ms_per_pod: dict[str, float]  # each process's CPU time while the phase ran, per pod


class PhaseResult(TypedDict):
    rounds: int
    groups: int  # over all rounds, as what follows
    pods: int
    bound: int
    admission: dict[str, float | int] | None  # per group, ms: count, mean, p50, p90, p99, max
    drain_s: float | None  # median over the rounds
    pods_per_s: float | None  # median over the rounds
    cpu_ms_per_pod: dict[str, float]  # median over the rounds
    per_round: list[RoundResult]
    complete_groups: int
    partial_groups: int  # some but not all members bound when the phase ended
    all_or_nothing: bool
    bind_spread: Spread  # first -> last member bound, over the complete groups


class Report(TypedDict):
    machine: dict[str, Any]
    options: dict[str, Any]
    phases: dict[str, PhaseResult]
    ratios: dict[str, Any]  # gang / plain
    gang_outcomes: dict[str, float]  # tessera_gangs_total by outcome, at the end
    log_errors: dict[str, dict[str, Any]]


# Manifests -----------------------------------------------------------------------------------


def group_name(phase: str, group: int) -> str:
    return f"{phase}-{group:03d}"


def pod_name(phase: str, group: int, member: int) -> str:
    return f"{group_name(phase, group)}-{member}"


def pod_manifest(phase: str, group: int, member: int, *, gang: bool) -> Obj:
    """One whole hami-core GPU, 1 CPU, 1Gi; with ``gang`` a member of its group's PodGroup."""
    spec: Obj = {
        "schedulerName": SCHEDULER_NAME,
        "containers": [
            {
                "name": "main",
                "image": "busybox",
                "resources": {"limits": dict(LIMITS), "requests": dict(REQUESTS)},
            }
        ],
    }
    if gang:
        spec["schedulingGroup"] = {"podGroupName": group_name(phase, group)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(phase, group, member),
            "namespace": NAMESPACE,
            "labels": {PHASE_LABEL: phase, GROUP_LABEL: group_name(phase, group)},
            "annotations": {VGPU_MODE: "hami-core"},
        },
        "spec": spec,
    }


def podgroup_manifest(phase: str, group: int, min_count: int) -> Obj:
    return {
        "apiVersion": GANG_API,
        "kind": "PodGroup",
        "metadata": {
            "name": group_name(phase, group),
            "namespace": NAMESPACE,
            "labels": {PHASE_LABEL: phase},
        },
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    }


def selector(phase: str) -> str:
    return f"{PHASE_LABEL}={phase}"


# Statistics ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupTimes:
    """One group on the monotonic clock: when its first create was sent, its members' binds."""

    size: int
    started: float
    bound: tuple[float, ...]  # sorted

    @property
    def complete(self) -> bool:
        return len(self.bound) == self.size

    @property
    def partial(self) -> bool:
        return 0 < len(self.bound) < self.size

    @property
    def latency_s(self) -> float | None:
        return self.bound[-1] - self.started if self.complete else None

    @property
    def spread_s(self) -> float | None:
        return self.bound[-1] - self.bound[0] if self.complete else None


def group_times(
    members: Mapping[str, Sequence[str]],
    sent_at: Mapping[str, float],
    bound_at: Mapping[str, float],
) -> list[GroupTimes]:
    """Per group (name -> its pods): first create sent, binds seen (pods never bound left out)."""
    out: list[GroupTimes] = []
    for pods in members.values():
        out.append(
            GroupTimes(
                size=len(pods),
                started=min(sent_at[p] for p in pods),
                bound=tuple(sorted(bound_at[p] for p in pods if p in bound_at)),
            )
        )
    return out


@dataclass(frozen=True)
class Round:
    """One phase's groups in one round, and how long sending their creates took."""

    groups: tuple[GroupTimes, ...]
    created_s: float
    cpu_s: Mapping[str, float] = field(default_factory=dict)  # process -> CPU s meanwhile
    load_1m: float | None = None

    @property
    def binds(self) -> list[float]:
        return [t for g in self.groups for t in g.bound]

    @property
    def drain_s(self) -> float | None:
        binds = self.binds
        return max(binds) - min(g.started for g in self.groups) if binds else None


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _median_by_key(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in rows for k in row})
    out: dict[str, float] = {}
    for k in keys:
        m = _median([row[k] for row in rows if k in row])
        if m is not None:
            out[k] = round(m, 3)
    return out


def round_result(r: Round) -> RoundResult:
    summary = summarize_seconds([g.latency_s for g in r.groups if g.latency_s is not None])
    drain, bound = r.drain_s, len(r.binds)
    return RoundResult(
        load_1m=r.load_1m,
        bound=bound,
        create_s=round(r.created_s, 3),
        p50_ms=round(summary.p50_ms, 3) if summary else None,
        p99_ms=round(summary.p99_ms, 3) if summary else None,
        drain_s=_rounded(drain),
        pods_per_s=round(bound / drain, 2) if drain else None,
        cpu_ms_per_pod={k: round(v * 1000 / bound, 3) for k, v in r.cpu_s.items()} if bound else {},
    )


def phase_result(rounds: Sequence[Round]) -> PhaseResult:
    """One phase's figures: latencies and spreads pooled over the rounds' groups, the drain
    and the throughput the median of the rounds'."""
    groups = [g for r in rounds for g in r.groups]
    latencies = [g.latency_s for g in groups if g.latency_s is not None]
    spreads = [g.spread_s for g in groups if g.spread_s is not None]
    summary = summarize_seconds(latencies)
    per_round = [round_result(r) for r in rounds]
    drains = [x["drain_s"] for x in per_round if x["drain_s"] is not None]
    rates = [x["pods_per_s"] for x in per_round if x["pods_per_s"] is not None]
    partial = sum(g.partial for g in groups)
    return PhaseResult(
        rounds=len(rounds),
        groups=len(groups),
        pods=sum(g.size for g in groups),
        bound=sum(len(g.bound) for g in groups),
        admission=summary.to_json() if summary else None,
        drain_s=_rounded(_median(drains)),
        pods_per_s=_rounded(_median(rates), 2),
        cpu_ms_per_pod=_median_by_key([x["cpu_ms_per_pod"] for x in per_round]),
        per_round=per_round,
        complete_groups=sum(g.complete for g in groups),
        partial_groups=partial,
        all_or_nothing=partial == 0,
        bind_spread=Spread(
            p50_s=_rounded(_median(spreads)), max_s=_rounded(max(spreads, default=None))
        ),
    )


RATIO_KEYS: Final = ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms")


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(plain: PhaseResult, gang: PhaseResult) -> dict[str, Any]:
    """gang / plain of each admission statistic, the drain and the throughput; and of each
    round's p50 latency (how much the ratio moves from one round to the next)."""
    p, g = plain["admission"] or {}, gang["admission"] or {}
    out: dict[str, Any] = {f"admission_{k}": _ratio(g.get(k), p.get(k)) for k in RATIO_KEYS}
    out["drain_s"] = _ratio(gang["drain_s"], plain["drain_s"])
    out["pods_per_s"] = _ratio(gang["pods_per_s"], plain["pods_per_s"])
    out["cpu_ms_per_pod"] = {
        k: _ratio(v, plain["cpu_ms_per_pod"].get(k)) for k, v in gang["cpu_ms_per_pod"].items()
    }
    out["round_p50"] = [
        _ratio(b["p50_ms"], a["p50_ms"])
        for a, b in zip(plain["per_round"], gang["per_round"], strict=False)
    ]
    return out


def order(round_index: int) -> tuple[str, str]:
    """The phases of a round: plain first in even rounds, gang first in odd ones."""
    return (PLAIN, GANG) if round_index % 2 == 0 else (GANG, PLAIN)


def tag(phase: str, round_index: int) -> str:
    """A phase's label value and name prefix in one round."""
    return f"{phase}-{round_index}"


# Markdown ------------------------------------------------------------------------------------


def _cell(value: float | int | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def markdown(report: Report) -> str:
    opts, machine = report["options"], report["machine"]
    lines = [
        f"Gang admission at {opts['nodes']} nodes: {opts['gangs']} groups × {opts['size']} "
        f"whole-GPU pods per phase, {opts['workers']} client threads creating them "
        f"(commit {machine['commit']}, {machine['cpus']} CPUs, load average "
        f"{machine['load_before'][0]} before, {machine['load_after'][0]} after)",
        "",
        f"{opts['rounds']} rounds, each both phases (plain first in even rounds, gang first "
        "in odd ones). Admission latency per group: first create sent → last member seen "
        "bound, pooled over the rounds; drain and pods/s: median of the rounds'.",
        "",
        "| phase | bound | p50 ms | p90 ms | p99 ms | max ms | mean ms | drain s | pods/s "
        "| spread p50 s | spread max s | partial groups |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["phases"].items():
        a: Mapping[str, float | int] = r["admission"] or {}
        lines.append(
            f"| {name} | {r['bound']}/{r['pods']} | {_cell(a.get('p50_ms'))} "
            f"| {_cell(a.get('p90_ms'))} | {_cell(a.get('p99_ms'))} | {_cell(a.get('max_ms'))} "
            f"| {_cell(a.get('mean_ms'))} | {_cell(r['drain_s'], '.2f')} "
            f"| {_cell(r['pods_per_s'])} | {_cell(r['bind_spread']['p50_s'], '.3f')} "
            f"| {_cell(r['bind_spread']['max_s'], '.3f')} | {r['partial_groups']} |"
        )
    q = report["ratios"]
    lines += [
        "",
        "| gang / plain | p50 | p90 | p99 | max | mean | drain | pods/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        "| ratio | "
        + " | ".join(_cell(q.get(f"admission_{k}"), ".2f") for k in RATIO_KEYS)
        + f" | {_cell(q.get('drain_s'), '.2f')} | {_cell(q.get('pods_per_s'), '.2f')} |",
        "",
        *_cpu_table(report),
        "",
        *_round_table(report),
    ]
    if report["gang_outcomes"]:
        outcomes = ", ".join(f"{k} {v:g}" for k, v in sorted(report["gang_outcomes"].items()))
        lines += ["", f"Plugin server's `tessera_gangs_total` at the end: {outcomes}."]
    errors = ", ".join(
        f"{k} {v['count']} ({v['warnings']} warnings)" for k, v in report["log_errors"].items()
    )
    lines += ["", f"Error lines in the logs: {errors or 'none read'}."]
    return "\n".join(lines) + "\n"


def _cpu_table(report: Report) -> list[str]:
    """CPU ms per pod of each process (median of the rounds), and gang / plain."""
    phases = report["phases"]
    names = sorted({k for r in phases.values() for k in r["cpu_ms_per_pod"]})
    if not names:
        return []
    per = report["ratios"].get("cpu_ms_per_pod") or {}
    rows = [(name, r["cpu_ms_per_pod"]) for name, r in phases.items()]
    lines = [
        "CPU ms per pod while a phase ran (median of the rounds):",
        "",
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for name, cpu in rows:
        lines.append(f"| {name} | " + " | ".join(_cell(cpu.get(n), ".2f") for n in names) + " |")
    lines.append("| gang / plain | " + " | ".join(_cell(per.get(n), ".2f") for n in names) + " |")
    return lines


def _round_table(report: Report) -> list[str]:
    plain, gang = report["phases"][PLAIN]["per_round"], report["phases"][GANG]["per_round"]
    lines = [
        "| round | first | plain p50 ms | gang p50 ms | gang/plain p50 | plain p99 ms "
        "| gang p99 ms | plain drain s | gang drain s | load (plain, gang) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, (p, g) in enumerate(zip(plain, gang, strict=False)):
        lines.append(
            f"| {i} | {order(i)[0]} | {_cell(p['p50_ms'])} | {_cell(g['p50_ms'])} "
            f"| {_cell(_ratio(g['p50_ms'], p['p50_ms']), '.2f')} | {_cell(p['p99_ms'])} "
            f"| {_cell(g['p99_ms'])} | {_cell(p['drain_s'], '.2f')} "
            f"| {_cell(g['drain_s'], '.2f')} | {_cell(p['load_1m'])}, {_cell(g['load_1m'])} |"
        )
    return lines


# The cluster side ----------------------------------------------------------------------------


class _Selected:
    """``KubeClient`` as the reflector sees it, narrowed to a label selector."""

    def __init__(self, api: KubeClient, label_selector: str) -> None:
        self._api = api
        self._selector = label_selector

    def list(self, path: str) -> Obj:
        return self._api.list(path, label_selector=self._selector)

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> Watch:
        return self._api.watch(
            path, resource_version, label_selector=self._selector, timeout_s=timeout_s
        )


class BindTimes:
    """When each pod of one phase was first seen bound: one list+watch by the phase's label."""

    def __init__(self, api: KubeClient, phase: str) -> None:
        self.bound_at: dict[str, float] = {}
        self._changed = threading.Condition()
        self._reflector = Reflector(
            _Selected(api, selector(phase)),
            PODS_PATH,
            on_list=self._listed,
            on_event=self._seen,
            watch_timeout_s=60,
        )

    def _listed(self, pods: list[Obj], _listed_at: float) -> None:
        for pod in pods:
            self._seen("ADDED", pod)

    def _seen(self, event_type: str, pod: Obj) -> None:
        now = time.monotonic()
        if event_type == "DELETED" or not (pod.get("spec") or {}).get("nodeName"):
            return
        with self._changed:
            self.bound_at.setdefault(str(pod["metadata"]["name"]), now)
            self._changed.notify_all()

    @contextlib.contextmanager
    def running(self) -> Iterator[BindTimes]:
        self._reflector.start()
        try:
            if not self._reflector.synced.wait(60):
                raise TimeoutError("the pod watch did not sync in 60s")
            yield self
        finally:
            self._reflector.stop()

    def wait_all(self, names: Sequence[str], timeout_s: float, settle_s: float) -> dict[str, float]:
        """Until every named pod is bound, ``timeout_s`` passed, or none was for ``settle_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            count, progress = -1, time.monotonic()
            while True:
                done = sum(n in self.bound_at for n in names)
                now = time.monotonic()
                if done != count:
                    count, progress = done, now
                if done == len(names) or now > deadline or now - progress > settle_s:
                    return dict(self.bound_at)
                self._changed.wait(1.0)


def _say(message: str) -> None:
    sys.stderr.write(f"[gang_admission] {message}\n")
    sys.stderr.flush()


def create_groups(
    api: KubeClient, phase: str, gangs: int, size: int, workers: int, *, gang: bool
) -> tuple[dict[str, list[str]], dict[str, float], float]:
    """Group after group: (gang) its PodGroup, then its pods in parallel. Returns group ->
    pod names, pod -> when its create was sent, and how long all the creates took."""
    sent_at: dict[str, float] = {}
    members: dict[str, list[str]] = {}

    def create(pod: Obj) -> None:
        sent_at[pod["metadata"]["name"]] = time.monotonic()
        api.post(PODS_PATH, pod)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for g in range(gangs):
            if gang:
                api.post(PODGROUPS_PATH, podgroup_manifest(phase, g, size))
            pods = [pod_manifest(phase, g, i, gang=gang) for i in range(size)]
            list(pool.map(create, pods))
            members[group_name(phase, g)] = [p["metadata"]["name"] for p in pods]
    return members, sent_at, time.monotonic() - t0


def delete_phase(api: KubeClient, phase: str, timeout_s: float = 300.0) -> None:
    """Delete the phase's pods (grace period 0) and PodGroups; wait until the pods are gone."""
    options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
    query = {"labelSelector": selector(phase)}
    api.request("DELETE", PODS_PATH, options, query=query)
    with contextlib.suppress(KubeError):  # no PodGroup in a plain phase
        api.request("DELETE", PODGROUPS_PATH, options, query=query)
    deadline = time.monotonic() + timeout_s
    while api.list(PODS_PATH, label_selector=selector(phase)).get("items"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pods of phase {phase} not gone after {timeout_s:.0f}s")
        time.sleep(0.5)


def run_phase(
    api: KubeClient,
    phase: str,
    gangs: int,
    size: int,
    workers: int,
    *,
    gang: bool,
    cpu: Callable[[], dict[str, float]] = dict,
) -> Round:
    """Create the phase's groups, wait until their pods are bound, delete them. ``cpu``:
    each process's CPU seconds so far (read before the creates and once all are bound)."""
    load = round(os.getloadavg()[0], 2)
    with BindTimes(api, phase).running() as watch:
        before = cpu()
        members, sent_at, created_s = create_groups(api, phase, gangs, size, workers, gang=gang)
        names = [p for pods in members.values() for p in pods]
        bound_at = watch.wait_all(names, PHASE_TIMEOUT_S, SETTLE_S)
        used = {k: round(v - before[k], 3) for k, v in cpu().items() if k in before}
    delete_phase(api, phase)
    time.sleep(2.0)  # the scheduler and the plugin server see the deletions
    return Round(tuple(group_times(members, sent_at, bound_at)), created_s, used, load)


def cpu_reader(settings: ClusterSettings) -> Callable[[], dict[str, float]]:
    """CPU seconds (user + system, all threads) of each of the cluster's processes."""
    pids: dict[str, int] = {}
    for c in (*COMPONENTS, *STACK):
        record = processes.read_record(settings.pid_file(c))
        if record is not None:
            pids[c] = record.pid

    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for c, pid in pids.items():
            with contextlib.suppress(OSError, ProcFormatError):
                out[c] = parse_stat(Path(f"/proc/{pid}/stat").read_text())
        return out

    return read


def gang_outcomes(metrics_text: str) -> dict[str, float]:
    """``tessera_gangs_total`` by outcome, from the plugin server's /metrics."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if m := GANG_OUTCOMES.match(line):
            out[m.group(1)] = float(m.group(2))
    return out


def _scrape_gangs(address: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            return gang_outcomes(r.read().decode())
    except OSError:
        return {}


def log_errors(lines: Sequence[str], samples: int = 5) -> dict[str, Any]:
    """How many lines of a log are errors (the first few of them) and warnings."""
    found = [ln.rstrip()[:400] for ln in lines if ERROR_LINE.search(ln)]
    warnings = sum(1 for ln in lines if WARNING_LINE.search(ln))
    return {"count": len(found), "first": found[:samples], "warnings": warnings}


def _read_log(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def machine(commit_of: Callable[[], str]) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "commit": commit_of(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


@dataclass(frozen=True)
class Options:
    nodes: int
    gangs: int
    size: int
    workers: int
    profile: Path
    rounds: int = 1
    logs: Path | None = None  # where to copy the stack's logs before the teardown


@contextlib.contextmanager
def dev_cluster(opts: Options, state_dir: Path) -> Iterator[tuple[ClusterSettings, KubeClient]]:
    """A dev cluster in ``state_dir`` with the profile's nodes and Tessera's stack (no
    webhook); torn down and purged on exit."""
    settings = settings_in(state_dir, "gang-bench")
    cluster = Cluster(settings)
    try:
        t0 = time.monotonic()
        info = cluster.up(timeout_s=180.0)
        with info.api() as api:
            names = add_nodes(api, load_profile(opts.profile), opts.nodes)
            wait_ready(api, names, timeout_s=max(300.0, opts.nodes * 0.3))
            start_stack(settings, timeout_s=120.0, webhook=False)
            _say(f"{opts.nodes} nodes and the stack ready in {time.monotonic() - t0:.1f}s")
            yield settings, api
    finally:
        cluster.down(purge=True)


def bench(opts: Options, state_dir: Path) -> Report:
    """The warm-up, then the rounds of both phases on one cluster; what the stack logged and
    counted."""
    facts = machine(git_commit)
    rounds: dict[str, list[Round]] = {PLAIN: [], GANG: []}
    with dev_cluster(opts, state_dir) as (settings, api):
        for phase in (PLAIN, GANG):  # unmeasured: the stack's first cycles of each kind
            warm = f"{WARMUP}-{phase}"
            run_phase(api, warm, WARMUP_GROUPS, opts.size, opts.workers, gang=phase == GANG)
        cpu = cpu_reader(settings)
        for i in range(opts.rounds):
            for phase in order(i):
                r = run_phase(
                    api,
                    tag(phase, i),
                    opts.gangs,
                    opts.size,
                    opts.workers,
                    gang=phase == GANG,
                    cpu=cpu,
                )
                rounds[phase].append(r)
                _say(f"round {i} {phase}: {json.dumps(round_result(r))}")
        outcomes = _scrape_gangs(metrics_address(settings))
        errors = {c: log_errors(_read_log(settings.log_file(c))) for c in STACK}
        if opts.logs is not None:
            opts.logs.mkdir(parents=True, exist_ok=True)
            for c in STACK:
                with contextlib.suppress(OSError):
                    shutil.copy(settings.log_file(c), opts.logs / f"{c}.log")
    facts["load_after"] = [round(x, 2) for x in os.getloadavg()]
    phases = {phase: phase_result(rs) for phase, rs in rounds.items()}
    return Report(
        machine=facts,
        options={
            "nodes": opts.nodes,
            "gangs": opts.gangs,
            "size": opts.size,
            "workers": opts.workers,
            "rounds": opts.rounds,
            "warmup_groups_per_kind": WARMUP_GROUPS,
            "profile": _shown(opts.profile),
            "limits": dict(LIMITS),
            "requests": dict(REQUESTS),
        },
        phases=phases,
        ratios=ratios(phases[PLAIN], phases[GANG]),
        gang_outcomes=outcomes,
        log_errors=errors,
    )


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(repo_root()))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    parser.add_argument("--gangs", type=int, default=DEFAULT_GANGS, help="groups per phase")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="pods per group")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="create threads")
    parser.add_argument("--profile", type=Path, default=PROFILE, help="node profile")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds of both phases")
    parser.add_argument("--logs", type=Path, help="copy the stack's logs into this folder")
    args = parser.parse_args(argv)
    configure("console", "warning")
    opts = Options(
        args.nodes,
        args.gangs,
        args.size,
        args.workers,
        args.profile.resolve(),
        rounds=args.rounds,
        logs=args.logs,
    )
    # A short path: the plugin server's Unix socket lives under it (at most 107 characters).
    with tempfile.TemporaryDirectory(prefix="tessera-gang-") as tmp:
        report = bench(opts, Path(tmp) / "state")
    save_results(args.json, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
