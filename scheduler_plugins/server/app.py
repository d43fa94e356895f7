"""``PluginServer``: watches + cache + servicer, served over gRPC on a Unix socket or TCP.

The socket lives in a directory only the server's user can reach (created 0700; an existing
one that others may reach is refused) and is itself 0600; a stale socket from an earlier run
is replaced, anything else at that path (a live socket, a symlink, a file) is refused. TCP
is for development and listens on loopback only unless told otherwise. The server answers
from its first moment (UNAVAILABLE until the state is rebuilt from the API) so the shim sees
a clear status instead of a refused connection.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog

from api.errors import InvalidInputError
from api.hami.config import DeviceConfig
from api.kube.client import Obj
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from api.sockets import (
    UnsafeSocketPathError,
    claim_socket_path,
    ensure_private_dir,
    is_socket,
    restrict_socket,
)
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.reservations import DEFAULT_PREBIND_WAIT_S
from scheduler_plugins.server.events import EventRecorder, EventTarget, PreemptionReporter
from scheduler_plugins.server.gangs import GangReporter
from scheduler_plugins.server.metrics import MetricsAddressError, MetricsServer, server_metrics
from scheduler_plugins.server.servicer import SchedulerServicer
from scheduler_plugins.server.tracing import Tracing
from scheduler_plugins.server.watch import DEFAULT_BACKOFF, Backoff, Watches, WatchStream

# RPC worker threads: waiting PreBinds park on one each (~16 KiB resident); 16 stay for the
# other calls. The pod's pids limit must allow this many threads.
DEFAULT_RPC_WORKERS = 2048
MIN_RPC_WORKERS = 32

log = structlog.get_logger("tessera.plugin_server")


class ServerKube(Protocol):
    """The ``KubeClient`` calls the plugin server makes."""

    def list(self, path: str) -> Obj: ...

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> WatchStream: ...

    def get(self, path: str) -> Any: ...

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any: ...

    def post(self, path: str, body: object) -> Any: ...


class ServerAddressError(InvalidInputError):
    """The socket path or TCP address cannot be served on; the message says what to change."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _metrics_listen(address: str, allow_remote: bool) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ServerAddressError(
            f"metrics address must be HOST:PORT (port 0-65535; '' serves no metrics), "
            f"got {address!r}"
        )
    if not allow_remote and not _loopback(host):
        raise ServerAddressError(
            f"metrics address {address!r} is not loopback; allow remote explicitly to serve "
            "cluster GPU usage beyond this machine"
        )
    return host, int(port)


