"""Jaeger v2 beside a dev cluster, on request (``tessera up --jaeger``): in-memory storage, an
OTLP/gRPC receiver and the query UI/API on loopback (``hack/jaeger.yaml``).

Runs like the stack's processes (pid file, log under the cluster's state dir) and stops with
them. Its ports are Jaeger's usual ones when free (UI 16686, OTLP 4317), else free ones; they
are recorded in the state dir so ``tessera status``/``env`` and a restart find them.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import structlog

from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.layout import LOOPBACK, ClusterSettings, repo_root

log = structlog.get_logger(__name__)

JAEGER: Final = "jaeger"
_PREFERRED: Final = {"ui": 16686, "otlp": 4317, "query_grpc": 16685}


@dataclass(frozen=True)
class JaegerPorts:
    ui: int
    otlp: int
    query_grpc: int

    @property
    def ui_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ui}"

    @property
    def otlp_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.otlp}"


def _ports_file(s: ClusterSettings) -> Path:
    return s.state_dir / "jaeger-ports.json"


def recorded_ports(s: ClusterSettings) -> JaegerPorts | None:
    """The ports Jaeger was last started on, or None when it never was (or they are lost)."""
    try:
        raw = json.loads(_ports_file(s).read_text())
        return JaegerPorts(int(raw["ui"]), int(raw["otlp"]), int(raw["query_grpc"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _choose_ports() -> JaegerPorts:
    chosen = {k: p if _free(p) else _any_free_port() for k, p in _PREFERRED.items()}
    return JaegerPorts(**chosen)


def probe(ports: JaegerPorts) -> str | None:
    """None when Jaeger's query API answers; else why not."""
    try:
        with urllib.request.urlopen(f"{ports.ui_url}/api/services", timeout=2.0) as r:
            json.load(r)
    except (OSError, ValueError, urllib.error.URLError) as e:
        return f"GET {ports.ui_url}/api/services: {e}"
    return None


def running(s: ClusterSettings) -> bool:
    record = processes.read_record(s.pid_file(JAEGER))
    return record is not None and processes.is_running(record)


def start_jaeger(s: ClusterSettings, *, timeout_s: float = 60.0) -> JaegerPorts:
    """Start Jaeger (or keep the one that answers) and return its ports."""
    ports = recorded_ports(s)
    if ports is not None and running(s) and probe(ports) is None:
        return ports
    processes.stop(s.pid_file(JAEGER))
    binary = s.binary(JAEGER)
    if not binary.is_file():
        raise ClusterError(
            f"{binary} is missing: build it with `bash hack/build-tools.sh jaeger` "
            "(about half an hour the first time on 2 cores)"
        )
    ports = _choose_ports()
    s.state_dir.mkdir(parents=True, exist_ok=True)
    _ports_file(s).write_text(json.dumps(asdict(ports)) + "\n")
    record = processes.spawn(
        JAEGER,
        [str(binary), "--config", str(repo_root() / "hack" / "jaeger.yaml")],
        log_path=s.log_file(JAEGER),
        pid_path=s.pid_file(JAEGER),
        env={
            "JAEGER_OTLP_GRPC_PORT": str(ports.otlp),
            "JAEGER_QUERY_HTTP_PORT": str(ports.ui),
            "JAEGER_QUERY_GRPC_PORT": str(ports.query_grpc),
        },
    )
    try:
        processes.wait_ready(
            record, lambda: probe(ports), log_path=s.log_file(JAEGER), timeout_s=timeout_s
        )
    except BaseException:
        processes.stop(s.pid_file(JAEGER))
        raise
    log.info("stack.ready", component=JAEGER, ui=ports.ui_url)
    return ports


def stop_jaeger(s: ClusterSettings) -> bool:
    """Stop Jaeger if it runs; True when a process was stopped."""
    return processes.stop(s.pid_file(JAEGER)) is not None


def tracing_env(ports: JaegerPorts) -> dict[str, str]:
    """OTEL_* for the scheduler and the plugin server: every span to this Jaeger."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": ports.otlp_endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
    }


__all__ = [
    "JAEGER",
    "JaegerPorts",
    "probe",
    "recorded_ports",
    "running",
    "start_jaeger",
    "stop_jaeger",
    "tracing_env",
]
