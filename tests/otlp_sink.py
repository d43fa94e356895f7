"""An in-process OTLP/gRPC trace receiver for tests: what a collector would receive, in memory.

``OtlpSink`` serves OpenTelemetry's ``TraceService/Export`` over insecure gRPC on a free
loopback port and keeps every span it is sent, with hex ids, its resource's ``service.name``
and its attributes as plain Python values. ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT``
takes: its ``http://`` scheme makes the OTLP/gRPC exporters (the Go SDK's and the Python
SDK's) dial without TLS. Used as a context manager, or ``start()`` / ``stop()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

LOOPBACK: Final = "127.0.0.1"
SERVICE_NAME_KEY: Final = "service.name"
# The exporters batch, so a few workers are plenty; more than one so that the two processes
# of a dev cluster exporting at the same moment do not queue behind each other.
_WORKERS: Final = 4

# The generated gRPC module is untyped; give the piece used here a typed name.
_add_trace_service: Callable[[pb_grpc.TraceServiceServicer, grpc.Server], None] = (
    pb_grpc.add_TraceServiceServicer_to_server
)


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the sink received it; ids in lowercase hex, ``parent_span_id`` "" for a root."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    attributes: Mapping[str, Any]


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as a plain Python value (arrays as lists, key-value lists as
    dicts); None when no value is set."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [plain(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, kind)


def attributes_of(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP ``KeyValue`` pairs as a dict of plain values."""
    return {kv.key: plain(kv.value) for kv in pairs}


class OtlpSink(pb_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._executor: ThreadPoolExecutor | None = None
        self._server: grpc.Server | None = None
        self._port = 0

    # Serving ------------------------------------------------------------------------------------

    def start(self) -> OtlpSink:
        assert self._server is None, "the sink is already started"
        executor = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="otlp-sink")
        server = grpc.server(executor)
        _add_trace_service(self, server)
        # Port 0: the OS picks a free port when binding, so no other process can take it first.
        port = server.add_insecure_port(f"{LOOPBACK}:0")
        if port == 0:
            executor.shutdown(wait=True)
            raise RuntimeError(f"the OTLP sink could not bind a port on {LOOPBACK}")
        server.start()
        self._executor, self._server, self._port = executor, server, port
        return self

    def stop(self) -> None:
        """Stop serving (exports in flight are cancelled); what was received stays readable."""
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        assert self._port, "the sink is not started"
        return f"http://{LOOPBACK}:{self._port}"

    def Export(
        self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> pb.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            service = attributes_of(resource_spans.resource.attributes).get(SERVICE_NAME_KEY, "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            service=str(service),
                            attributes=attributes_of(s.attributes),
                        )
                    )
        with self._lock:
            self._spans.extend(received)
        # No partial_success: every span was accepted.
        return pb.ExportTraceServiceResponse()

    # Reading ------------------------------------------------------------------------------------

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def services(self) -> set[str]:
        """The ``service.name`` of every resource that exported a span."""
        return {s.service for s in self.spans()}

    def traces(
        self, service: str | None = None, attributes: Mapping[str, Any] | None = None
    ) -> dict[str, list[ReceivedSpan]]:
        """Every span of each trace that holds a span of ``service`` (any, when None) carrying
        all of ``attributes``, by trace id; like a trace store's search by service and tags."""
        wanted = dict(attributes or {})
        by_trace: dict[str, list[ReceivedSpan]] = {}
        for s in self.spans():
            by_trace.setdefault(s.trace_id, []).append(s)
        return {
            trace_id: spans
            for trace_id, spans in by_trace.items()
            if any(
                (service is None or s.service == service)
                and all(k in s.attributes and s.attributes[k] == v for k, v in wanted.items())
                for s in spans
            )
        }
