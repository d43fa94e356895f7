"""OpenTelemetry tracing of the plugin server, configured only by the standard OTEL_* variables.

Every RPC runs in a SERVER span that continues the trace whose W3C context (``traceparent``,
``tracestate``) the shim put in the call's gRPC metadata, so one trace holds a pod's whole
scheduling attempt across both processes; the handlers open child spans for the work that
takes time (``decide``, ``reserve``, ``prebind.wait``, ``prebind.patch``).

``OTEL_TRACES_EXPORTER`` unset or ``none`` means off (unlike OpenTelemetry's default, ``otlp``:
a scheduler should not dial a collector nobody configured); ``otlp`` exports over OTLP/gRPC,
set up by the exporter's own variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``…_INSECURE``,
``…_HEADERS``, ...). The SDK reads ``OTEL_SERVICE_NAME`` (default ``tessera-plugin-server``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER(_ARG)`` and ``OTEL_BSP_*``;
``OTEL_SDK_DISABLED=true`` turns everything off. Off, a ``Tracing`` holds no tracer and each
helper returns a shared no-op context manager at its first check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, Final

import grpc
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from api.errors import InvalidInputError
from api.plugin.v1 import plugin_pb2 as pb

SERVICE_NAME: Final = "tessera-plugin-server"
TRACER_NAME: Final = "tessera.plugin_server"
RPC_SERVICE: Final = "tessera.plugin.v1.Scheduler"

# Attribute keys, the same as the shim's.
ATTR_NAMESPACE: Final = "k8s.namespace.name"
ATTR_POD: Final = "k8s.pod.name"
ATTR_POD_UID: Final = "k8s.pod.uid"
ATTR_NODE: Final = "k8s.node.name"
ATTR_OUTCOME: Final = "tessera.outcome"
ATTR_DECISION_ID: Final = "tessera.decision_id"
ATTR_FEASIBLE_NODES: Final = "tessera.feasible_nodes"

ENV_SDK_DISABLED: Final = "OTEL_SDK_DISABLED"
ENV_TRACES_EXPORTER: Final = "OTEL_TRACES_EXPORTER"
ENV_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_TRACES_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_EXPORTERS: Final = ("otlp", "none")

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_CARRIED: Final = frozenset(_PROPAGATOR.fields)
_NO_SPAN: Final[contextlib.nullcontext[None]] = contextlib.nullcontext()

_PREFILTER_OUTCOMES: Final = {
    pb.PreFilterResponse.OK: "ok",
    pb.PreFilterResponse.SKIP: "skip",
    pb.PreFilterResponse.UNSCHEDULABLE: "unschedulable",
    pb.PreFilterResponse.INVALID: "invalid",
}


class TracingConfigError(InvalidInputError):
    """An OTEL_* variable asks for something the plugin server cannot do; the message says which."""


class Tracing:
    """The plugin server's tracer, or none (off). Built once at start, passed to the servicer."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self._provider = provider
        self._tracer: Tracer | None = (
            provider.get_tracer(TRACER_NAME) if provider is not None else None
        )

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def from_env(cls, *, default_service: str = SERVICE_NAME) -> Tracing:
        """As the OTEL_* variables in ``os.environ`` say."""
        env = os.environ
        if env.get(ENV_SDK_DISABLED, "").strip().lower() == "true":
            return cls.off()
        if not _wanted_exporters(env.get(ENV_TRACES_EXPORTER, "")):
            return cls.off()
        protocol = (env.get(ENV_TRACES_PROTOCOL) or env.get(ENV_PROTOCOL) or "grpc").strip()
        if protocol != "grpc":
            raise TracingConfigError(
                f"{ENV_TRACES_PROTOCOL}/{ENV_PROTOCOL}={protocol!r}: only 'grpc' is installed "
                "with the plugin server"
            )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return cls.exporting_to(OTLPSpanExporter(), default_service=default_service)

    @classmethod
    def exporting_to(
        cls, exporter: SpanExporter | None, *, default_service: str = SERVICE_NAME
    ) -> Tracing:
        """Spans batched to ``exporter``; None records spans and drops them (benchmarks)."""
        provider = TracerProvider(resource=service_resource(default_service))
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def shutdown(self) -> None:
        """Export what is queued and stop; a no-op when off."""
        if self._provider is not None:
            self._provider.shutdown()

    def __enter__(self) -> Tracing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def server_span(
        self,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        request: Any,
    ) -> contextlib.AbstractContextManager[Span | None]:
        """The call's span, a child of the shim's call span when ``metadata`` (a unary call's
        invocation metadata, a Cycle request's trace context) carries one."""
        if self._tracer is None:
            return _NO_SPAN
        return self._server_span(self._tracer, method, metadata, request)

    @contextlib.contextmanager
    def _server_span(
        self,
        tracer: Tracer,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        request: Any,
    ) -> Iterator[Span]:
        attributes: dict[str, str] = {
            "rpc.system": "grpc",
            "rpc.service": RPC_SERVICE,
            "rpc.method": method,
            **request_attributes(request),
        }
        with tracer.start_as_current_span(
            f"{RPC_SERVICE}/{method}",
            context=extract(metadata),
            kind=SpanKind.SERVER,
            attributes=attributes,
            # The handler wrapper records aborts with their gRPC code; context.abort's own
            # exception carries no message.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    def span(self, name: str, **attributes: str) -> contextlib.AbstractContextManager[Span | None]:
        """A child span of the current one (inside a handler), or nothing when off."""
        if self._tracer is None:
            return _NO_SPAN
        return self._tracer.start_as_current_span(name, attributes=attributes)


def _wanted_exporters(value: str) -> list[str]:
    wanted: list[str] = []
    for raw in value.split(","):
        name = raw.strip().lower()
        if name not in ("", *_EXPORTERS):
            raise TracingConfigError(
                f"{ENV_TRACES_EXPORTER}={value!r}: unknown exporter {name!r}; the plugin server "
                f"supports {', '.join(_EXPORTERS)}"
            )
        if name == "otlp" and name not in wanted:
            wanted.append(name)
    return wanted


def service_resource(default_service: str) -> Resource:
    """This process's resource: ``OTEL_SERVICE_NAME`` or a ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` if set, else ``default_service``."""
    from_env = OTELResourceDetector().detect().attributes
    return Resource.create(
        {} if SERVICE_NAME_KEY in from_env else {SERVICE_NAME_KEY: default_service}
    )


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The trace context in gRPC invocation metadata (key/value pairs), or None when it
    carries none."""
    carrier = {
        key: value for key, value in metadata or () if key in _CARRIED and isinstance(value, str)
    }
    if not carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def request_attributes(request: Any) -> dict[str, str]:
    """Pod and node of a plugin request (every request has ``pod``; all but PreFilter a node)."""
    out: dict[str, str] = {}
    pod = getattr(request, "pod", None)
    if pod is not None:
        out[ATTR_NAMESPACE] = pod.namespace or "default"
        out[ATTR_POD] = pod.name
        if pod.uid:
            out[ATTR_POD_UID] = pod.uid
    node = getattr(request, "node", "")
    if node:
        out[ATTR_NODE] = node
    return out


def record_response(span: Span | None, response: object) -> None:
    """The RPC's outcome on its span: PreFilter's answer code and feasible node count, else ok."""
    if span is None:
        return
    if isinstance(response, pb.PreFilterResponse):
        span.set_attribute(ATTR_OUTCOME, _PREFILTER_OUTCOMES.get(response.code, "error"))
        span.set_attribute(ATTR_FEASIBLE_NODES, len(response.feasible_nodes))
        if response.decision_id:
            span.set_attribute(ATTR_DECISION_ID, response.decision_id)
    else:
        span.set_attribute(ATTR_OUTCOME, "ok")


def record_abort(span: Span | None, code: grpc.StatusCode, message: str) -> None:
    """The status the RPC is aborted with, on its span."""
    if span is None:
        return
    span.set_attribute(ATTR_OUTCOME, "aborted" if code == grpc.StatusCode.ABORTED else "error")
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
