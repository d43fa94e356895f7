"""Tessera's own processes on a dev cluster: plugin server, scheduler, kwok node agent.

They run like the cluster's components (process group, pid file, log under the cluster's
state dir) and ``tessera cluster down`` stops them too. The scheduler is the
``tessera-scheduler`` binary built from ``sidecar-go/`` by ``make tools``; it talks to the
plugin server over a Unix socket in the cluster's run dir.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import structlog
import yaml

from api.plugin.v1 import plugin_pb2, plugin_pb2_grpc
from api.sockets import rpc_failure
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.jaeger import JAEGER, stop_jaeger
from scheduler_plugins.devtools.cluster.layout import (
    GANG_FEATURE_GATES,
    LOOPBACK,
    ClusterSettings,
    private_dir,
    repo_root,
)
from scheduler_plugins.devtools.cluster.webhook import WEBHOOK, start_webhook, stop_webhook

log = structlog.get_logger(__name__)

PLUGIN_SERVER: Final = "plugin-server"
SCHEDULER: Final = "tessera-scheduler"
NODE_AGENT: Final = "node-agent"
STACK: Final = (PLUGIN_SERVER, SCHEDULER, NODE_AGENT)  # start order
SCHEDULER_NAME: Final = "hami-scheduler"


@dataclass(frozen=True)
class StackPaths:
    socket: Path
    scheduler_config: Path
    agent_state: Path
    metrics_address: Path  # holds HOST:PORT of the plugin server's /metrics
    scheduler_address: Path  # holds HOST:PORT where tessera-scheduler serves (its /metrics)
    scheduler_certs: Path  # tessera-scheduler's self-signed serving certificate

    @staticmethod
    def of(s: ClusterSettings) -> StackPaths:
        return StackPaths(
            socket=s.run_dir / "tessera" / "plugin.sock",
            scheduler_config=s.state_dir / "scheduler-config.yaml",
            agent_state=s.memory_dir / "node-agent",
            metrics_address=s.state_dir / "plugin-server-metrics-address",
            scheduler_address=s.state_dir / "scheduler-address",
            scheduler_certs=s.state_dir / "scheduler-certs",
        )


def metrics_address(s: ClusterSettings) -> str:
    """``HOST:PORT`` where the cluster's plugin server serves ``/metrics``."""
    return _recorded(s, StackPaths.of(s).metrics_address)


def scheduler_metrics_url(s: ClusterSettings) -> str:
    """Where the cluster's tessera-scheduler serves kube-scheduler's own ``/metrics``."""
    return f"https://{_recorded(s, StackPaths.of(s).scheduler_address)}/metrics"


def _recorded(s: ClusterSettings, path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ClusterError(
            f"{path} is missing: the stack of cluster {s.name!r} never started"
        ) from None


def record_loopback_address(path: Path) -> str:
    """A free loopback port, recorded at ``path`` (several dev clusters run side by side, so
    not HAMi's 9395; a restarted plugin server keeps it, and so does a restarted stack while
    the port is still free: the URL `tessera up` printed stays true)."""
    with contextlib.suppress(OSError, ValueError):
        host, _, port = path.read_text().strip().rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, int(port)))
        return f"{host}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        address = f"{LOOPBACK}:{sock.getsockname()[1]}"
    path.write_text(address + "\n")
    return address


def scheduler_serving_args(address: str, cert_dir: Path) -> list[str]:
    """kube-scheduler's HTTPS serving on ``address`` (loopback), with a self-signed
    certificate in ``cert_dir`` and ``/metrics`` (scheduling latencies per extension point,
    no pod data) readable without credentials, like its health checks."""
    host, _, port = address.rpartition(":")
    return [
        "--bind-address",
        host,
        "--secure-port",
        port,
        "--cert-dir",
        str(cert_dir),
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
    ]


def start_stack(
    s: ClusterSettings,
    *,
    device_config: Path | None = None,
    timeout_s: float = 60.0,
    webhook: bool = True,
    tracing_env: Mapping[str, str] | None = None,
    tessera_args: Mapping[str, object] | None = None,
    webhook_args: Sequence[str] = (),
) -> StackPaths:
    """Start the three processes and wait until each is ready; stop all on failure.
    ``webhook``: then also Tessera's admission webhook (``devcluster.webhook``), with
    ``webhook_args``.
    ``tracing_env``: OTEL_* variables for the scheduler and the plugin server on top of the
    environment every component inherits (tracing is off unless OTEL_TRACES_EXPORTER is set).
    ``tessera_args``: Tessera plugin args replacing the example profile's (tests)."""
    paths = StackPaths.of(s)
    scheduler_bin = s.binary(SCHEDULER)
    if not scheduler_bin.is_file():
        raise ClusterError(f"{scheduler_bin} is missing: run `make tools` first")
    paths.socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    private_dir(s.memory_dir)
    paths.agent_state.mkdir(exist_ok=True)
    record_loopback_address(paths.metrics_address)
    record_loopback_address(paths.scheduler_address)
    _write_scheduler_config(paths.scheduler_config, s.kubeconfig, paths.socket, tessera_args)
    try:
        for component in STACK:
            _spawn_ready(
                s,
                paths,
                component,
                device_config=device_config,
                timeout_s=timeout_s,
                tracing_env=tracing_env,
            )
        if webhook:
            start_webhook(
                s,
                scheduler_name=SCHEDULER_NAME,
                device_config=device_config,
                timeout_s=timeout_s,
                extra_args=webhook_args,
            )
    except BaseException:
        stop_stack(s)
        raise
    return paths


