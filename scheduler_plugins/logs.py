"""Tessera's one logging setup: structlog, one JSON object per line, with the trace in scope.

The long-running commands (``tessera plugin-server``, ``tessera node-agent run|kwok``) call
``configure_from_args`` first thing, with the ``--log-format``/``--log-level`` flags that
``add_logging_flags`` registers. Callers log the object as keys (``pod="ns/name"``,
``node=…``); ``add_trace_context`` adds ``trace_id``/``span_id`` of the OpenTelemetry span
active at the call, so a log line of the plugin server finds its trace in Jaeger.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final, Literal, TextIO, get_args

import orjson
import structlog
from opentelemetry import trace
from structlog.typing import Processor

from api.errors import InvalidInputError

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
FORMATS: Final[tuple[str, ...]] = get_args(LogFormat)
LEVELS: Final[tuple[str, ...]] = get_args(LogLevel)
_LEVEL_NUMBERS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def add_trace_context(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: ``trace_id`` and ``span_id`` (W3C hex) of the active span, if any.

    Keys the caller passed are kept. Without an active span (tracing off, or outside a traced
    call) nothing is added.
    """
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", trace.format_trace_id(ctx.trace_id))
        event_dict.setdefault("span_id", trace.format_span_id(ctx.span_id))
    return event_dict


def _dumps(event: Any, **kw: Any) -> str:
    """A JSON log line with orjson (a tenth of the stdlib's time; a node agent writes a
    line or two per pod): members in the order logged, what it cannot encode by ``default``
    (structlog's: the repr). A line that is not plain ASCII, or that orjson refuses (an
    integer beyond 64 bits), goes through the stdlib encoder: escaped, it stays one line in
    any encoding (orjson leaves U+2028 as it is)."""
    default = kw.get("default")
    try:
        line = orjson.dumps(event, default=default, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(event, default=default)
    return line.decode() if line.isascii() else json.dumps(event, default=default)


def processors(fmt: LogFormat) -> list[Processor]:
    """The processor chain of ``fmt``, renderer last."""
    chain: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        return [
            *chain,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ]
    return [*chain, structlog.dev.ConsoleRenderer(colors=False)]


def configure(
    fmt: LogFormat = "json",
    level: LogLevel = "info",
    *,
    stream: TextIO | None = None,
    cache: bool = True,
) -> None:
    """Route every structlog logger of the process to ``stream`` (default stderr) in ``fmt``,
    dropping events below ``level``. ``cache`` keeps each logger's chain after first use."""
    if fmt not in FORMATS:
        raise InvalidInputError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    if level not in LEVELS:
        raise InvalidInputError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    structlog.configure(
        processors=processors(fmt),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVEL_NUMBERS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=cache,
    )


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` (default json) and ``--log-level`` (default info)."""
    parser.add_argument(
        "--log-format", choices=FORMATS, default="json", help="log lines as (default json)"
    )
    parser.add_argument(
        "--log-level", choices=LEVELS, default="info", help="least severe level logged"
    )


def configure_from_args(args: argparse.Namespace) -> None:
    """``configure`` with the flags ``add_logging_flags`` registered."""
    configure(args.log_format, args.log_level)
