"""The shared logging setup: the trace-context processor, the JSON chain, the CLI flags."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import format_span_id, format_trace_id

from api.errors import InvalidInputError
from scheduler_plugins.cli import build_parser
from scheduler_plugins.logs import add_trace_context, configure, processors


@pytest.fixture
def tracer() -> Iterator[Any]:
    provider = TracerProvider()  # no exporter: spans are made and dropped
    yield provider.get_tracer("test")
    provider.shutdown()


def test_no_active_span_adds_nothing() -> None:
    event = {"event": "reserved", "pod": "default/p"}
    assert add_trace_context(None, "info", dict(event)) == event


def test_active_span_adds_its_ids(tracer: Any) -> None:
    with tracer.start_as_current_span("decide") as span:
        out = add_trace_context(None, "info", {"event": "reserved"})
    ctx = span.get_span_context()
    assert out == {
        "event": "reserved",
        "trace_id": format_trace_id(ctx.trace_id),
        "span_id": format_span_id(ctx.span_id),
    }
    assert len(out["trace_id"]) == 32 and len(out["span_id"]) == 16


def test_ids_the_caller_passed_are_kept(tracer: Any) -> None:
    with tracer.start_as_current_span("decide"):
        out = add_trace_context(None, "info", {"event": "e", "trace_id": "mine"})
    assert out["trace_id"] == "mine"
    assert "span_id" in out


def test_after_the_span_ends_nothing_is_added(tracer: Any) -> None:
    with tracer.start_as_current_span("decide"):
        pass
    assert "trace_id" not in add_trace_context(None, "info", {"event": "e"})


def _logger(fmt: Any, out: io.StringIO) -> Any:
    return structlog.wrap_logger(
        structlog.PrintLogger(out),
        processors=processors(fmt),
        wrapper_class=structlog.make_filtering_bound_logger(0),
    )


def test_json_line_has_pod_node_and_trace(tracer: Any) -> None:
    out = io.StringIO()
    log = _logger("json", out)
    with tracer.start_as_current_span("reserve") as span:
        log.info("reserved", pod="default/p", node="node1")
    log.warning("unreserved", pod="default/p")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "reserved"
    assert first["level"] == "info"
    assert (first["pod"], first["node"]) == ("default/p", "node1")
    assert first["trace_id"] == format_trace_id(span.get_span_context().trace_id)
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "warning" and "trace_id" not in second


def test_json_line_renders_an_exception() -> None:
    out = io.StringIO()
    log = _logger("json", out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("handler failed", pod="default/p")
    line = json.loads(out.getvalue())
    assert "RuntimeError: boom" in line["exception"]


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("GPU-1", "GPU-1"),  # plain values as they are
        (("a", 1), ["a", 1]),
        ({0: "x"}, {"0": "x"}),  # a key that is not a string
        (_Opaque(), "<opaque>"),  # what JSON cannot hold: its repr
        (2**70, 2**70),  # beyond 64 bits: still the number
        ("é\u2028", "é\u2028"),
    ],
)
def test_json_line_holds_any_value(value: Any, logged: Any) -> None:
    out = io.StringIO()
    _logger("json", out).info("allocated", pod="default/p", detail=value)
    (line,) = out.getvalue().splitlines()
    got = json.loads(line)
    assert (got["event"], got["pod"], got["detail"]) == ("allocated", "default/p", logged)
    assert list(got)[:3] == ["pod", "detail", "event"]  # as structlog orders them, not sorted


def test_console_format_is_one_plain_line(tracer: Any) -> None:
    out = io.StringIO()
    with tracer.start_as_current_span("reserve"):
        _logger("console", out).info("reserved", pod="default/p")
    line = out.getvalue()
    assert line.count("\n") == 1 and "reserved" in line and "pod=default/p" in line
    assert "trace_id=" in line


@pytest.mark.parametrize(
    ("fmt", "level", "message"),
    [("xml", "info", "log format 'xml'"), ("json", "loud", "log level 'loud'")],
)
def test_configure_rejects_unknown_values(fmt: Any, level: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        configure(fmt, level)


def test_configure_filters_below_the_level() -> None:
    out = io.StringIO()
    configure("json", "warning", stream=out, cache=False)
    try:
        log = structlog.get_logger("test")
        log.info("dropped")
        log.warning("kept", node="node1")
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["event"], x["node"]) for x in lines] == [("kept", "node1")]


@pytest.mark.parametrize(
    "argv",
    [
        ["plugin-server", "--kubeconfig", "k", "--socket", "/s"],
        ["node-agent", "run", "--node-name", "n"],
        ["node-agent", "kwok"],
    ],
)
def test_long_running_commands_take_the_logging_flags(argv: list[str]) -> None:
    parser = build_parser()
    defaults = parser.parse_args(argv)
    assert (defaults.log_format, defaults.log_level) == ("json", "info")
    args = parser.parse_args([*argv, "--log-format", "console", "--log-level", "debug"])
    assert (args.log_format, args.log_level) == ("console", "debug")