class PluginServer:
    """Exactly one of ``socket_path`` and ``tcp_address`` (``HOST:PORT``; port 0 picks one).
    ``metrics_address`` (``HOST:PORT``; port 0 picks one) serves ``/metrics`` over HTTP, by
    the same loopback rule; None serves none."""

    def __init__(
        self,
        kube: ServerKube,
        config: DeviceConfig,
        *,
        socket_path: Path | None = None,
        tcp_address: str | None = None,
        allow_remote: bool = False,
        prebind_wait_s: float = DEFAULT_PREBIND_WAIT_S,
        watch_timeout_s: int = 60,
        event_interval_s: float = 60.0,
        workers: int = DEFAULT_RPC_WORKERS,
        backoff: Backoff = DEFAULT_BACKOFF,
        tracing: Tracing | None = None,
        metrics_address: str | None = None,
    ) -> None:
        if (socket_path is None) == (tcp_address is None):
            raise ServerAddressError("give exactly one of a socket path and a TCP address")
        if tcp_address is not None:
            host, sep, port = tcp_address.rpartition(":")
            if not sep or not port.isdigit():
                raise ServerAddressError(f"TCP address must be HOST:PORT, got {tcp_address!r}")
            if not allow_remote and not _loopback(host):
                raise ServerAddressError(
                    f"TCP address {tcp_address!r} is not loopback; the protocol has no "
                    "authentication (use a Unix socket, or allow remote explicitly)"
                )
        metrics_listen = _metrics_listen(metrics_address, allow_remote) if metrics_address else None
        self.socket_path = socket_path
        self.tcp_address = tcp_address
        self.address = ""  # what the shim dials, set by start()
        self.cache = ClusterCache(config, clock=time.monotonic)
        self.metrics_registry, metrics = server_metrics(self.cache.state, self.cache.lock)
        self._metrics_server = (
            MetricsServer(self.metrics_registry, *metrics_listen) if metrics_listen else None
        )
        self.metrics_address = ""  # HOST:PORT serving /metrics, set by start()
        self.watches = Watches(kube, self.cache, watch_timeout_s=watch_timeout_s, backoff=backoff)
        self.events = EventRecorder(kube, min_interval_s=event_interval_s)
        self.cache.on_legacy_mig(
            lambda pod, alloc: self.events.legacy_mig(EventTarget.of(pod), alloc)
        )
        self.preemptions = PreemptionReporter(self.cache, self.events, metrics)
        self.gangs = GangReporter(
            kube, self.events, metrics, watch_timeout_s=watch_timeout_s, backoff=backoff
        )
        self.servicer = SchedulerServicer(
            self.cache,
            kube,
            self.watches.ready,
            events=self.events,
            prebind_wait_s=prebind_wait_s,
            # Parked PreBinds only wait on their node's condition (a thread each, ~16 KiB
            # resident); keep some workers for PreFilter & co. A 1000-node queue drain
            # parks over 500 at peaks: with 512 workers the shim was told "ask again" 2.5
            # times per pod, each a full RPC (plugin server CPU per pod 6.0-6.3 ms against
            # 4.5-4.7 with 2048, drain 81-82 against 92-93 pods/s, two runs each).
            max_prebind_waiters=max(1, workers - 16),
            tracing=tracing,
            metrics=metrics,
            gangs=self.gangs,
        )
        self._workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._server: grpc.Server | None = None
        self._stopped = threading.Event()

    @property
    def ready(self) -> threading.Event:
        return self.watches.ready

    def start(self) -> None:
        if self.socket_path is not None:
            self._prepare_socket(self.socket_path)
        self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="plugin-rpc")
        server = grpc.server(self._executor)
        self._server = server
        pb_grpc.add_SchedulerServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
        if self.socket_path is not None:
            target = f"unix:{self.socket_path}"
            try:
                bound = server.add_insecure_port(target)
            except RuntimeError as e:
                bound, error = 0, f": {e}"
            else:
                error = ""
            if not bound:
                self.stop()
                raise ServerAddressError(f"cannot listen on {target}{error}")
            restrict_socket(self.socket_path)  # before serving; the directory is private too
            self.address = target
        else:
            assert self.tcp_address is not None
            try:
                port = server.add_insecure_port(self.tcp_address)
            except RuntimeError as e:
                self.stop()
                raise ServerAddressError(f"cannot listen on {self.tcp_address}: {e}") from e
            host = self.tcp_address.rpartition(":")[0]
            self.address = f"{host}:{port}"
        if self._metrics_server is not None:
            try:
                self._metrics_server.start()
            except MetricsAddressError:
                self.stop()
                raise
            self.metrics_address = self._metrics_server.address
        self.events.start()
        self.preemptions.start()
        self.watches.start()
        self.gangs.start()
        server.start()
        log.info("plugin server listening", address=self.address)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self.watches.wait_ready(timeout_s)

    def stop(self, grace_s: float = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace_s).wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self.watches.stop()
        self.gangs.stop()
        self.preemptions.stop()
        self.events.stop()
        if self.socket_path is not None and is_socket(self.socket_path):
            self.socket_path.unlink()
        log.info("plugin server stopped")

    def __enter__(self) -> PluginServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _prepare_socket(path: Path) -> None:
        try:
            ensure_private_dir(path.parent)
            claim_socket_path(path)
        except UnsafeSocketPathError as e:
            raise ServerAddressError(str(e)) from e
