"""One benchmark run: for each node count and scheduler, a fresh kwok cluster, the scenarios,
the measurements, the invariant check, teardown.

A *phase* is one scheduler on one fresh cluster of N nodes, in this order: node-concurrency
bursts (on the empty cluster); the queue drain (part of the workload created while the
scheduler is stopped, then timed as it binds them); the streamed workload (created as fast
as the client threads can, for latency); churn; then, for Tessera, ``check_cluster``. What
each scenario measures is in ``batches``; CPU, memory, plugin RPC histograms and apiserver
request counts come from ``sampling``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from api.errors import TesseraError
from api.hami.policy import Policy
from api.kube.client import KubeClient
from api.kube.errors import ConflictError
from scheduler_plugins.devtools.bench import audit, procstat
from scheduler_plugins.devtools.bench.batches import (
    NAMESPACE,
    Batch,
    batch_json,
    burst_json,
    create_batch,
    drain_json,
    wait_batch,
)
from scheduler_plugins.devtools.bench.bindlog import committed_in_log
from scheduler_plugins.devtools.bench.cluster import (
    BenchCluster,
    Scheduler,
    SchedulerKind,
    TesseraScheduler,
    scheduler_for,
)
from scheduler_plugins.devtools.bench.errors import BenchError
from scheduler_plugins.devtools.bench.sampling import Sampler
from scheduler_plugins.devtools.bench.scenarios import (
    Ended,
    churn_pods,
    concurrency_bursts,
    delete_resurrected,
    end_pods,
    pending_reasons,
    registers,
    run_check,
)
from scheduler_plugins.devtools.bench.statemem import offline_nodes_used
from scheduler_plugins.devtools.bench.watcher import PodTimes
from scheduler_plugins.devtools.bench.workload import DEFAULT_MIX, BenchPod, Mix, generate
from scheduler_plugins.devtools.cluster.layout import ClusterSettings
from scheduler_plugins.devtools.cluster.nodes import NodeProfile, add_nodes, wait_ready
from scheduler_plugins.devtools.cluster.stack import StackPaths
from scheduler_plugins.devtools.cluster.testing import settings_in
from scheduler_plugins.devtools.progress import Progress

log = structlog.get_logger(__name__)

MAX_SOCKET_PATH: Final = 107
SLOW_LIST_TIMEOUT_S: Final = 300.0  # listing every pod of a loaded cluster
CHECK_SETTLE_S: Final = 5.0  # after deleting pods kwok revived, before the invariant check

Json = dict[str, Any]

USER_AGENT: Final = "tessera-bench"  # how the apiserver's audit log names the benchmark


@dataclass(frozen=True)
class BenchOptions:
    nodes: tuple[int, ...] = (1000,)
    pods: int | None = None  # None: pods_per_node × nodes
    pods_per_node: int = 10
    seed: int = 1
    mix: Mix = DEFAULT_MIX
    replicas: int = 0  # fractional pods copy this many templates (0: each drawn alone)
    profile: NodeProfile | None = None  # None: workload.bench_profile()
    schedulers: tuple[SchedulerKind, ...] = (SchedulerKind.TESSERA, SchedulerKind.STOCK)
    node_concurrency: bool = True
    # The apiserver writes an audit log: API requests of the drain by client (audit.py).
    audit: bool = True
    drain_share: float = 0.5  # this share of the workload is queued, then drained
    churn_fraction: float = 0.2  # 0: no churn scenario
    create_workers: int = 8
    rate: float | None = None  # pods/s the client creates at most; None: as fast as it can
    settle_s: float = 30.0  # give up waiting once nothing is bound for this long
    scenario_timeout_s: float = 3600.0
    work_dir: Path = Path("/tmp/tessera-bench")
    progress: bool = True
    webhook: bool = False  # Tessera's admission webhook in the create path
    node_policy: Policy | None = None  # None: the cluster default (binpack)

    def pod_count(self, nodes: int) -> int:
        return self.pods if self.pods is not None else self.pods_per_node * nodes


# A phase --------------------------------------------------------------------------------------


def run_phase(
    opts: BenchOptions,
    node_count: int,
    kind: SchedulerKind,
    profile: NodeProfile,
    workload: tuple[BenchPod, ...],
) -> Json:
    """One scheduler on one fresh cluster of ``node_count`` nodes: every scenario, measured."""
    name = f"bench-{kind.value}-{node_count}"
    settings = settings_in(opts.work_dir / f"{kind.value}-{node_count}", name)
    socket = StackPaths.of(settings).socket
    if len(str(socket)) > MAX_SOCKET_PATH:
        raise BenchError(
            f"the plugin server's socket {socket} would be longer than {MAX_SOCKET_PATH} "
            "characters (the limit of Unix socket paths): choose a shorter --work-dir"
        )
    cluster = BenchCluster(settings, audit=opts.audit)
    scheduler = scheduler_for(kind, webhook=opts.webhook, node_policy=opts.node_policy)
    show = opts.progress
    out: Json = {"scheduler": kind.value, "nodes": node_count, "load_before": _load()}
    watch: PodTimes | None = None
    if settings.state_dir.exists():
        # A run killed before its clean-up left this cluster (processes, etcd, simulated
        # GPUs): every phase must start from nothing, or it measures and checks old pods.
        log.warning("bench.stale_cluster_purged", state_dir=str(settings.state_dir))
        scheduler.stop(settings)
        cluster.down(purge=True)
    t0 = time.monotonic()
    try:
        info = cluster.up()
        out["cluster_up_s"] = round(time.monotonic() - t0, 2)
        with KubeClient(info.server, info.token, info.ca_file, user_agent=USER_AGENT) as api:
            t1 = time.monotonic()
            names = add_nodes(api, profile, node_count)
            wait_ready(api, names, timeout_s=max(300.0, node_count * 0.2))
            out["nodes_ready_s"] = round(time.monotonic() - t1, 2)
            _ensure_namespace(api)
            scheduler.start(settings)
            watch = PodTimes(api, NAMESPACE)
            watch.start()

            def pids() -> dict[str, int]:
                return {
                    **cluster.component_pids(),
                    **scheduler.pids(settings),
                    "bench-client": os.getpid(),
                }

            sampler = Sampler(
                pids,
                scheduler.metrics_url,
                api,
                scheduler_metrics_url=scheduler.scheduler_metrics_url,
            )
            sampler.mark("start")
            wait_alloc = kind is SchedulerKind.TESSERA

            def batch(label: str, pods: tuple[BenchPod, ...], title: str, timeout: float) -> Batch:
                assert watch is not None
                b = Batch(label, pods)
                progress = Progress(title, len(pods), enabled=show)
                feeder = create_batch(
                    api, scheduler, b, workers=opts.create_workers, rate=opts.rate
                )
                wait_batch(
                    watch,
                    b,
                    feeder,
                    wait_allocated=wait_alloc,
                    settle_s=opts.settle_s,
                    timeout_s=timeout,
                    progress=progress,
                )
                return b

            bursts: list[Json] = []
            if opts.node_concurrency:
                for label, what, pods in concurrency_bursts(registers(api, names)):
                    b = batch(label, pods, f"{kind.value} {node_count}n {label}", 120.0)
                    bursts.append(burst_json(label, what, b))
            out["node_concurrency"] = bursts

            streamed = workload
            if opts.drain_share > 0:
                cut = round(len(workload) * opts.drain_share)
                queued, streamed = workload[:cut], workload[cut:]
                if queued:
                    out["drain"] = _drain(
                        api, scheduler, settings, watch, sampler, opts, queued, node_count
                    )

            sampler.mark("main-start")
            main = batch(
                "main", streamed, f"{kind.value} {node_count}n main", opts.scenario_timeout_s
            )
            sampler.mark("main-end")
            out["main"] = batch_json(main, failed=watch.failed)
            out["main"]["pending_reasons"] = pending_reasons(api, "main")
            out["plugin_rpc"] = sampler.histograms_json("main-start", "main-end")
            out["main"]["scheduling_cycle"] = sampler.cycle_json("main-start", "main-end")
            out["api_requests"] = sampler.requests_json("main-start", "main-end", len(main.bound))

            marked: list[str] = []
            if opts.churn_fraction > 0 and main.bound:
                out["churn"], marked = _churn(
                    api, scheduler, watch, opts, main, batch, kind, node_count
                )
            sampler.mark("end")
            out["components"] = sampler.components_json("start", "end", ("main-start", "main-end"))
            out["metrics_url"] = scheduler.metrics_url
            out["metrics_error"] = sampler.metrics_error
            if isinstance(scheduler, TesseraScheduler):
                with KubeClient(
                    info.server,
                    info.token,
                    info.ca_file,
                    timeout_s=SLOW_LIST_TIMEOUT_S,
                    user_agent=USER_AGENT,
                ) as slow:
                    revived = delete_resurrected(slow, marked, "main")
                    if "churn" in out:
                        out["churn"]["revived_by_kwok"] = len(revived)
                    if revived:
                        time.sleep(CHECK_SETTLE_S)  # the node agents reclaim their instances
                    out["check"] = run_check(
                        slow,
                        scheduler.agent_state(settings),
                        before_retry=functools.partial(delete_resurrected, slow, marked, "main"),
                    )
                    if "churn" in out:  # with those revived after the first sweep
                        out["churn"]["revived_by_kwok"] += len(out["check"].get("revived_late", []))
            else:
                out["check"] = None
    except (TesseraError, TimeoutError, OSError) as e:
        # Keep what was measured; the report shows the error with it.
        out["error"] = f"{type(e).__name__}: {e}"
        log.error("bench.phase_failed", scheduler=kind.value, nodes=node_count, error=str(e))
    finally:
        if watch is not None:
            watch.stop()
        scheduler.stop(settings)
        cluster.down()
        out["logs"] = str(_keep_logs(settings.log_dir, opts.work_dir / "logs" / name))
        cluster.down(purge=True)
    out["load_after"] = _load()
    out["phase_s"] = round(time.monotonic() - t0, 1)
    return out


def _drain(
    api: KubeClient,
    scheduler: Scheduler,
    settings: ClusterSettings,
    watch: PodTimes,
    sampler: Sampler,
    opts: BenchOptions,
    pods: tuple[BenchPod, ...],
    node_count: int,
) -> Json:
    """Create ``pods`` while the scheduler is stopped, then start it and time how fast it
    binds the queue: the scheduler's own throughput, with no client creating pods beside."""
    title = f"{scheduler.kind.value} {node_count}n drain"
    scheduler.pause(settings)
    b = Batch("drain", pods)
    feeder = create_batch(api, scheduler, b, workers=opts.create_workers)
    creating = Progress(f"{title} (creating, scheduler stopped)", len(pods), enabled=opts.progress)
    while feeder.is_alive():
        creating.update(len(b.sent))
        feeder.join(0.5)
    creating.close(len(b.sent))
    # Counters before the scheduler starts (nothing asks the plugin server or, for the
    # pods, the apiserver meanwhile): scraping the plugin server's /metrics once the drain
    # runs would take CPU from it and leave the first requests uncounted.
    window_start = time.time()  # the audit log's clock
    sampler.mark("drain-start", procs=False)
    resumed = time.monotonic()
    scheduler.resume(settings)
    sampler.mark("drain-start", scrapes=False)  # after: the restarted scheduler's new pid
    wait_batch(
        watch,
        b,
        feeder,
        wait_allocated=scheduler.kind is SchedulerKind.TESSERA,
        # the CPU and API figures count everything the pods cost the cluster: kwok writes
        # a pod's status after its binding, behind a stock scheduler's fast drain
        wait_running=True,
        settle_s=opts.settle_s,
        timeout_s=opts.scenario_timeout_s,
        progress=Progress(title, len(pods), enabled=opts.progress),
    )
    sampler.mark("drain-end")
    now, mono = time.time(), time.monotonic()
    by_client = audit.requests_by_client(settings.log_dir, window_start, now)
    committed = committed_in_log(scheduler.log_path(settings), NAMESPACE, b.bound.keys(), now=now)
    out = drain_json(
        b,
        resumed,
        cpu_s=sampler.cpu_between("drain-start", "drain-end"),
        requests=sampler.requests_json("drain-start", "drain-end", len(b.bound)),
        watch_events=sampler.watch_events_json("drain-start", "drain-end", len(b.bound)),
        committed={n: t - now + mono for n, t in committed.items()},
    )
    out["plugin_rpc"] = sampler.histograms_json("drain-start", "drain-end")
    if cycle_messages := sampler.cycle_messages_json("drain-start", "drain-end"):
        out["cycle_messages"] = cycle_messages
    out["scheduling_cycle"] = sampler.cycle_json("drain-start", "drain-end")
    out["nodes_used"] = len({b.nodes[p.name] for p in pods if p.gpus and p.name in b.nodes})
    if by_client is not None:
        out["api_requests_by_client"] = by_client.rows(len(b.bound))
        out["audit_unreadable_lines"] = by_client.unreadable
    return out


