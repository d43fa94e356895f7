"""The kubelet device plugin server: gRPC servicer, Unix socket and kubelet registration.

The servicer only translates messages: devices come from an injected ``DeviceInventory``,
Allocate and PreStartContainer go to an injected ``AllocateHandler``, the preferred
allocation to a pure policy (``ids.prefer_spread`` by default). ``DevicePluginServer`` owns
the socket ``plugin_dir/socket_name`` and the registration with ``plugin_dir/kubelet.sock``.

A restarting kubelet deletes every socket in the plugin dir and recreates ``kubelet.sock``;
a watcher thread polls for both and serves again on a fresh socket and/or registers again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

import grpc
import structlog

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from api.errors import InvalidInputError, TemporaryError, TesseraError
from api.sockets import claim_socket_path, ensure_private_dir, restrict_socket, rpc_failure
from node_agent.deviceplugin.ids import InvalidDeviceIdError, gpu_of, prefer_spread
from node_agent.deviceplugin.types import (
    AllocateHandler,
    ContainerAllocation,
    DeviceInventory,
    PluginDevice,
)

log = structlog.get_logger(__name__)

API_VERSION: Final = "v1beta1"
DEFAULT_PLUGIN_DIR: Final = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET: Final = "kubelet.sock"
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"

_T = TypeVar("_T")

PreferredPolicy = Callable[[Sequence[str], Sequence[str], int], Sequence[str]]
"""``(available, must_include, size) -> preferred ids`` for one container."""

# The generated gRPC module is untyped; bind its entry points to typed names once.
_add_servicer: Callable[[api_pb2_grpc.DevicePluginServicer, grpc.Server], None] = (
    api_pb2_grpc.add_DevicePluginServicer_to_server
)
_REGISTER: Final = "/v1beta1.Registration/Register"

# (st_dev, st_ino, st_ctime_ns): a recreated file differs even if the inode number is reused.
_FileIdentity = tuple[int, int, int]


def _identity(path: Path) -> _FileIdentity | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _status_for(err: TesseraError) -> grpc.StatusCode:
    if isinstance(err, InvalidInputError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, TemporaryError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION


def _to_proto_device(d: PluginDevice) -> api_pb2.Device:
    topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]) if d.numa >= 0 else None
    return api_pb2.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY, topology=topology)


def _to_proto_allocation(a: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=dict(a.envs),
        mounts=[
            api_pb2.Mount(
                container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
            )
            for m in a.mounts
        ],
        devices=[
            api_pb2.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in a.devices
        ],
        annotations=dict(a.annotations),
    )


# As HAMi's device plugin: the kubelet asks for a preferred allocation (the allocating pod's
# GPUs), and never calls PreStartContainer, which the agent has nothing to do in (requiring it
# would also block a GPU container's restart while the agent is down).
_OPTIONS: Final = api_pb2.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
)


class _Servicer(api_pb2_grpc.DevicePluginServicer):
    """Translates DevicePlugin RPCs to the injected inventory, handler and policy."""

    def __init__(
        self,
        resource_name: str,
        inventory: DeviceInventory,
        handler: AllocateHandler,
        preferred: PreferredPolicy,
        stopping: threading.Event,
        poll_s: float,
    ) -> None:
        self._resource = resource_name
        self._inventory = inventory
        self._handler = handler
        self._preferred = preferred
        self._stopping = stopping
        self._poll_s = poll_s

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return _OPTIONS

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        # Read the version before the list: a change in between is sent twice, never missed.
        version = self._inventory.version()
        while True:
            devices = self._inventory.devices()
            log.info(
                "deviceplugin.list_and_watch.send",
                resource=self._resource,
                version=version,
                devices=len(devices),
                unhealthy=sum(not d.healthy for d in devices),
            )
            yield api_pb2.ListAndWatchResponse(devices=[_to_proto_device(d) for d in devices])
            while True:
                if self._stopping.is_set() or not context.is_active():
                    return
                current = self._inventory.wait_changed(version, self._poll_s)
                if current != version:
                    version = current
                    break

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        requests = [
            (list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size)
            for r in request.container_requests
        ]
        chosen = self._guarded(
            context, "preferred_allocation", lambda: [self._preferred(*r) for r in requests]
        )
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=list(ids)) for ids in chosen
            ]
        )

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        containers = [list(c.devices_ids) for c in request.container_requests]
        allocations = self._guarded(context, "allocate", lambda: self._allocate(containers))
        if len(allocations) != len(containers):
            log.error(
                "deviceplugin.allocate.bad_handler_answer",
                resource=self._resource,
                containers=len(containers),
                allocations=len(allocations),
            )
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"allocate: handler answered {len(allocations)} allocations for "
                f"{len(containers)} container requests",
            )
        return api_pb2.AllocateResponse(
            container_responses=[_to_proto_allocation(a) for a in allocations]
        )

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        ids = list(request.devices_ids)
        self._guarded(context, "pre_start", lambda: self._pre_start(ids))
        return api_pb2.PreStartContainerResponse()

    def _allocate(self, containers: Sequence[Sequence[str]]) -> Sequence[ContainerAllocation]:
        self._check_advertised([i for ids in containers for i in ids])
        return self._handler.allocate(containers)

    def _pre_start(self, ids: Sequence[str]) -> None:
        self._check_advertised(ids)
        self._handler.pre_start(ids)

    def _check_advertised(self, ids: Sequence[str]) -> None:
        advertised = {d.id for d in self._inventory.devices()}
        for device_id in ids:
            gpu_of(device_id)
            if device_id not in advertised:
                raise InvalidDeviceIdError(
                    device_id, f"not a device this plugin advertises for {self._resource}"
                )

    def _guarded(self, context: grpc.ServicerContext, rpc: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except TesseraError as e:
            log.warning("deviceplugin.rpc_failed", resource=self._resource, rpc=rpc, error=str(e))
            context.abort(_status_for(e), str(e))
        except Exception as e:
            log.exception("deviceplugin.rpc_crashed", resource=self._resource, rpc=rpc)
            context.abort(
                grpc.StatusCode.INTERNAL, f"{rpc}: internal error: {type(e).__name__}: {e}"
            )


@dataclass
class _Serving:
    """One serving generation: a gRPC server bound to a fresh socket."""

    server: grpc.Server
    executor: ThreadPoolExecutor
    stopping: threading.Event
    socket: _FileIdentity | None = field(default=None)


class DevicePluginServer:
    """Serves one extended resource to the kubelet and keeps it registered.

    ``start`` binds ``plugin_dir/socket_name`` (mode 0600, a stale socket removed first) and
    registers with the kubelet; it raises ``TemporaryError`` when the kubelet can't be
    reached (nothing is left running then), and ``UnsafeSocketPathError`` when the plugin dir
    is writable by others or the socket path holds a live socket, a symlink or another file.
    Afterwards a watcher thread serves again when our socket disappears and registers again
    whenever ``kubelet.sock`` is recreated. ``stop`` ends the streams, the server and the
    watcher and removes our socket; it is idempotent.
    """

    def __init__(
        self,
        resource_name: str,
        plugin_dir: str | os.PathLike[str],
        socket_name: str,
        inventory: DeviceInventory,
        handler: AllocateHandler,
        *,
        preferred: PreferredPolicy = prefer_spread,
        watch_interval_s: float = 1.0,
        register_timeout_s: float = 5.0,
        stream_poll_s: float = 0.1,
        max_workers: int = 8,
    ) -> None:
        if not resource_name or "/" not in resource_name:
            raise InvalidInputError(
                f"resource name {resource_name!r}: expected <domain>/<name>, e.g. nvidia.com/gpu"
            )
        if not socket_name or "/" in socket_name or socket_name == KUBELET_SOCKET:
            raise InvalidInputError(
                f"socket name {socket_name!r}: must be a plain file name other than "
                f"{KUBELET_SOCKET}"
            )
        self.resource_name = resource_name
        self.plugin_dir = Path(plugin_dir)
        self.socket_name = socket_name
        self.socket_path = self.plugin_dir / socket_name
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self._inventory = inventory
        self._handler = handler
        self._preferred = preferred
        self._watch_interval_s = watch_interval_s
        self._register_timeout_s = register_timeout_s
        self._stream_poll_s = stream_poll_s
        self._max_workers = max_workers

        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._serving: _Serving | None = None
        self._watcher: threading.Thread | None = None
        self._registered_with: _FileIdentity | None = None
        self._registrations = 0

    @property
    def registrations(self) -> int:
        """How many times this server registered successfully (1 + re-registrations)."""
        return self._registrations

    def start(self) -> None:
        with self._lock:
            if self._watcher is not None:
                raise RuntimeError(f"device plugin {self.resource_name} is already started")
            self._stop.clear()
            self._serve()
            try:
                self._register()
            except BaseException:
                self._stop_serving()
                raise
            self._watcher = threading.Thread(
                target=self._watch, name=f"deviceplugin-watch-{self.socket_name}", daemon=True
            )
            self._watcher.start()

    def stop(self, grace_s: float = 1.0) -> None:
        with self._lock:
            self._stop.set()
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.join()
        with self._lock:
            self._stop_serving(grace_s)
            self._registered_with = None

    def __enter__(self) -> DevicePluginServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self._watch_interval_s):
            try:
                with self._lock:
                    if not self._stop.is_set():
                        self._reconcile()
            except Exception:
                # The watcher must outlive any single failure, or the plugin silently
                # vanishes at the next kubelet restart.
                log.exception("deviceplugin.watch_failed", resource=self.resource_name)

    def _reconcile(self) -> None:
        serving = self._serving
        if serving is None or _identity(self.socket_path) != serving.socket:
            log.info(
                "deviceplugin.socket_lost",
                resource=self.resource_name,
                socket=str(self.socket_path),
            )
            self._stop_serving()
            self._serve()
            self._registered_with = None
        kubelet = _identity(self.kubelet_socket)
        if kubelet is None:
            # Kubelet down: whatever socket it creates next is a new kubelet, even if the
            # file system hands it the same inode and timestamp.
            self._registered_with = None
        elif kubelet != self._registered_with:
            try:
                self._register()
            except TemporaryError as e:
                log.warning(
                    "deviceplugin.register_failed", resource=self.resource_name, error=str(e)
                )

    def _serve(self) -> None:
        # The kubelet owns its plugin dir (root, 0750/0755): others may enter, never write.
        ensure_private_dir(self.plugin_dir, root_may_own=True, others_may_enter=True)
        claim_socket_path(self.socket_path)
        stopping = threading.Event()
        executor = ThreadPoolExecutor(
            max_workers=self._max_workers, thread_name_prefix=f"deviceplugin-{self.socket_name}"
        )
        server = grpc.server(executor)
        servicer = _Servicer(
            self.resource_name,
            self._inventory,
            self._handler,
            self._preferred,
            stopping,
            self._stream_poll_s,
        )
        _add_servicer(servicer, server)
        serving = _Serving(server, executor, stopping)
        try:
            if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
                raise TemporaryError(f"device plugin: cannot bind {self.socket_path}")
            restrict_socket(self.socket_path)
            server.start()
            serving.socket = _identity(self.socket_path)
        except BaseException:
            self._shutdown(serving, 0)
            raise
        self._serving = serving
        log.info("deviceplugin.serving", resource=self.resource_name, socket=str(self.socket_path))

    def _register(self) -> None:
        kubelet = _identity(self.kubelet_socket)
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_name,
            resource_name=self.resource_name,
            options=_OPTIONS,
        )
        with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            register = channel.unary_unary(
                _REGISTER,
                request_serializer=api_pb2.RegisterRequest.SerializeToString,
                response_deserializer=api_pb2.Empty.FromString,
            )
            try:
                register(request, timeout=self._register_timeout_s, wait_for_ready=False)
            except grpc.RpcError as e:
                detail = rpc_failure(e)
                raise TemporaryError(
                    f"register {self.resource_name} with the kubelet at {self.kubelet_socket}: "
                    f"{detail}; is the kubelet running?"
                ) from e
        self._registered_with = kubelet
        self._registrations += 1
        log.info(
            "deviceplugin.registered",
            resource=self.resource_name,
            endpoint=self.socket_name,
            registrations=self._registrations,
        )

    def _stop_serving(self, grace_s: float = 1.0) -> None:
        serving, self._serving = self._serving, None
        if serving is None:
            return
        self._shutdown(serving, grace_s)
        # Only remove the socket we bound: after a kubelet restart the path may be gone, or
        # (misconfiguration) belong to another process.
        if serving.socket is not None and _identity(self.socket_path) == serving.socket:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    @staticmethod
    def _shutdown(serving: _Serving, grace_s: float) -> None:
        serving.stopping.set()
        serving.server.stop(grace_s).wait()
        serving.executor.shutdown(wait=True)
