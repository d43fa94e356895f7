"""``/metrics`` over HTTP: the metrics server, the plugin server serving it (address rules,
start/stop), and the servicer recording what it answers."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import encode
from api.kube.errors import NotFoundError
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.server.app import PluginServer, ServerAddressError
from scheduler_plugins.server.metrics import (
    MetricsAddressError,
    MetricsServer,
    SchedulingMetrics,
    exposition,
)
from scheduler_plugins.server.servicer import SchedulerServicer
from scheduler_plugins.server.watch import Backoff
from tests.builders import gpu, make_pod

V1 = pb.PROTOCOL_VERSION_1


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


def node_obj(name: str, *uuids: str) -> dict[str, Any]:
    devices = tuple(gpu(u, index=i) for i, u in enumerate(uuids))
    return {
        "metadata": {"name": name, "annotations": {ann.NODE_REGISTER: encode(devices)}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


# ----- MetricsServer --------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[CollectorRegistry, MetricsServer]]:
    registry = CollectorRegistry()
    SchedulingMetrics(registry).observe_rpc("PreFilter", "OK", 0.01)
    with MetricsServer(registry, "127.0.0.1", 0) as server:
        yield registry, server


def test_serves_the_exposition_at_metrics(served: tuple[CollectorRegistry, MetricsServer]) -> None:
    registry, server = served
    status, headers, body = get(f"http://{server.address}/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert body == exposition(registry)
    assert b'tessera_scheduler_rpc_duration_seconds_count{code="OK",method="PreFilter"} 1.0' in body


def test_gzips_when_asked(served: tuple[CollectorRegistry, MetricsServer]) -> None:
    registry, server = served
    status, headers, body = get(f"http://{server.address}/metrics", {"Accept-Encoding": "gzip"})
    assert (status, headers["Content-Encoding"]) == (200, "gzip")
    assert gzip.decompress(body) == exposition(registry)


@pytest.mark.parametrize("path", ["/", "/metrics/extra", "/favicon.ico"])
def test_other_paths_are_not_found(
    served: tuple[CollectorRegistry, MetricsServer], path: str
) -> None:
    status, _, body = get(f"http://{served[1].address}{path}")
    assert status == 404
    assert b"only /metrics" in body


def test_a_busy_port_is_refused_with_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(CollectorRegistry(), "127.0.0.1", port)
        with pytest.raises(MetricsAddressError, match=f"cannot listen on 127.0.0.1:{port}"):
            server.start()
    with pytest.raises(MetricsAddressError, match="out of range"):
        MetricsServer(CollectorRegistry(), "127.0.0.1", 70000)


def test_ipv6_loopback_is_served() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = MetricsServer(CollectorRegistry(), "[::1]", 0)
        server.start()
    except MetricsAddressError as e:
        pytest.skip(f"IPv6 loopback unavailable: {e}")
    try:
        assert server.address.startswith("[::1]:")
        assert get(f"http://{server.address}/metrics")[0] == 200
    finally:
        server.stop()


def test_stop_leaves_no_thread_and_frees_the_port() -> None:
    before = set(threading.enumerate())
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    server.start()
    assert get(f"http://{server.address}/metrics")[0] == 200
    server.stop()
    server.stop()  # twice is harmless
    assert set(threading.enumerate()) <= before
    host, port = server.address.rsplit(":", 1)
    assert not listening(host, int(port))


# ----- PluginServer ---------------------------------------------------------------------------


class IdleWatch:
    def __init__(self, timeout_s: float) -> None:
        self._closed = threading.Event()
        self._timeout_s = timeout_s

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._closed.wait(self._timeout_s)
        return iter(())

    def close(self) -> None:
        self._closed.set()


class ListingKube:
    """Lists fixed nodes and pods; watches that stay idle; records nothing else."""

    def __init__(self, nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        self.nodes, self.pods = nodes, pods

    def list(self, path: str) -> dict[str, Any]:
        items = self.nodes if path.endswith("/nodes") else self.pods
        return {"metadata": {"resourceVersion": "5"}, "items": items}

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> IdleWatch:
        return IdleWatch(timeout_s)

    def get(self, path: str) -> Any:
        # An API server without the alpha PodGroup API (the gang watch stays off).
        raise NotFoundError("GET", path, 404, "NotFound", "the server could not find it")

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        return {}

    def post(self, path: str, body: object) -> Any:
        return {}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tms-", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    ("address", "allow_remote", "problem"),
    [
        ("0.0.0.0:9395", False, "not loopback"),
        ("10.1.2.3:9395", False, "not loopback"),
        ("9395", False, "must be HOST:PORT"),
        (":9395", False, "must be HOST:PORT"),
        ("127.0.0.1:http", False, "must be HOST:PORT"),
        ("127.0.0.1:65536", True, "must be HOST:PORT"),
    ],
)
def test_metrics_address_follows_the_loopback_rule(
    short_dir: Path, address: str, allow_remote: bool, problem: str
) -> None:
    with pytest.raises(ServerAddressError, match=problem):
        PluginServer(
            ListingKube([], []),
            DeviceConfig(),
            socket_path=short_dir / "p.sock",
            metrics_address=address,
            allow_remote=allow_remote,
        )


@pytest.mark.parametrize("address", ["0.0.0.0:0", "localhost:0", "[::1]:0"])
def test_accepted_metrics_addresses(short_dir: Path, address: str) -> None:
    PluginServer(
        ListingKube([], []),
        DeviceConfig(),
        socket_path=short_dir / "p.sock",
        metrics_address=address,
        allow_remote=address.startswith("0.0.0.0"),
    )


def test_plugin_server_serves_its_state_on_metrics_and_stops_clean(short_dir: Path) -> None:
    threads_before = set(threading.enumerate())
    pod = (
        make_pod("a")
        .gpu(1)
        .on("n1")
        .annotate(ann.VGPU_NODE, "n1")
        .annotate(ann.DEVICES_ALLOCATED, "GPU-1,NVIDIA,2000,30:;")
        .build()
    )
    server = PluginServer(
        ListingKube([node_obj("n1", "GPU-1", "GPU-2")], [pod]),
        DeviceConfig(),
        socket_path=short_dir / "p.sock",
        metrics_address="127.0.0.1:0",
        backoff=Backoff(0.01, 0.05),
    )
    with server:
        assert server.wait_ready(10)
        host, port = server.metrics_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        status, _, body = get(f"http://{server.metrics_address}/metrics")
        text = body.decode()
        assert status == 200
        assert (
            'hami_gpu_core_allocated_ratio{device_index="0",device_type="NVIDIA Tesla '
            'V100-PCIE-32GB",device_uuid="GPU-1",node="n1",zone="vGPU"} 30\n'
        ) in text
        assert 'hami_gpu_shared_count{device_index="1"' in text
        assert "tessera_scheduler_reservations_held 0.0" in text
        assert "process_resident_memory_bytes" in text
    assert set(threading.enumerate()) <= threads_before
    assert not listening(host, int(port))


def test_plugin_server_refuses_a_busy_metrics_port_and_cleans_up(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = PluginServer(
            ListingKube([], []),
            DeviceConfig(),
            socket_path=short_dir / "p.sock",
            metrics_address=f"127.0.0.1:{port}",
        )
        with pytest.raises(MetricsAddressError, match="--metrics-address"):
            server.start()
    assert not (short_dir / "p.sock").exists()


def test_no_metrics_address_serves_none(short_dir: Path) -> None:
    with PluginServer(ListingKube([], []), DeviceConfig(), socket_path=short_dir / "p.sock") as s:
        assert s.metrics_address == ""


# ----- the servicer records what it answers ---------------------------------------------------


@pytest.fixture
def stub_and_metrics(
    short_dir: Path,
) -> Iterator[tuple[pb_grpc.SchedulerStub, CollectorRegistry, ClusterCache]]:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    ready = threading.Event()
    ready.set()
    registry = CollectorRegistry()
    servicer = SchedulerServicer(
        cache, ListingKube([], []), ready, metrics=SchedulingMetrics(registry)
    )
    executor = ThreadPoolExecutor(4)
    server = grpc.server(executor)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    sock = short_dir / "plugin.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{sock}")
    try:
        yield pb_grpc.SchedulerStub(channel), registry, cache  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        server.stop(0).wait()
        executor.shutdown(wait=True)


def prefilter(stub: pb_grpc.SchedulerStub, pod: dict[str, Any]) -> pb.PreFilterResponse:
    name = pod["metadata"]["name"]
    request = pb.PreFilterRequest(
        version=V1,
        pod=pb.PodRef(namespace="default", name=name, uid=f"uid-{name}"),
        pod_json=json.dumps(pod).encode(),
    )
    return stub.PreFilter(request, timeout=10)  # type: ignore[no-any-return]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_servicer_counts_answers_reasons_and_rpc_codes(
    stub_and_metrics: tuple[pb_grpc.SchedulerStub, CollectorRegistry, ClusterCache],
) -> None:
    stub, registry, cache = stub_and_metrics
    cache.apply_node(node_obj("n1", "GPU-1"))
    cache.apply_node({"metadata": {"name": "cpu-only"}})
    assert (
        prefilter(stub, make_pod("fits").gpu(1, mem=1000).build()).code == pb.PreFilterResponse.OK
    )
    too_big = prefilter(stub, make_pod("big").gpu(1, mem=100_000).build())
    assert too_big.code == pb.PreFilterResponse.UNSCHEDULABLE
    assert prefilter(stub, make_pod("plain").build()).code == pb.PreFilterResponse.SKIP
    bad = make_pod("bad").gpu(1, cores=150).build()
    assert prefilter(stub, bad).code == pb.PreFilterResponse.INVALID
    with pytest.raises(grpc.RpcError) as e:
        stub.Reserve(
            pb.ReserveRequest(version=V1, pod=pb.PodRef(namespace="default", name="nobody")),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.ABORTED

    outcomes = {
        o: value(registry, "tessera_scheduler_decisions_total", outcome=o)
        for o in ("schedulable", "unschedulable", "skipped", "invalid")
    }
    assert outcomes == {"schedulable": 1, "unschedulable": 1, "skipped": 1, "invalid": 1}
    pending = {
        r: value(registry, "tessera_scheduler_pending_reasons_total", reason=r)
        for r in ("memory", "no_gpu", "cores", "slots")
    }
    assert pending == {"memory": 1, "no_gpu": 1, "cores": 0, "slots": 0}
    # Two decisions ran (skip and invalid answer before deciding).
    assert value(registry, "tessera_scheduler_decision_duration_seconds_count") == 2
    assert value(registry, "tessera_scheduler_decision_cpu_seconds_count") == 2
    rpc = "tessera_scheduler_rpc_duration_seconds_count"
    assert value(registry, rpc, method="PreFilter", code="OK") == 4
    assert value(registry, rpc, method="Reserve", code="ABORTED") == 1
    assert value(registry, rpc, method="Reserve", code="OK") == 0
