"""``tessera bench``: argparse wiring of the cluster benchmark.

Registering the command imports nothing heavy (every ``tessera`` invocation builds the
parser); the benchmark's modules load when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Final

import structlog

from scheduler_plugins.devtools.bench.errors import BenchInputError

DEFAULT_OUTPUT: Final = Path("benchmarks/results")
DEFAULT_NAME: Final = "cluster-bench"
SCHEDULERS: Final = ("tessera", "stock")
NODE_POLICIES: Final = ("binpack", "spread", "fragmentation")


def add_bench_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "bench",
        help="scheduler benchmark on kwok clusters: Tessera vs. the stock kube-scheduler",
        description="Bring up fresh kwok clusters of fake GPU nodes, submit a deterministic "
        "pod mix to Tessera and (on another fresh cluster) equivalent plain pods to the stock "
        "kube-scheduler, and report throughput, latency, plugin RPC latency, CPU and memory.",
    )
    p.add_argument(
        "--nodes",
        type=_int_list,
        default=(1000,),
        metavar="N[,N...]",
        help="node counts, one run each (default 1000; e.g. 100,1000,5000)",
    )
    p.add_argument("--pods", type=int, help="pods per run (default: --pods-per-node × nodes)")
    p.add_argument("--pods-per-node", type=int, default=10, help="default 10")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    p.add_argument(
        "--mix",
        metavar="KIND=W,...",
        help="weights of plain, fractional, whole-gpu, mig (default "
        "plain=0.1,fractional=0.45,whole-gpu=0.15,mig=0.3), or a named mix: default, "
        "fractional (every pod a share of one or two GPUs)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="fractional pods are replicas of N templates, as N Deployments' pods are "
        "(default 0: each pod drawn on its own)",
    )
    p.add_argument("--profile", type=Path, help="node profile YAML (default: built-in 8-GPU mix)")
    p.add_argument(
        "--schedulers",
        type=_schedulers,
        default=SCHEDULERS,
        metavar="tessera,stock",
        help="which schedulers to run (default both)",
    )
    p.add_argument("--no-node-concurrency", action="store_true", help="skip that scenario")
    p.add_argument(
        "--no-audit",
        action="store_true",
        help="no apiserver audit log (and no table of the drain's API requests by client)",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="share of the workload created while the scheduler is stopped, then timed as "
        "it drains the queue (default 0.5; 0 skips); the rest is streamed",
    )
    p.add_argument(
        "--churn",
        type=float,
        default=0.2,
        metavar="FRACTION",
        help="share of bound pods ended while as many new ones arrive (default 0.2; 0 skips)",
    )
    p.add_argument("--create-workers", type=int, default=8, help="client threads creating pods")
    p.add_argument(
        "--rate",
        type=float,
        metavar="PODS_PER_S",
        help="create at most this many pods per second (default: as fast as the client can)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="stop waiting once nothing was bound for this long (default 30)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS", help="per scenario")
    p.add_argument(
        "--node-policy",
        choices=NODE_POLICIES,
        help="annotate Tessera's GPU pods with this node policy (default: none, so the "
        "cluster default, binpack); fragmentation goes on pods without a GPU too, which "
        "Tessera then places as well",
    )
    p.add_argument(
        "--webhook",
        action="store_true",
        help="run Tessera's admission webhook too (every pod create then goes through it)",
    )
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="(benchmarks/results)")
    p.add_argument("--name", default=DEFAULT_NAME, help="file name stem (cluster-bench)")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="cluster state dirs (default CACHE/bench); one bench at a time per dir",
    )
    p.add_argument("--no-plots", action="store_true", help="JSON and Markdown only")
    p.add_argument(
        "--profile-python",
        action="store_true",
        help="cProfile every thread of the plugin server and node agent; pstats and text "
        "summaries go to OUTPUT_DIR/NAME-profiles/",
    )
    p.add_argument(
        "--state-only",
        action="store_true",
        help="no clusters: for each --nodes count, build the plugin server's cache with the "
        "workload placed by the scheduling core in a fresh process, and report its RSS and "
        "decision time (OUTPUT_DIR/NAME-state.json)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench)
    return p


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 100,1000") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: node counts must be ≥ 1")
    return values


def _schedulers(text: str) -> tuple[str, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in SCHEDULERS:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(SCHEDULERS)}")
    if not names:
        raise argparse.ArgumentTypeError("name at least one scheduler")
    return tuple(dict.fromkeys(names))


def _cmd_bench(args: argparse.Namespace) -> int:
    from api.hami.policy import Policy
    from scheduler_plugins.devtools.bench.cluster import SchedulerKind
    from scheduler_plugins.devtools.bench.report import write_report
    from scheduler_plugins.devtools.bench.runner import BenchOptions, Json, run
    from scheduler_plugins.devtools.bench.workload import DEFAULT_MIX, Mix
    from scheduler_plugins.devtools.cluster.layout import default_cache_dir
    from scheduler_plugins.devtools.cluster.nodes import load_profile

    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    for flag, value, lo in (
        ("--pods", args.pods, 0),
        ("--pods-per-node", args.pods_per_node, 0),
        ("--create-workers", args.create_workers, 1),
    ):
        if value is not None and value < lo:
            raise BenchInputError(f"{flag} must be ≥ {lo}, got {value}")
    if args.rate is not None and not args.rate > 0:
        raise BenchInputError(f"--rate must be > 0 pods/s, got {args.rate}")
    if not 0.0 <= args.drain < 1.0:
        raise BenchInputError(f"--drain must be in [0, 1), got {args.drain}")
    if not 0.0 <= args.churn < 1.0:
        raise BenchInputError(f"--churn must be in [0, 1), got {args.churn}")
    for flag, seconds in (("--settle", args.settle), ("--timeout", args.timeout)):
        if not seconds > 0:
            raise BenchInputError(f"{flag} must be > 0 seconds, got {seconds}")
    if args.state_only:
        return _state_only(args)
    work_dir = args.work_dir or default_cache_dir() / "bench"
    if args.profile_python:
        from scheduler_plugins.devtools.bench.pyprofile import environment

        # Inherited by the processes the cluster and stack spawn.
        os.environ.update(environment(work_dir, args.output_dir / f"{args.name}-profiles"))
    opts = BenchOptions(
        nodes=args.nodes,
        pods=args.pods,
        pods_per_node=args.pods_per_node,
        seed=args.seed,
        mix=Mix.parse(args.mix) if args.mix else DEFAULT_MIX,
        replicas=args.replicas,
        profile=load_profile(args.profile) if args.profile else None,
        schedulers=tuple(SchedulerKind(s) for s in args.schedulers),
        node_concurrency=not args.no_node_concurrency,
        audit=not args.no_audit,
        drain_share=args.drain,
        churn_fraction=args.churn,
        create_workers=args.create_workers,
        rate=args.rate,
        settle_s=args.settle,
        scenario_timeout_s=args.timeout,
        work_dir=work_dir,
        progress=not args.quiet,
        webhook=args.webhook,
        node_policy=Policy(args.node_policy) if args.node_policy else None,
    )

    def save(result: Json) -> None:
        write_report(result, args.output_dir, args.name, with_plots=False)

    result = run(opts, on_phase=save)
    paths = write_report(result, args.output_dir, args.name, with_plots=not args.no_plots)
    for path in paths:
        print(path)
    failed = [
        f"{run['nodes']} nodes: {phase['check']['summary']}"
        for run in result["runs"]
        for phase in run["phases"].values()
        if phase.get("check") and not phase["check"]["ok"]
    ]
    for line in failed:
        print(f"invariant check failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def _state_only(args: argparse.Namespace) -> int:
    import json

    from scheduler_plugins.devtools.bench.statemem import measure_in_subprocess

    rows = []
    for nodes in args.nodes:
        pods = args.pods if args.pods is not None else args.pods_per_node * nodes
        row = measure_in_subprocess(nodes, pods, seed=args.seed, timeout_s=args.timeout)
        rows.append(row)
        decision = row["decision_ms"] or {}
        print(
            f"{nodes} nodes, {row['placed']} of {pods} pods placed: plugin-server state RSS "
            f"{row['rss_mib_loaded']} MiB (peak {row['peak_rss_mib']}, empty "
            f"{row['rss_mib_empty']}); decision p50 {decision.get('p50_ms')} ms, p99 "
            f"{decision.get('p99_ms')} ms"
        )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"{args.name}-state.json"
    path.write_text(json.dumps({"seed": args.seed, "runs": rows}, indent=1) + "\n")
    print(path)
    return 0