def restart_component(
    s: ClusterSettings,
    component: str,
    *,
    device_config: Path | None = None,
    timeout_s: float = 60.0,
    kubeconfig: Path | None = None,
    tracing_env: Mapping[str, str] | None = None,
) -> None:
    """Stop one stack component (if it still runs; a stale pid file is fine) and start it
    again with the same command line as ``start_stack``, waiting until it is ready.
    ``kubeconfig`` replaces the cluster's for the plugin server or node agent (the fault
    tests route them through a proxy this way)."""
    if component not in STACK:
        raise ClusterError(f"unknown stack component {component!r}; one of {', '.join(STACK)}")
    if kubeconfig is not None and component == SCHEDULER:
        raise ClusterError(f"{SCHEDULER} reads its kubeconfig from its config file")
    processes.stop(s.pid_file(component))
    _spawn_ready(
        s,
        StackPaths.of(s),
        component,
        device_config=device_config,
        timeout_s=timeout_s,
        kubeconfig=kubeconfig,
        tracing_env=tracing_env,
    )


def _spawn_ready(
    s: ClusterSettings,
    paths: StackPaths,
    component: str,
    *,
    device_config: Path | None,
    timeout_s: float,
    kubeconfig: Path | None = None,
    tracing_env: Mapping[str, str] | None = None,
) -> None:
    t0 = time.monotonic()
    record = processes.spawn(
        component,
        _argv(s, paths, component, device_config, kubeconfig or s.kubeconfig),
        log_path=s.log_file(component),
        pid_path=s.pid_file(component),
        env=tracing_env if component in (SCHEDULER, PLUGIN_SERVER) else None,
    )
    processes.wait_ready(
        record, _probe(s, paths, component), log_path=s.log_file(component), timeout_s=timeout_s
    )
    log.info("stack.ready", component=component, seconds=round(time.monotonic() - t0, 2))


def _argv(
    s: ClusterSettings,
    paths: StackPaths,
    component: str,
    device_config: Path | None,
    kubeconfig: Path,
) -> list[str]:
    tessera = [sys.executable, "-m", "scheduler_plugins.cli"]
    config_args = ["--config", str(device_config)] if device_config else []
    if component == PLUGIN_SERVER:
        return [
            *tessera,
            "plugin-server",
            "--kubeconfig",
            str(kubeconfig),
            "--socket",
            str(paths.socket),
            "--metrics-address",
            metrics_address(s),
            *config_args,
        ]
    if component == SCHEDULER:
        return [
            str(s.binary(SCHEDULER)),
            "--config",
            str(paths.scheduler_config),
            *scheduler_serving_args(_recorded(s, paths.scheduler_address), paths.scheduler_certs),
            f"--feature-gates={GANG_FEATURE_GATES}",
            "-v",
            "2",
        ]
    return [
        *tessera,
        "node-agent",
        "kwok",
        "--kubeconfig",
        str(kubeconfig),
        "--state-dir",
        str(paths.agent_state),
    ]


def _probe(s: ClusterSettings, paths: StackPaths, component: str) -> Callable[[], str | None]:
    if component == PLUGIN_SERVER:
        return lambda: _probe_plugin_server(paths.socket)
    if component == SCHEDULER:
        return lambda: _probe_log(
            s.log_file(SCHEDULER),
            "Attempting to acquire leader lease",
            "Starting Kubernetes Scheduler",
        )
    return lambda: None


def stop_stack(s: ClusterSettings) -> list[str]:
    """Stop the webhook, the three processes and Jaeger (whichever run); what was stopped."""
    stopped: list[str] = [WEBHOOK] if stop_webhook(s) else []
    for component in reversed(STACK):
        if processes.stop(s.pid_file(component)) is not None:
            stopped.append(component)
    if stop_jaeger(s):
        stopped.append(JAEGER)
    return stopped


def probe(s: ClusterSettings, component: str) -> str | None:
    """None when a running stack component is healthy; else why not (``tessera status``)."""
    if component not in STACK:
        raise ClusterError(f"unknown stack component {component!r}; one of {', '.join(STACK)}")
    return _probe(s, StackPaths.of(s), component)()


def _write_scheduler_config(
    path: Path, kubeconfig: Path, socket: Path, tessera_args: Mapping[str, object] | None = None
) -> None:
    template = repo_root() / "examples" / "scheduler-config.yaml"
    cfg: dict[str, Any] = yaml.safe_load(template.read_text())
    cfg["clientConnection"]["kubeconfig"] = str(kubeconfig)
    for profile in cfg["profiles"]:
        for plugin in profile.get("pluginConfig", []):
            if plugin.get("name") == "Tessera":
                plugin["args"].update(tessera_args or {})
                plugin["args"]["socket"] = str(socket)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _probe_plugin_server(socket: Path) -> str | None:
    """None once the server answers (ready); else why not yet."""
    if not socket.exists():
        return "no socket yet"
    pod = {"metadata": {"name": "probe", "namespace": "default"}, "spec": {"containers": []}}
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = plugin_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.PreFilter(
                plugin_pb2.PreFilterRequest(
                    version=plugin_pb2.PROTOCOL_VERSION_1,
                    pod=plugin_pb2.PodRef(namespace="default", name="probe"),
                    pod_json=json.dumps(pod).encode(),
                ),
                timeout=2.0,
            )
        except grpc.RpcError as e:
            return rpc_failure(e)
    return None


def _probe_log(path: Path, *markers: str) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no log yet"
    return None if any(m in text for m in markers) else "not started yet"