def _churn(
    api: KubeClient,
    scheduler: Scheduler,
    watch: PodTimes,
    opts: BenchOptions,
    main: Batch,
    batch: Callable[[str, tuple[BenchPod, ...], str, float], Batch],
    kind: SchedulerKind,
    node_count: int,
) -> tuple[Json, list[str]]:
    """The churn's results, and the pods it marked Succeeded."""
    delete, succeed = churn_pods(list(main.bound), opts.churn_fraction, opts.seed)
    arrivals = generate(
        len(delete) + len(succeed),
        seed=opts.seed + 1,
        mix=opts.mix,
        prefix="churn",
        replicas=opts.replicas,
    )
    ended: list[Ended] = []
    ended_s: list[float] = []

    def ending() -> None:
        t = time.monotonic()
        ended.append(end_pods(api, delete, succeed, opts.create_workers))
        ended_s.append(time.monotonic() - t)

    ender = threading.Thread(target=ending, name="churn-end", daemon=True)
    ender.start()
    b = batch(
        "churn", arrivals, f"{scheduler.kind.value} {node_count}n churn", opts.scenario_timeout_s
    )
    ender.join()
    result = batch_json(b, failed=watch.failed)
    done = ended[0] if ended else Ended(errors=["the churn thread did not finish"])
    result.update(
        {
            "deleted": done.deleted,
            "succeeded": done.succeeded,
            "deleted_instead": done.deleted_instead,
            "end_errors": done.errors[:10],
            "end_s": round(ended_s[0], 2) if ended_s else None,
            "pending_reasons": pending_reasons(api, "churn"),
        }
    )
    return result, done.marked


