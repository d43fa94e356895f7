"""The device plugin against a fake kubelet speaking real gRPC over Unix sockets.

``tests.fake_kubelet.FakeKubelet`` behaves like the kubelet's device manager (Register,
options, a ListAndWatch stream it queues; a restart deletes every socket in the dir, then
a new ``kubelet.sock`` appears).
"""

from __future__ import annotations

import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from api.deviceplugin.v1beta1 import api_pb2
from api.errors import InvalidInputError, TemporaryError, TesseraError
from node_agent.deviceplugin.ids import SlotInventory
from node_agent.deviceplugin.server import DevicePluginServer
from node_agent.deviceplugin.types import ContainerAllocation, DeviceSpec, Mount
from tests.builders import gpu
from tests.fake_kubelet import WAIT, FakeKubelet

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

RESOURCE = "nvidia.com/gpu"
SOCKET = "tessera-gpu.sock"
UUID_A = "GPU-8a3c1d2e-0b1f-4e5a-9c7d-1234567890ab"
UUID_B = "GPU-0f0e0d0c-1111-2222-3333-444455556666"


class StubHandler:
    """Records calls; answers one allocation per container naming its ids, or raises."""

    def __init__(self) -> None:
        self.allocate_calls: list[list[list[str]]] = []
        self.pre_start_calls: list[list[str]] = []
        self.error: Exception | None = None
        self.short_answer = False

    def allocate(self, containers: Sequence[Sequence[str]]) -> Sequence[ContainerAllocation]:
        self.allocate_calls.append([list(c) for c in containers])
        if self.error is not None:
            raise self.error
        answer = [
            ContainerAllocation(
                envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids), "CUDA_DEVICE_SM_LIMIT": "50"},
                mounts=(Mount("/usr/local/vgpu/libvgpu.so", "/opt/vgpu/libvgpu.so", True),),
                devices=(DeviceSpec("/dev/nvidia0", "/dev/nvidia0", "rw"),),
                annotations={"tessera.io/slots": str(len(ids))},
            )
            for ids in containers
        ]
        return answer[:-1] if self.short_answer else answer

    def pre_start(self, device_ids: Sequence[str]) -> None:
        self.pre_start_calls.append(list(device_ids))
        if self.error is not None:
            raise self.error


@pytest.fixture
def inventory() -> SlotInventory:
    return SlotInventory([gpu(UUID_A, count=2, numa=0), gpu(UUID_B, index=1, count=2, numa=1)])


@pytest.fixture
def handler() -> StubHandler:
    return StubHandler()


@pytest.fixture
def plugin(
    plugin_dir: Path, kubelet: FakeKubelet, inventory: SlotInventory, handler: StubHandler
) -> Iterator[DevicePluginServer]:
    server = make_server(plugin_dir, inventory, handler)
    server.start()
    yield server
    server.stop()


def make_server(
    plugin_dir: Path, inventory: SlotInventory, handler: StubHandler
) -> DevicePluginServer:
    return DevicePluginServer(
        RESOURCE,
        plugin_dir,
        SOCKET,
        inventory,
        handler,
        watch_interval_s=0.02,
        stream_poll_s=0.02,
        register_timeout_s=2.0,
    )


def health(devices: list[api_pb2.Device]) -> dict[str, str]:
    return {d.ID: d.health for d in devices}


def test_registers_with_kubelet_and_streams_devices_with_topology(
    plugin: DevicePluginServer, kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    conn = kubelet.next_connection()
    assert conn.request.version == "v1beta1"
    assert conn.request.endpoint == SOCKET
    assert conn.request.resource_name == RESOURCE
    assert not conn.request.options.pre_start_required  # as HAMi: nothing to do there
    assert conn.request.options.get_preferred_allocation_available
    assert conn.options == conn.request.options

    devices = conn.next_update()
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in devices] == [
        (f"{UUID_A}-0", "Healthy", [0]),
        (f"{UUID_A}-1", "Healthy", [0]),
        (f"{UUID_B}-0", "Healthy", [1]),
        (f"{UUID_B}-1", "Healthy", [1]),
    ]
    mode = (plugin_dir / SOCKET).stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600
    assert plugin.registrations == 1


