"""``tessera cluster up|down|status|add-nodes``: argparse wiring for the dev cluster.

:func:`add_cluster_commands` registers the ``cluster`` command on the caller's subparsers.
Each leaf sets ``func``: ``args.func(args)`` returns the exit code and raises
:class:`scheduler_plugins.devtools.cluster.errors.ClusterError` (a ``TesseraError``) or
``ProfileError`` (an ``InvalidInputError``) on failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.layout import ClusterSettings, default_cache_dir, repo_root
from scheduler_plugins.devtools.cluster.nodes import (
    DEFAULT_WORKERS,
    NodeProfile,
    add_nodes,
    load_profile,
    wait_ready,
)


def add_cluster_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``cluster`` with its sub-commands on an ``add_subparsers()`` object."""
    cluster = subparsers.add_parser(
        "cluster",
        help="local dev cluster: etcd + kube-apiserver + kwok fake GPU nodes",
        description="Run a local Kubernetes control plane with kwok fake GPU nodes "
        "(binaries from `make tools`).",
    )
    sub = cluster.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", help="start the cluster (idempotent) and print its kubeconfig")
    _common(up)
    up.add_argument("--etcd-port", type=int, help="etcd client port (default 2379)")
    up.add_argument("--etcd-peer-port", type=int, help="etcd peer port (default etcd port + 1)")
    up.add_argument("--apiserver-port", type=int, help="kube-apiserver port (default 6443)")
    up.add_argument("--kwok-port", type=int, help="kwok controller health port (default 10247)")
    up.add_argument("--bin-dir", type=Path, help="binaries (default CACHE_DIR/bin)")
    up.add_argument("--etcd-fsync", action="store_true", help="etcd fsyncs (slower)")
    up.add_argument("--build", action="store_true", help="run hack/build-tools.sh first")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds per component")
    up.add_argument("--nodes", type=int, default=0, help="add this many fake GPU nodes")
    up.add_argument("--profile", type=Path, help="node profile YAML for --nodes")
    up.set_defaults(func=logged(_cmd_up))

    down = sub.add_parser("down", help="stop every process of the cluster (also after a crash)")
    _common(down)
    down.add_argument("--purge", action="store_true", help="also delete its state dir (etcd data)")
    down.set_defaults(func=logged(_cmd_down))

    status = sub.add_parser("status", help="show what runs; exit 1 unless all is healthy")
    _common(status)
    status.set_defaults(func=logged(_cmd_status))

    add = sub.add_parser("add-nodes", help="create kwok fake GPU nodes from a profile")
    _common(add)
    add.add_argument("-n", "--count", type=int, required=True, help="number of nodes")
    add.add_argument("--profile", type=Path, help="node profile YAML (default: 8× A100-40GB)")
    add.add_argument("--start-index", type=int, help="first node number (default: after the last)")
    add.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel requests")
    add.add_argument("--no-wait", action="store_true", help="don't wait for Ready")
    add.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for Ready")
    add.set_defaults(func=logged(_cmd_add_nodes))
    return cluster


def logged(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Send structlog output to stderr (unless the app configured it): stdout is the answer."""

    def run(args: argparse.Namespace) -> int:
        if not structlog.is_configured():
            structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
        return cmd(args)

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="tessera", help="cluster name (default tessera)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache dir (default $TESSERA_CACHE or ~/.cache/tessera)",
    )
    p.add_argument("--state-dir", type=Path, help="state dir (default CACHE_DIR/cluster/NAME)")


def _settings(args: argparse.Namespace) -> ClusterSettings:
    base = ClusterSettings(
        name=args.name,
        cache_dir=args.cache_dir or default_cache_dir(),
        state_dir_override=args.state_dir,
    )
    return base.saved_or_self()


def _cmd_up(args: argparse.Namespace) -> int:
    settings = _settings(args)
    overrides = {
        key: value
        for key, value in (
            ("etcd_port", args.etcd_port),
            ("etcd_peer_port", args.etcd_peer_port),
            ("apiserver_port", args.apiserver_port),
            ("kwok_port", args.kwok_port),
            ("bin_dir_override", args.bin_dir),
        )
        if value is not None
    }
    if args.etcd_port is not None and args.etcd_peer_port is None:
        overrides["etcd_peer_port"] = args.etcd_port + 1
    settings = dataclasses.replace(settings, etcd_fsync=args.etcd_fsync, **overrides)
    if args.profile and not args.nodes:
        raise ClusterError("--profile needs --nodes N")
    profile = load_profile(args.profile) if args.profile else NodeProfile()
    if args.build:
        _build_tools(settings)
    t0 = time.monotonic()
    cluster = Cluster(settings)
    info = cluster.up(timeout_s=args.timeout)
    print(f"cluster {info.name} is up in {time.monotonic() - t0:.1f}s: {info.server}")
    if args.nodes:
        with info.api() as api:
            names = add_nodes(api, profile, args.nodes, progress=True)
            waited = wait_ready(api, names, progress=True)
        print(f"added {len(names)} nodes, Ready after {waited:.1f}s")
    print(f"kubeconfig: {info.kubeconfig}")
    print(f"  export KUBECONFIG={info.kubeconfig}; {settings.binary('kubectl')} get nodes")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    settings = _settings(args)
    stopped = Cluster(settings).down(purge=args.purge)
    what = ", ".join(stopped) if stopped else "nothing was running"
    print(f"cluster {settings.name} down: {what}{' (state purged)' if args.purge else ''}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    states = Cluster(settings).status()
    print(f"cluster {settings.name} ({settings.state_dir})")
    for st in states:
        print(st.line(15))
    if all(st.healthy for st in states):
        print(f"  server {settings.apiserver_url}  kubeconfig {settings.kubeconfig}")
        return 0
    return 1


def _cmd_add_nodes(args: argparse.Namespace) -> int:
    settings = _settings(args)
    profile = load_profile(args.profile) if args.profile else NodeProfile()
    info = Cluster(settings).info()
    t0 = time.monotonic()
    with info.api() as api:
        names = add_nodes(
            api,
            profile,
            args.count,
            start_index=args.start_index,
            workers=args.workers,
            progress=True,
        )
        created = time.monotonic() - t0
        if args.no_wait:
            print(f"created {len(names)} nodes in {created:.1f}s")
            return 0
        waited = wait_ready(api, names, timeout_s=args.timeout, progress=True)
    print(f"created {len(names)} nodes in {created:.1f}s; all Ready {waited:.1f}s later")
    return 0


def _build_tools(settings: ClusterSettings) -> None:
    script = repo_root() / "hack" / "build-tools.sh"
    env_cache = {"TESSERA_CACHE": str(settings.cache_dir)}
    proc = subprocess.run(["bash", str(script)], env={**os.environ, **env_cache}, check=False)
    if proc.returncode != 0:
        raise ClusterError(f"{script} failed (exit {proc.returncode}); see its output above")
