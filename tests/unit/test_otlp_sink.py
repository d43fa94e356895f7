"""The tests' OTLP sink: what the OpenTelemetry SDK exports to it over OTLP/gRPC, as it holds it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourcePb
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from tests.otlp_sink import OtlpSink, ReceivedSpan

SERVICE = "sink-test"
ATTRIBUTES: dict[str, Any] = {
    "s": "text",
    "i": -42,
    "big": 2**62,
    "b": True,
    "f": 0.25,
    "ss": ["a", "b"],
    "is": [1, 2, 3],
    "bs": [False, True],
    "fs": [1.5, -2.0],
}

_trace_stub: Callable[[grpc.Channel], Any] = collector_grpc.TraceServiceStub


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as s:
        yield s


def _sdk_spans() -> list[ReadableSpan]:
    """A parent span with a child carrying ATTRIBUTES, recorded by the SDK (not yet exported)."""
    recorded = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(recorded))
    tracer = provider.get_tracer("sink-test")
    with (
        tracer.start_as_current_span("parent", attributes={"k8s.pod.name": "p"}),
        tracer.start_as_current_span("child", attributes=ATTRIBUTES),
    ):
        pass
    provider.shutdown()
    return list(recorded.get_finished_spans())


def _ids(span: ReadableSpan) -> tuple[str, str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = format_span_id(span.parent.span_id) if span.parent is not None else ""
    return format_trace_id(ctx.trace_id), format_span_id(ctx.span_id), parent


def test_holds_what_the_sdks_otlp_exporter_sent(sink: OtlpSink) -> None:
    spans = _sdk_spans()
    # The endpoint alone, as OTEL_EXPORTER_OTLP_ENDPOINT gives it to the plugin server: its
    # http:// scheme must be enough for the exporter to dial without TLS.
    exporter = OTLPSpanExporter(endpoint=sink.endpoint)
    try:
        # export() returns once the sink answered, so the spans are held when it returns.
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()

    by_name = {s.name: s for s in sink.spans()}
    assert sorted(by_name) == ["child", "parent"], sink.spans()
    sdk = {s.name: s for s in spans}
    for name in ("parent", "child"):
        got = by_name[name]
        assert (got.trace_id, got.span_id, got.parent_span_id) == _ids(sdk[name]), name
        assert got.service == SERVICE
    parent, child = by_name["parent"], by_name["child"]
    assert parent.parent_span_id == ""
    assert child.parent_span_id == parent.span_id
    assert len(child.trace_id) == 32 and len(child.span_id) == 16
    assert dict(child.attributes) == ATTRIBUTES
    # Types survive, not only values (True == 1, 1 == 1.0 in Python).
    assert {k: type(v) for k, v in child.attributes.items()} == {
        k: type(v) for k, v in ATTRIBUTES.items()
    }
    assert [type(v) for v in child.attributes["bs"]] == [bool, bool]

    assert sink.services() == {SERVICE}
    assert sink.traces(SERVICE, {"k8s.pod.name": "p"}) == {parent.trace_id: [child, parent]}
    assert sink.traces(SERVICE, {"i": -42, "s": "text"}) == {parent.trace_id: [child, parent]}
    assert sink.traces(SERVICE, {"k8s.pod.name": "other"}) == {}
    assert sink.traces("another-service") == {}


def test_converts_rarer_values_and_a_resource_without_service_name(sink: OtlpSink) -> None:
    """Values the SDK's attributes cannot carry, sent as another exporter may."""
    span = trace_pb2.Span(
        trace_id=bytes(range(16)),
        span_id=bytes(range(8)),
        name="raw",
        attributes=[
            KeyValue(key="bytes", value=AnyValue(bytes_value=b"\x00\xff")),
            KeyValue(
                key="kv",
                value=AnyValue(
                    kvlist_value=KeyValueList(
                        values=[KeyValue(key="n", value=AnyValue(int_value=1))]
                    )
                ),
            ),
            KeyValue(
                key="nested",
                value=AnyValue(
                    array_value=ArrayValue(
                        values=[AnyValue(string_value="x"), AnyValue(array_value=ArrayValue())]
                    )
                ),
            ),
            KeyValue(key="unset", value=AnyValue()),
        ],
    )
    request = collector_pb.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=ResourcePb(), scope_spans=[trace_pb2.ScopeSpans(spans=[span])]
            )
        ]
    )
    with grpc.insecure_channel(sink.endpoint.removeprefix("http://")) as channel:
        response = _trace_stub(channel).Export(request, timeout=10)
    assert not response.HasField("partial_success"), response
    assert sink.spans() == [
        ReceivedSpan(
            trace_id="000102030405060708090a0b0c0d0e0f",
            span_id="0001020304050607",
            parent_span_id="",
            name="raw",
            service="",
            attributes={"bytes": b"\x00\xff", "kv": {"n": 1}, "nested": ["x", []], "unset": None},
        )
    ]


def test_stop_keeps_what_was_received_and_frees_the_port() -> None:
    sink = OtlpSink().start()
    endpoint = sink.endpoint
    exporter = OTLPSpanExporter(endpoint=endpoint)
    try:
        assert exporter.export(_sdk_spans()) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    sink.stop()
    sink.stop()  # idempotent: fixtures may stop a sink a test already stopped
    assert len(sink.spans()) == 2
    # Nothing listens on the old endpoint any more.
    with (
        grpc.insecure_channel(endpoint.removeprefix("http://")) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        _trace_stub(channel).Export(collector_pb.ExportTraceServiceRequest(), timeout=2)
    assert isinstance(refused.value, grpc.Call)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