def test_health_change_is_pushed_through_the_stream(
    plugin: DevicePluginServer, kubelet: FakeKubelet, inventory: SlotInventory
) -> None:
    conn = kubelet.next_connection()
    conn.next_update()
    inventory.update([gpu(UUID_A, count=2, numa=0), gpu(UUID_B, index=1, count=2, healthy=False)])
    assert health(conn.next_update()) == {
        f"{UUID_A}-0": "Healthy",
        f"{UUID_A}-1": "Healthy",
        f"{UUID_B}-0": "Unhealthy",
        f"{UUID_B}-1": "Unhealthy",
    }
    inventory.update([gpu(UUID_A, count=2, numa=0), gpu(UUID_B, index=1, count=2)])
    assert set(health(conn.next_update()).values()) == {"Healthy"}


def test_gpu_without_numa_has_no_topology(
    plugin_dir: Path, kubelet: FakeKubelet, handler: StubHandler
) -> None:
    with make_server(plugin_dir, SlotInventory([gpu(UUID_A, count=1, numa=-1)]), handler):
        (device,) = kubelet.next_connection().next_update()
        assert not device.HasField("topology")


def test_preferred_allocation_spreads_over_gpus(
    plugin: DevicePluginServer, kubelet: FakeKubelet
) -> None:
    conn = kubelet.next_connection()
    reply = conn.stub.GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[f"{UUID_A}-0", f"{UUID_A}-1", f"{UUID_B}-0"],
                    allocation_size=2,
                ),
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[f"{UUID_A}-0", f"{UUID_A}-1", f"{UUID_B}-1"],
                    must_include_deviceIDs=[f"{UUID_B}-1"],
                    allocation_size=2,
                ),
            ]
        ),
        timeout=WAIT,
    )
    assert [list(r.deviceIDs) for r in reply.container_responses] == [
        [f"{UUID_A}-0", f"{UUID_B}-0"],
        [f"{UUID_B}-1", f"{UUID_A}-0"],
    ]


def test_allocate_translates_handler_answer_per_container(
    plugin: DevicePluginServer, kubelet: FakeKubelet, handler: StubHandler
) -> None:
    conn = kubelet.next_connection()
    reply = conn.stub.Allocate(
        api_pb2.AllocateRequest(
            container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_A}-1", f"{UUID_B}-0"]),
                api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_A}-0"]),
            ]
        ),
        timeout=WAIT,
    )
    assert handler.allocate_calls == [[[f"{UUID_A}-1", f"{UUID_B}-0"], [f"{UUID_A}-0"]]]
    first, second = reply.container_responses
    assert dict(first.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{UUID_A}-1,{UUID_B}-0",
        "CUDA_DEVICE_SM_LIMIT": "50",
    }
    assert [(m.container_path, m.host_path, m.read_only) for m in first.mounts] == [
        ("/usr/local/vgpu/libvgpu.so", "/opt/vgpu/libvgpu.so", True)
    ]
    assert [(d.container_path, d.host_path, d.permissions) for d in first.devices] == [
        ("/dev/nvidia0", "/dev/nvidia0", "rw")
    ]
    assert dict(first.annotations) == {"tessera.io/slots": "2"}
    assert dict(second.envs)["NVIDIA_VISIBLE_DEVICES"] == f"{UUID_A}-0"


