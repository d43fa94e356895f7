"""Hostile kubelet device-plugin requests (v1beta1) reaching the node agent.

The real servicer of ``node_agent.deviceplugin.server`` with the real ``Allocator`` behind it,
on a node running one pod, with one more pod waiting to be allocated. Allocate,
GetPreferredAllocation and PreStartContainer get random device ids (advertised, other GPUs',
malformed, slots past int()'s limit), counts and container shapes. Every call answers or
aborts with a status the kubelet acts on (never INTERNAL/UNKNOWN) and a message; the
advertised devices and the running pod (annotations, MIG instance) never change. A few
requests also go over the real Unix socket, registered with a fake kubelet.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.deviceplugin.v1beta1 import api_pb2
from api.hami.devices import MigAllocation
from api.hami.keys import GpuMode
from api.hami.register import Placement
from node_agent.deviceplugin.ids import SlotInventory, device_id
from node_agent.deviceplugin.server import DevicePluginServer, _Servicer
from tests.builders import gpu
from tests.fake_kubelet import FakeKubelet, PluginConnection
from tests.fuzzing import AgentNode, FuzzLedger, agent_node, fuzz_settings
from tests.node_agent_fakes import make_pod as agent_pod

RESOURCE = "nvidia.com/gpu"
CLEAR_CODES = frozenset(grpc.StatusCode) - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FakeContext:
    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return True


def inventory_of(node: AgentNode) -> SlotInventory:
    return SlotInventory([gpu(u, index=i, count=10) for i, u in enumerate(node.gpus)])


def servicer(node: AgentNode, inventory: SlotInventory) -> _Servicer:
    return _Servicer(
        RESOURCE,
        inventory,
        node.allocator,
        node.allocator.preferred,
        threading.Event(),
        poll_s=0.01,
    )


def waiting_pod(node: AgentNode, count: int) -> None:
    """A pod the scheduler placed on GPU 1 (a free 2g.10gb placement on MIG nodes)."""
    g1 = node.gpus[1]
    mig = [MigAllocation(0, i, g1, "2g.10gb", Placement(2 * i, 2)) for i in range(count)]
    node.kube.add_pod(
        agent_pod(
            "waiting",
            devices=[[(g1, 1000 if node.mode == "hami-core" else 9984, 30)] * count],
            mig=mig if node.mode == "mig" else (),
        )
    )


def ids_strategy(node: AgentNode) -> st.SearchStrategy[list[str]]:
    advertised = [device_id(g, s) for g in node.gpus for s in range(10)]
    odd = [
        device_id("GPU-ffffffff-0000-0000-0000-000000000000", 0),
        f"{node.gpus[0]}-10",
        f"{node.gpus[0]}-01",
        f"{node.gpus[0]}-" + "9" * 5000,
        f"{node.gpus[0]}--1",
        node.gpus[0],
        "",
        " ",
        "GPU-a 0",
        "\x00-0",
    ]
    one = st.sampled_from(advertised) | st.sampled_from(odd) | st.text(max_size=40)
    return st.lists(one, max_size=4) | st.lists(st.sampled_from(advertised), max_size=12)


def _call(fn: object, request: object) -> tuple[str, str]:
    try:
        fn(request, FakeContext())  # type: ignore[operator]
    except Aborted as e:
        assert e.code in CLEAR_CODES, e
        assert e.details.strip(), e
        return "aborted", e.details
    return "ok", ""


def _unchanged(node: AgentNode, inventory: SlotInventory, devices: Sequence[object]) -> None:
    assert list(inventory.devices()) == list(devices)
    assert node.kube.annotations(node.victim_path) == node.victim_annotations
    assert all(path != node.victim_path for path, _, _ in node.kube.patches)
    assert node.victim_instance_intact()
    assert node.instances_all_managed()


@fuzz_settings(100)
@given(mode=st.sampled_from(["hami-core", "mig"]), count=st.integers(1, 2), data=st.data())
def test_hostile_allocate_requests(
    fuzz_ledger: FuzzLedger, mode: GpuMode, count: int, data: st.DataObject
) -> None:
    node = agent_node(mode)
    waiting_pod(node, count)
    inventory = inventory_of(node)
    devices = list(inventory.devices())
    svc = servicer(node, inventory)
    ids = data.draw(st.lists(ids_strategy(node), max_size=3), label="containers")
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in ids]
    )
    with fuzz_ledger.case("device-plugin/Allocate") as case:
        outcome, details = _call(svc.Allocate, request)
        if outcome == "aborted":
            case.rejected(details)
        _unchanged(node, inventory, devices)


@fuzz_settings(100)
@given(mode=st.sampled_from(["hami-core", "mig"]), count=st.integers(1, 2), data=st.data())
def test_hostile_preferred_allocation_and_prestart_requests(
    fuzz_ledger: FuzzLedger, mode: GpuMode, count: int, data: st.DataObject
) -> None:
    node = agent_node(mode)
    waiting_pod(node, count)
    inventory = inventory_of(node)
    devices = list(inventory.devices())
    svc = servicer(node, inventory)
    strategy = ids_strategy(node)
    containers = [
        api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=data.draw(strategy),
            must_include_deviceIDs=data.draw(strategy),
            allocation_size=data.draw(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 13)),
        )
        for _ in range(data.draw(st.integers(0, 3)))
    ]
    with fuzz_ledger.case("device-plugin/GetPreferredAllocation") as case:
        request = api_pb2.PreferredAllocationRequest(container_requests=containers)
        outcome, details = _call(svc.GetPreferredAllocation, request)
        if outcome == "aborted":
            case.rejected(details)
        _unchanged(node, inventory, devices)
    with fuzz_ledger.case("device-plugin/PreStartContainer") as case:
        request = api_pb2.PreStartContainerRequest(devices_ids=data.draw(strategy))
        outcome, details = _call(svc.PreStartContainer, request)
        if outcome == "aborted":
            case.rejected(details)
        _unchanged(node, inventory, devices)


# ----- over the real socket --------------------------------------------------------------------


@pytest.fixture(scope="module")
def wire() -> Iterator[tuple[AgentNode, SlotInventory, PluginConnection]]:
    directory = Path(tempfile.mkdtemp(prefix="dpf-"))  # short: sun_path limit
    node = agent_node("hami-core")
    waiting_pod(node, 1)
    inventory = inventory_of(node)
    kubelet = FakeKubelet(directory)
    server = DevicePluginServer(
        RESOURCE,
        directory,
        "tessera-fuzz.sock",
        inventory,
        node.allocator,
        preferred=node.allocator.preferred,
        watch_interval_s=0.05,
        stream_poll_s=0.02,
    )
    server.start()
    try:
        yield node, inventory, kubelet.next_connection()
    finally:
        server.stop()
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


@fuzz_settings(40)
@given(data=st.data())
def test_hostile_requests_over_the_socket(
    fuzz_ledger: FuzzLedger,
    wire: tuple[AgentNode, SlotInventory, PluginConnection],
    data: st.DataObject,
) -> None:
    node, inventory, conn = wire
    devices = list(inventory.devices())
    ids = data.draw(ids_strategy(node))
    with fuzz_ledger.case("device-plugin/wire") as case:
        try:
            if data.draw(st.booleans()):
                conn.allocate(ids)
            else:
                conn.preferred(ids, data.draw(st.integers(-5, 20)))
        except grpc.RpcError as e:
            assert isinstance(e, grpc.Call) and e.code() in CLEAR_CODES, e
            case.rejected(f"{e.code().name}: {e.details()}")
        _unchanged(node, inventory, devices)
