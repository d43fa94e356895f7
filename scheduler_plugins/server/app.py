"""``PluginServer``: watches + cache + servicer, served over gRPC on a Unix socket or TCP.

The socket lives in a directory only the server's user can enter (created 0700) and is
itself 0600; a stale socket from an earlier run is replaced, anything else at that path is
refused. TCP is for development and listens on loopback only unless told otherwise. The
server answers from its first moment (UNAVAILABLE until the state is rebuilt from the API)
so the shim sees a clear status instead of a refused connection.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog

from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.config import DeviceConfig
from scheduler_plugins.errors import InvalidInputError
from scheduler_plugins.kube.client import Obj
from scheduler_plugins.server.cache import ClusterCache
from scheduler_plugins.server.events import EventRecorder
from scheduler_plugins.server.servicer import SchedulerServicer
from scheduler_plugins.server.watch import DEFAULT_BACKOFF, Backoff, Watches, WatchStream

log = structlog.get_logger("tessera.plugin_server")


class ServerKube(Protocol):
    """The ``KubeClient`` calls the plugin server makes."""

    def list(self, path: str) -> Obj: ...

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> WatchStream: ...

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


class PluginServer:
    """Exactly one of ``socket_path`` and ``tcp_address`` (``HOST:PORT``; port 0 picks one)."""

    def __init__(
        self,
        kube: ServerKube,
        config: DeviceConfig,
        *,
        socket_path: Path | None = None,
        tcp_address: str | None = None,
        allow_remote: bool = False,
        prebind_wait_s: float = 30.0,
        watch_timeout_s: int = 60,
        event_interval_s: float = 60.0,
        workers: int = 128,
        backoff: Backoff = DEFAULT_BACKOFF,
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
        self.socket_path = socket_path
        self.tcp_address = tcp_address
        self.address = ""  # what the shim dials, set by start()
        self.cache = ClusterCache(config)
        self.watches = Watches(kube, self.cache, watch_timeout_s=watch_timeout_s, backoff=backoff)
        self.events = EventRecorder(kube, min_interval_s=event_interval_s)
        self.servicer = SchedulerServicer(
            self.cache,
            kube,
            self.watches.ready,
            events=self.events,
            prebind_wait_s=prebind_wait_s,
            # Parked PreBinds only wait on a condition; keep some workers for PreFilter & co.
            max_prebind_waiters=max(1, workers - 16),
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
            server.add_insecure_port(target)
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
        self.events.start()
        self.watches.start()
        server.start()
        if self.socket_path is not None:
            os.chmod(self.socket_path, 0o600)
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
        self.watches.stop()
        self.events.stop()
        if self.socket_path is not None and _is_socket(self.socket_path):
            self.socket_path.unlink()
        log.info("plugin server stopped")

    def __enter__(self) -> PluginServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _prepare_socket(path: Path) -> None:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
        if path.exists() or path.is_symlink():
            if not _is_socket(path):
                raise ServerAddressError(
                    f"{path} exists and is not a socket; remove it or choose another path"
                )
            if _listening(path):
                raise ServerAddressError(
                    f"{path}: another server is listening there; stop it or choose another path"
                )
            path.unlink()  # stale: left by a server that did not stop cleanly


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False
