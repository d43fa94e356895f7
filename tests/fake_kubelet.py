"""A fake kubelet device manager speaking real gRPC over Unix sockets, for tests.

``FakeKubelet`` behaves like the kubelet's device manager: it serves Registration on
``kubelet.sock`` in a plugin dir, and on each Register connects back to the plugin's
endpoint, asks for its options and keeps a ListAndWatch stream open, queueing every device
list it receives. ``PluginConnection.preferred`` / ``allocate`` make the calls the kubelet
makes when it admits a container. A kubelet restart is modelled as the real one does it:
every socket in the dir is deleted, then a new ``kubelet.sock`` appears (a new
``FakeKubelet`` on the same dir).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from api.podresources.v1 import api_pb2 as podresources_pb2

WAIT = 5.0

# The generated gRPC module is untyped; give the pieces used here typed names.
_add_registration: Callable[[api_pb2_grpc.RegistrationServicer, grpc.Server], None] = (
    api_pb2_grpc.add_RegistrationServicer_to_server
)
_device_plugin_stub: Callable[[grpc.Channel], Any] = api_pb2_grpc.DevicePluginStub


@dataclass
class PluginConnection:
    """The fake kubelet's view of one registered plugin."""

    request: api_pb2.RegisterRequest
    channel: grpc.Channel
    stub: Any  # api_pb2_grpc.DevicePluginStub
    options: api_pb2.DevicePluginOptions | None = None
    updates: queue.Queue[api_pb2.ListAndWatchResponse] = field(default_factory=queue.Queue)
    stream: Any = None  # the ListAndWatch call: an iterator that is also a grpc.Call
    stream_ended: threading.Event = field(default_factory=threading.Event)
    stream_code: grpc.StatusCode | None = None
    thread: threading.Thread | None = None

    def next_update(self) -> list[api_pb2.Device]:
        return list(self.updates.get(timeout=WAIT).devices)

    def preferred(
        self, available: Sequence[str], size: int, must_include: Sequence[str] = ()
    ) -> list[str]:
        """GetPreferredAllocation for one container, as the kubelet asks it."""
        reply: api_pb2.PreferredAllocationResponse = self.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=list(available),
                        must_include_deviceIDs=list(must_include),
                        allocation_size=size,
                    )
                ]
            ),
            timeout=WAIT,
        )
        return list(reply.container_responses[0].deviceIDs)

    def allocate(self, device_ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Allocate for one container (raises ``grpc.RpcError`` on a plugin error)."""
        reply: api_pb2.AllocateResponse = self.stub.Allocate(
            api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(device_ids))]
            ),
            timeout=WAIT,
        )
        return reply.container_responses[0]


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: Path) -> None:
        self.path = plugin_dir / "kubelet.sock"
        self.plugin_dir = plugin_dir
        self.connections: queue.Queue[PluginConnection] = queue.Queue()
        self._all: list[PluginConnection] = []
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2)
        self._server = grpc.server(self._executor)
        _add_registration(self, self._server)
        assert self._server.add_insecure_port(f"unix:{self.path}") != 0
        self._server.start()

    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        channel = grpc.insecure_channel(f"unix:{self.plugin_dir / request.endpoint}")
        conn = PluginConnection(request, channel, _device_plugin_stub(channel))
        # Like the kubelet, talk back to the plugin after Register has returned.
        conn.thread = threading.Thread(target=self._watch, args=(conn,))
        with self._lock:
            self._all.append(conn)
        conn.thread.start()
        return api_pb2.Empty()

    def _watch(self, conn: PluginConnection) -> None:
        try:
            conn.options = conn.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=WAIT)
            stream = conn.stub.ListAndWatch(api_pb2.Empty())
            conn.stream = stream
            self.connections.put(conn)
            for update in stream:
                conn.updates.put(update)
            conn.stream_code = stream.code()
        except grpc.RpcError as e:
            conn.stream_code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        finally:
            conn.stream_ended.set()

    def next_connection(self) -> PluginConnection:
        return self.connections.get(timeout=WAIT)

    def stop(self) -> None:
        self._server.stop(0).wait()
        self._executor.shutdown(wait=True)
        with self._lock:
            conns = list(self._all)
        for conn in conns:
            if conn.stream is not None:
                conn.stream.cancel()
            if conn.thread is not None:
                conn.thread.join(WAIT)
            conn.channel.close()
        self.path.unlink(missing_ok=True)


class FakePodResources:
    """The kubelet's PodResources ``List`` on a Unix socket: ``held`` says which container of
    which pod holds which device ids of a resource (what the kubelet records at admission);
    ``fail`` makes every call answer UNAVAILABLE."""

    def __init__(self, path: Path, resource: str = "nvidia.com/gpu") -> None:
        self.path = path
        self.resource = resource
        self.held: dict[tuple[str, str], list[str]] = {}  # ("ns/name", container) -> ids
        self.extra: list[podresources_pb2.PodResources] = []  # sent as they are
        self.fail = False
        self.calls = 0
        self._executor = ThreadPoolExecutor(max_workers=2)
        self._server = grpc.server(self._executor)
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=podresources_pb2.ListPodResourcesRequest.FromString,
                    response_serializer=podresources_pb2.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        assert self._server.add_insecure_port(f"unix:{path}") != 0
        self._server.start()

    def _list(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet busy")
        pods: dict[str, list[podresources_pb2.ContainerResources]] = {}
        for (key, container), ids in self.held.items():
            pods.setdefault(key, []).append(
                podresources_pb2.ContainerResources(
                    name=container,
                    devices=[
                        podresources_pb2.ContainerDevices(
                            resource_name=self.resource, device_ids=ids
                        )
                    ],
                )
            )
        out = [
            podresources_pb2.PodResources(
                namespace=key.split("/")[0], name=key.split("/")[1], containers=containers
            )
            for key, containers in pods.items()
        ]
        return podresources_pb2.ListPodResourcesResponse(pod_resources=[*out, *self.extra])

    def stop(self) -> None:
        self._server.stop(0).wait()
        self._executor.shutdown(wait=True)