def _keep_logs(src: Path, dst: Path) -> Path:
    """Copy a phase's process logs out of the cluster state dir before it is purged."""
    if dst.exists():
        shutil.rmtree(dst)
    if src.is_dir():
        shutil.copytree(src, dst)
    return dst


def _ensure_namespace(api: KubeClient) -> None:
    with contextlib.suppress(ConflictError):  # already there
        api.post(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        )


def _load() -> list[float]:
    return [round(x, 2) for x in procstat.load_average()]


# The whole run --------------------------------------------------------------------------------


def run(opts: BenchOptions, *, on_phase: Callable[[Json], None] | None = None) -> Json:
    """Every node count × scheduler; ``on_phase`` gets the partial result after each phase
    (to write it out as the run goes). One run at a time per work dir."""
    if not opts.nodes or any(n < 1 for n in opts.nodes):
        raise BenchError(f"node counts must be ≥ 1, got {list(opts.nodes)}")
    with exclusive_work_dir(opts.work_dir):
        return _run(opts, on_phase)


def _run(opts: BenchOptions, on_phase: Callable[[Json], None] | None) -> Json:
    from scheduler_plugins.devtools.bench.workload import bench_profile

    profile = opts.profile or bench_profile()
    result: Json = {
        "version": 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"cpus": os.cpu_count(), "load_before": _load()},
        "options": _options_json(opts, profile),
        "runs": [],
    }
    for n in opts.nodes:
        workload = generate(opts.pod_count(n), seed=opts.seed, mix=opts.mix, replicas=opts.replicas)
        entry: Json = {"nodes": n, "pods": len(workload), "phases": {}}
        if opts.drain_share > 0:
            queued = workload[: round(len(workload) * opts.drain_share)]
            entry["offline_nodes_used"] = offline_nodes_used(queued, n, profile)
        result["runs"].append(entry)
        for kind in opts.schedulers:
            log.info("bench.phase", scheduler=kind.value, nodes=n, pods=len(workload))
            entry["phases"][kind.value] = run_phase(opts, n, kind, profile, workload)
            entry["ratio"] = ratios(entry["phases"])
            if on_phase is not None:
                on_phase(result)
    result["host"]["load_after"] = _load()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


