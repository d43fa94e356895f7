"""``tessera plugin-server``: run the plugin server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from types import FrameType

import structlog

from api.hami.config import DeviceConfig, load_config_file
from api.kube.client import KubeClient
from scheduler_plugins.core.reservations import DEFAULT_PREBIND_WAIT_S
from scheduler_plugins.logs import add_logging_flags
from scheduler_plugins.server.app import DEFAULT_RPC_WORKERS, MIN_RPC_WORKERS

log = structlog.get_logger("tessera.plugin_server")

IN_CLUSTER = "in-cluster"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9395"  # HAMi's scheduler metrics port
USER_AGENT = "tessera-plugin-server"  # how the apiserver's audit log names this client


def add_plugin_server_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``plugin-server`` on an ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "plugin-server", help="the gRPC plugin server the kube-scheduler shim calls"
    )
    p.add_argument(
        "--kubeconfig",
        required=True,
        metavar="PATH|in-cluster",
        help=f"kubeconfig file, or {IN_CLUSTER!r} for the pod's service account",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", metavar="PATH", help="serve on this Unix socket")
    where.add_argument("--address", metavar="HOST:PORT", help="serve on TCP (development)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --address or --metrics-address",
    )
    p.add_argument(
        "--metrics-address",
        default=DEFAULT_METRICS_ADDRESS,
        metavar="HOST:PORT",
        help=f"serve Prometheus metrics at http://HOST:PORT/metrics (default "
        f"{DEFAULT_METRICS_ADDRESS}; '' serves none)",
    )
    p.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    p.add_argument(
        "--prebind-wait",
        type=float,
        default=DEFAULT_PREBIND_WAIT_S,
        metavar="SECONDS",
        help="longest PreBind waits for an ambiguous allocating pod on the node",
    )
    p.add_argument(
        "--watch-timeout", type=int, default=60, metavar="SECONDS", help="seconds per watch request"
    )
    p.add_argument(
        "--rpc-workers",
        type=_rpc_workers,
        default=DEFAULT_RPC_WORKERS,
        metavar="N",
        help="gRPC worker threads; PreBinds waiting for an earlier pod on their node hold one "
        "each, so a queue drain of thousands of pods wants hundreds (default "
        f"{DEFAULT_RPC_WORKERS}; the pod's pids limit must allow them)",
    )
    add_logging_flags(p)
    p.set_defaults(func=_cmd_plugin_server)
    return p


def _rpc_workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < MIN_RPC_WORKERS:
        raise argparse.ArgumentTypeError(
            f"{n} is too few: at least {MIN_RPC_WORKERS} (16 stay for PreFilter and the other "
            "calls while PreBinds wait)"
        )
    return n


def _client(kubeconfig: str) -> KubeClient:
    if kubeconfig == IN_CLUSTER:
        return KubeClient.in_cluster(user_agent=USER_AGENT)
    return KubeClient.from_kubeconfig(Path(kubeconfig), user_agent=USER_AGENT)


def _cmd_plugin_server(args: argparse.Namespace) -> int:
    from scheduler_plugins.server.app import PluginServer
    from scheduler_plugins.server.gcpolicy import OldObjectsFrozen
    from scheduler_plugins.server.malloc import tune_allocator
    from scheduler_plugins.server.tracing import Tracing

    # Decisions allocate large numpy temporaries; keep glibc from trimming and refaulting.
    log.info("malloc.tuned", result=tune_allocator())
    config = load_config_file(args.config) if args.config else DeviceConfig()
    tracing = Tracing.from_env()
    log.info("tracing configured", enabled=tracing.enabled)
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with (
        tracing,  # on exit, exports the spans still queued
        _client(args.kubeconfig) as kube,
        PluginServer(
            kube,
            config,
            socket_path=Path(args.socket) if args.socket else None,
            tcp_address=args.address,
            allow_remote=args.allow_remote,
            prebind_wait_s=args.prebind_wait,
            watch_timeout_s=args.watch_timeout,
            workers=args.rpc_workers,
            tracing=tracing,
            metrics_address=args.metrics_address or None,
        ) as server,
    ):
        # Full GC collections walk only what is new since the state was built (see gcpolicy).
        frozen = OldObjectsFrozen(server.ready.is_set)
        while not done.wait(1.0):
            frozen.tick()
        log.info("stopping", address=server.address)
    return 0
