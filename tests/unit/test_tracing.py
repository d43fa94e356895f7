"""The plugin server's tracing: the servicer over real gRPC with an in-memory span exporter."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import encode
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.server.servicer import SchedulerServicer
from scheduler_plugins.server.tracing import (
    ATTR_DECISION_ID,
    ATTR_FEASIBLE_NODES,
    ATTR_NAMESPACE,
    ATTR_NODE,
    ATTR_OUTCOME,
    ATTR_POD,
    ATTR_POD_UID,
    RPC_SERVICE,
    SERVICE_NAME,
    Tracing,
    TracingConfigError,
    extract,
    service_resource,
)
from tests.builders import gpu, make_pod

V1 = pb.PROTOCOL_VERSION_1
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SHIM_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SHIM_SPAN_ID}-01"


class FakeKube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, Any]] = []

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        self.patches.append((path, patch))
        return {}


@dataclass
class Traced:
    stub: pb_grpc.SchedulerStub
    exporter: InMemorySpanExporter

    def spans(self) -> dict[str, ReadableSpan]:
        """Finished spans by name (each name once in these tests)."""
        spans = self.exporter.get_finished_spans()
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), [s.name for s in spans]
        return by_name


def _serve(tracing: Tracing, sock: Path) -> Iterator[pb_grpc.SchedulerStub]:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node1", "annotations": {ann.NODE_REGISTER: encode([gpu("GPU-1")])}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }
    cache.apply_node(node)
    ready = threading.Event()
    ready.set()
    servicer = SchedulerServicer(cache, FakeKube(), ready, tracing=tracing)
    executor = ThreadPoolExecutor(4)
    server = grpc.server(executor)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{sock}")
    try:
        yield pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        server.stop(0).wait()
        executor.shutdown(wait=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ttr-", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def traced(short_dir: Path) -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Tracing(provider) as tracing:
        for stub in _serve(tracing, short_dir / "plugin.sock"):
            yield Traced(stub, exporter)


def _ref(name: str) -> pb.PodRef:
    return pb.PodRef(namespace="default", name=name, uid=f"uid-{name}")


def _prefilter(stub: pb_grpc.SchedulerStub, name: str, metadata: Any = None) -> Any:
    pod = make_pod(name).gpu(1, mem=1000).build()
    pod["metadata"]["uid"] = f"uid-{name}"
    req = pb.PreFilterRequest(version=V1, pod=_ref(name), pod_json=json.dumps(pod).encode())
    return stub.PreFilter(req, timeout=10, metadata=metadata)


def _hex_ids(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return format_trace_id(ctx.trace_id), format_span_id(ctx.span_id)


def test_server_spans_continue_the_shims_trace_with_child_spans(traced: Traced) -> None:
    md = (("traceparent", TRACEPARENT),)
    r = _prefilter(traced.stub, "p", md)
    assert r.code == pb.PreFilterResponse.OK
    traced.stub.Reserve(
        pb.ReserveRequest(version=V1, pod=_ref("p"), node="node1", decision_id=r.decision_id),
        timeout=10,
        metadata=md,
    )
    traced.stub.PreBind(
        pb.PreBindRequest(version=V1, pod=_ref("p"), node="node1"), timeout=10, metadata=md
    )

    spans = traced.spans()
    children = {
        "PreFilter": ["decide"],
        "Reserve": ["reserve"],
        "PreBind": ["prebind.wait", "prebind.patch"],
    }
    for method, kids in children.items():
        server = spans[f"{RPC_SERVICE}/{method}"]
        assert server.kind == SpanKind.SERVER
        assert server.parent is not None and format_span_id(server.parent.span_id) == SHIM_SPAN_ID
        assert server.parent.is_remote
        trace_id, server_span_id = _hex_ids(server)
        assert trace_id == TRACE_ID
        attrs = dict(server.attributes or {})
        assert attrs[ATTR_NAMESPACE] == "default"
        assert attrs[ATTR_POD] == "p"
        assert attrs[ATTR_POD_UID] == "uid-p"
        assert attrs[ATTR_OUTCOME] == "ok"
        assert attrs["rpc.method"] == method
        assert (ATTR_NODE in attrs) == (method != "PreFilter")
        for kid in kids:
            child = spans[kid]
            assert child.parent is not None
            assert format_span_id(child.parent.span_id) == server_span_id
            assert _hex_ids(child)[0] == TRACE_ID
    prefilter = dict(spans[f"{RPC_SERVICE}/PreFilter"].attributes or {})
    assert prefilter[ATTR_FEASIBLE_NODES] == 1
    assert prefilter[ATTR_DECISION_ID] == r.decision_id


def test_each_cycle_call_continues_the_trace_its_request_carries(traced: Traced) -> None:
    """A stream has metadata once; each Cycle request carries its own call's trace context."""
    pod = make_pod("p").gpu(1, mem=1000).build()
    pod["metadata"]["uid"] = "uid-p"
    prefilter = pb.PreFilterRequest(version=V1, pod=_ref("p"), pod_json=json.dumps(pod).encode())
    other = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba90200-01"
    answers = traced.stub.Cycle(
        iter(
            [
                pb.CycleRequest(
                    id=1, pre_filter=prefilter, trace_context={"traceparent": TRACEPARENT}
                ),
                pb.CycleRequest(
                    id=2,
                    reserve=pb.ReserveRequest(version=V1, pod=_ref("p"), node="node1"),
                    trace_context={"traceparent": other},
                ),
            ]
        ),
        timeout=10,
    )
    assert [a.id for a in answers] == [1, 2]
    spans = traced.spans()
    parents = {
        method: spans[f"{RPC_SERVICE}/{method}"].parent for method in ("PreFilter", "Reserve")
    }
    assert all(p is not None and p.is_remote for p in parents.values())
    assert format_span_id(parents["PreFilter"].span_id) == SHIM_SPAN_ID  # type: ignore[union-attr]
    assert format_span_id(parents["Reserve"].span_id) == "00f067aa0ba90200"  # type: ignore[union-attr]
    assert _hex_ids(spans["decide"])[0] == TRACE_ID