def test_pre_start_container_reaches_handler(
    plugin: DevicePluginServer, kubelet: FakeKubelet, handler: StubHandler
) -> None:
    conn = kubelet.next_connection()
    conn.stub.PreStartContainer(
        api_pb2.PreStartContainerRequest(devices_ids=[f"{UUID_B}-1"]), timeout=WAIT
    )
    assert handler.pre_start_calls == [[f"{UUID_B}-1"]]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("garbage", "device id 'garbage': expected <gpu-uuid>-<slot>"),
        (f"{UUID_A}-01", f"device id '{UUID_A}-01': expected <gpu-uuid>-<slot>"),
        (f"{UUID_A}-7", f"device id '{UUID_A}-7': not a device this plugin advertises"),
    ],
)
def test_bad_device_ids_are_invalid_argument_and_never_reach_handler(
    plugin: DevicePluginServer,
    kubelet: FakeKubelet,
    handler: StubHandler,
    device: str,
    message: str,
) -> None:
    conn = kubelet.next_connection()
    calls: list[Callable[[], object]] = [
        lambda: conn.stub.Allocate(
            api_pb2.AllocateRequest(
                container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_A}-0", device])
                ]
            ),
            timeout=WAIT,
        ),
        lambda: conn.stub.PreStartContainer(
            api_pb2.PreStartContainerRequest(devices_ids=[device]), timeout=WAIT
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
    assert handler.allocate_calls == []
    assert handler.pre_start_calls == []


def test_injected_preference_hook_answers_get_preferred_allocation(
    plugin_dir: Path, kubelet: FakeKubelet, inventory: SlotInventory, handler: StubHandler
) -> None:
    asked: list[tuple[list[str], list[str], int]] = []

    def steer(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        asked.append((list(available), list(must_include), size))
        return [d for d in available if d.startswith(UUID_B)][:size]

    server = DevicePluginServer(
        RESOURCE,
        plugin_dir,
        SOCKET,
        inventory,
        handler,
        preferred=steer,
        watch_interval_s=0.02,
        stream_poll_s=0.02,
    )
    with server:
        conn = kubelet.next_connection()
        available = [f"{UUID_A}-0", f"{UUID_B}-0", f"{UUID_B}-1"]
        assert conn.preferred(available, 1, [f"{UUID_A}-0"]) == [f"{UUID_B}-0"]
    assert asked == [(available, [f"{UUID_A}-0"], 1)]


def test_malformed_id_in_preferred_allocation_is_invalid_argument(
    plugin: DevicePluginServer, kubelet: FakeKubelet
) -> None:
    conn = kubelet.next_connection()
    with pytest.raises(grpc.RpcError) as info:
        conn.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["nope"], allocation_size=1
                    )
                ]
            ),
            timeout=WAIT,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "device id 'nope'" in (info.value.details() or "")


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (
            TemporaryError("GPU busy, retry"),
            grpc.StatusCode.UNAVAILABLE,
            "GPU busy, retry",
        ),
        (
            InvalidInputError("reservation for pod ns/p is malformed"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "reservation for pod ns/p is malformed",
        ),
        (
            TesseraError("placement no longer legal"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "placement no longer legal",
        ),
        (
            KeyError("boom"),
            grpc.StatusCode.INTERNAL,
            "allocate: internal error: KeyError: 'boom'",
        ),
    ],
)
def test_handler_error_becomes_grpc_error_and_server_stays_up(
    plugin: DevicePluginServer,
    kubelet: FakeKubelet,
    handler: StubHandler,
    error: Exception,
    code: grpc.StatusCode,
    message: str,
) -> None:
    conn = kubelet.next_connection()
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_A}-0"])]
    )
    handler.error = error
    with pytest.raises(grpc.RpcError) as info:
        conn.stub.Allocate(request, timeout=WAIT)
    assert info.value.code() == code
    assert message in (info.value.details() or "")

    handler.error = None
    reply = conn.stub.Allocate(request, timeout=WAIT)
    assert len(reply.container_responses) == 1
    assert conn.next_update()  # the stream is still alive too


def test_handler_answering_wrong_container_count_is_internal(
    plugin: DevicePluginServer, kubelet: FakeKubelet, handler: StubHandler
) -> None:
    conn = kubelet.next_connection()
    handler.short_answer = True
    with pytest.raises(grpc.RpcError) as info:
        conn.stub.Allocate(
            api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_A}-0"])]
            ),
            timeout=WAIT,
        )
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "0 allocations for 1 container requests" in (info.value.details() or "")


def restart_kubelet(kubelet: FakeKubelet, plugin_dir: Path) -> FakeKubelet:
    """What a kubelet restart looks like from the plugin dir."""
    kubelet.stop()
    for entry in plugin_dir.iterdir():
        if stat.S_ISSOCK(entry.lstat().st_mode):
            entry.unlink()
    return FakeKubelet(plugin_dir)