LOCK_FILE: Final = "bench.lock"


@contextlib.contextmanager
def exclusive_work_dir(work_dir: Path) -> Iterator[None]:
    """Hold ``work_dir`` for one run. Each phase purges the cluster a killed run left there
    (its processes too): a second run at the same time would tear down the first's."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / LOCK_FILE
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise BenchError(
                f"another tessera bench (pid {holder}) is running in {work_dir}: wait for it "
                "to finish, or give this run its own --work-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def ratios(phases: Mapping[str, Json]) -> Json | None:
    """Tessera ÷ stock for throughput (higher is better for Tessera) and latencies."""
    t, s = phases.get(SchedulerKind.TESSERA.value), phases.get(SchedulerKind.STOCK.value)
    tm, sm = (t or {}).get("main"), (s or {}).get("main")
    if not tm or not sm:
        return None

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    td, sd = (t or {}).get("drain") or {}, (s or {}).get("drain") or {}
    out: Json = {
        "drain_throughput": div(td.get("drain_pods_per_s"), sd.get("drain_pods_per_s")),
        "throughput": div(tm["throughput_pods_per_s"], sm["throughput_pods_per_s"]),
        "steady_throughput": div(tm["steady_pods_per_s"], sm["steady_pods_per_s"]),
    }
    for q in ("p50_ms", "p99_ms"):
        tl, sl = tm.get("latency_ms") or {}, sm.get("latency_ms") or {}
        out[f"latency_{q}"] = div(tl.get(q), sl.get(q))
    return out


def _options_json(opts: BenchOptions, profile: NodeProfile) -> Json:
    return {
        "nodes": list(opts.nodes),
        "pods": opts.pods,
        "pods_per_node": opts.pods_per_node,
        "seed": opts.seed,
        "mix": {k.value: w for k, w in opts.mix.weights().items()},
        "replicas": opts.replicas,
        "schedulers": [k.value for k in opts.schedulers],
        "node_concurrency": opts.node_concurrency,
        "drain_share": opts.drain_share,
        "churn_fraction": opts.churn_fraction,
        "create_workers": opts.create_workers,
        "rate": opts.rate,
        "settle_s": opts.settle_s,
        "webhook": opts.webhook,
        "node_policy": opts.node_policy.value if opts.node_policy else None,
        "profile": [
            {"model": g.model, "mode": g.mode, "weight": g.weight, "gpus": g.gpus_per_node}
            for g in profile.groups
        ],
    }