def test_a_call_without_trace_context_starts_its_own_trace(traced: Traced) -> None:
    _prefilter(traced.stub, "p")
    span = traced.spans()[f"{RPC_SERVICE}/PreFilter"]
    assert span.parent is None
    assert _hex_ids(span)[0] != TRACE_ID


@pytest.mark.parametrize(
    ("traceparent", "continued"),
    [
        (TRACEPARENT, True),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # all-zero id
        ("not-a-traceparent", False),
    ],
)
def test_only_a_valid_traceparent_is_continued(
    traced: Traced, traceparent: str, continued: bool
) -> None:
    _prefilter(traced.stub, "p", (("traceparent", traceparent),))
    span = traced.spans()[f"{RPC_SERVICE}/PreFilter"]
    assert (span.parent is not None) == continued


def test_an_aborted_call_is_an_error_span_with_its_grpc_code(traced: Traced) -> None:
    with pytest.raises(grpc.RpcError) as e:
        traced.stub.Reserve(
            pb.ReserveRequest(version=V1, pod=_ref("never-prefiltered"), node="node1"),
            timeout=10,
            metadata=(("traceparent", TRACEPARENT),),
        )
    assert e.value.code() == grpc.StatusCode.ABORTED
    span = traced.spans()[f"{RPC_SERVICE}/Reserve"]
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description is not None
    assert "no PreFilter decision for pod default/never-prefiltered" in span.status.description
    attrs = dict(span.attributes or {})
    assert attrs[ATTR_OUTCOME] == "aborted"
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.ABORTED.value[0]


def test_an_unschedulable_answer_is_the_outcome(traced: Traced) -> None:
    pod = make_pod("big").gpu(1, mem=10**6).build()
    req = pb.PreFilterRequest(version=V1, pod=_ref("big"), pod_json=json.dumps(pod).encode())
    assert traced.stub.PreFilter(req, timeout=10).code == pb.PreFilterResponse.UNSCHEDULABLE
    attrs = dict(traced.spans()[f"{RPC_SERVICE}/PreFilter"].attributes or {})
    assert attrs[ATTR_OUTCOME] == "unschedulable"
    assert attrs[ATTR_FEASIBLE_NODES] == 0


def test_off_makes_no_spans_and_answers_the_same(short_dir: Path) -> None:
    off = Tracing.off()
    assert not off.enabled
    with off.span("decide") as span:
        assert span is None
    for stub in _serve(off, short_dir / "plugin.sock"):
        assert (
            _prefilter(stub, "p", (("traceparent", TRACEPARENT),)).code == pb.PreFilterResponse.OK
        )


def test_extract_reads_only_trace_context_keys() -> None:
    assert extract(None) is None
    assert extract((("user-agent", "grpc-go"),)) is None
    ctx = extract((("traceparent", TRACEPARENT), ("tracestate", "k=v"), ("x", "y")))
    assert ctx is not None


# ----- configuration from OTEL_* ----------------------------------------------------------


def _set_otel_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Exactly ``env`` among the OTEL_* variables, whatever the host's environment holds."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    ("env", "enabled"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": " OTLP "}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "True"}, False),
    ],
)
def test_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], enabled: bool) -> None:
    _set_otel_env(monkeypatch, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", **env})
    with Tracing.from_env() as tracing:
        assert tracing.enabled == enabled


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OTEL_TRACES_EXPORTER": "otlp,zipkin"},
            "OTEL_TRACES_EXPORTER='otlp,zipkin': unknown exporter 'zipkin'; the plugin server "
            "supports otlp, none",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            "='http/protobuf': only 'grpc' is installed",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
            },
            "'http/json'",
        ),
    ],
)
def test_from_env_rejects_what_it_cannot_do(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    _set_otel_env(monkeypatch, env)
    with pytest.raises(TracingConfigError) as e:
        Tracing.from_env()
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("service", "attributes", "want"),
    [
        (None, None, SERVICE_NAME),
        ("ps-a", None, "ps-a"),
        (None, "service.name=ps-b,team=gpu", "ps-b"),
        ("ps-c", "service.name=ps-b", "ps-c"),
    ],
)
def test_service_name(
    monkeypatch: pytest.MonkeyPatch, service: str | None, attributes: str | None, want: str
) -> None:
    env = {"OTEL_SERVICE_NAME": service, "OTEL_RESOURCE_ATTRIBUTES": attributes}
    _set_otel_env(monkeypatch, {k: v for k, v in env.items() if v is not None})
    assert service_resource(SERVICE_NAME).attributes["service.name"] == want