def test_kubelet_restart_serves_again_and_reregisters(
    plugin_dir: Path, inventory: SlotInventory, handler: StubHandler
) -> None:
    first = FakeKubelet(plugin_dir)
    second: FakeKubelet | None = None
    try:
        with make_server(plugin_dir, inventory, handler) as server:
            conn = first.next_connection()
            conn.next_update()
            second = restart_kubelet(first, plugin_dir)

            again = second.next_connection()
            assert again.request.endpoint == SOCKET
            assert len(again.next_update()) == 4
            assert server.registrations == 2
            assert stat.S_IMODE((plugin_dir / SOCKET).stat().st_mode) == 0o600
            reply = again.stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[
                        api_pb2.ContainerAllocateRequest(devices_ids=[f"{UUID_B}-1"])
                    ]
                ),
                timeout=WAIT,
            )
            assert len(reply.container_responses) == 1
            inventory.update([gpu(UUID_A, count=1)])
            assert [d.ID for d in again.next_update()] == [f"{UUID_A}-0"]
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not (plugin_dir / SOCKET).exists()


def test_recreated_kubelet_socket_alone_triggers_reregistration(
    plugin: DevicePluginServer, kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    kubelet.next_connection().next_update()
    socket_before = (plugin_dir / SOCKET).stat().st_ino
    kubelet.stop()  # removes kubelet.sock only; our socket survives
    time.sleep(0.1)  # a restarting kubelet is down for a while (here: 5 watch intervals)
    replacement = FakeKubelet(plugin_dir)
    try:
        conn = replacement.next_connection()
        assert conn.next_update()
        assert plugin.registrations == 2
        assert (plugin_dir / SOCKET).stat().st_ino == socket_before
    finally:
        replacement.stop()


def test_stop_ends_stream_cleanly_and_removes_socket(
    plugin_dir: Path, kubelet: FakeKubelet, inventory: SlotInventory, handler: StubHandler
) -> None:
    server = make_server(plugin_dir, inventory, handler)
    server.start()
    conn = kubelet.next_connection()
    conn.next_update()
    server.stop()
    assert conn.stream_ended.wait(WAIT)
    assert conn.stream_code == grpc.StatusCode.OK
    assert not (plugin_dir / SOCKET).exists()
    server.stop()  # idempotent


def test_start_without_kubelet_fails_temporarily_and_leaves_nothing(
    plugin_dir: Path, inventory: SlotInventory, handler: StubHandler
) -> None:
    server = make_server(plugin_dir, inventory, handler)
    with pytest.raises(TemporaryError, match=r"register nvidia.com/gpu with the kubelet"):
        server.start()
    assert list(plugin_dir.iterdir()) == []
    server.stop()


def test_stale_socket_is_replaced(
    plugin_dir: Path, kubelet: FakeKubelet, inventory: SlotInventory, handler: StubHandler
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(plugin_dir / SOCKET))
    stale.close()  # the file stays behind, as after a crash
    with make_server(plugin_dir, inventory, handler):
        assert kubelet.next_connection().next_update()


def test_refuses_to_replace_a_non_socket_file(
    plugin_dir: Path, kubelet: FakeKubelet, inventory: SlotInventory, handler: StubHandler
) -> None:
    (plugin_dir / SOCKET).write_text("not a socket")
    server = make_server(plugin_dir, inventory, handler)
    with pytest.raises(InvalidInputError, match="exists and is not a socket"):
        server.start()
    assert (plugin_dir / SOCKET).read_text() == "not a socket"


@pytest.mark.parametrize(
    ("resource", "socket_name"),
    [("gpu", SOCKET), (RESOURCE, ""), (RESOURCE, "a/b.sock"), (RESOURCE, "kubelet.sock")],
)
def test_rejects_bad_names(
    plugin_dir: Path,
    inventory: SlotInventory,
    handler: StubHandler,
    resource: str,
    socket_name: str,
) -> None:
    with pytest.raises(InvalidInputError):
        DevicePluginServer(resource, plugin_dir, socket_name, inventory, handler)


def test_double_start_is_refused(plugin: DevicePluginServer) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        plugin.start()
