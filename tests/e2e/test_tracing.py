"""End to end: one trace per GPU pod's scheduling attempt, across both Tessera processes.

Runs once per trace store, each with its own dev cluster whose ``tessera-scheduler`` and plugin
server export OTLP/gRPC to that store (OTEL_* variables through ``start_stack(tracing_env=...)``):

- ``otlp``: the tests' in-process OTLP receiver (``tests/otlp_sink.py``); needs no binary, so
  it runs wherever the cluster runs;
- ``jaeger``: Jaeger v2 (``hack/jaeger.yaml``: in-memory storage, OTLP/gRPC receiver and query
  API on free loopback ports), read back through its HTTP API; runs where
  ``hack/build-tools.sh jaeger`` built it (the ``test`` tool set has no Jaeger: it takes most of
  half an hour to compile), skipped otherwise.

Each schedules a GPU pod and checks its trace, equally strictly for both stores: the shim's
root span with its PreFilter/Reserve client spans, each the parent of the plugin server's span
for that RPC, which holds the server's own work (decide, reserve), and its tessera.Bind span
(the Binding write; no PreBind: nothing on the node makes the pod wait, so Reserve hands the
annotations over); both services exported; the plugin server's JSON log line of the
reservation names that trace. Typically 35-50 s a store on a 2-core machine (the cluster's
start is most of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import pytest

from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.layout import LOOPBACK, repo_root
from scheduler_plugins.devtools.cluster.nodes import add_nodes, load_profile, wait_ready
from scheduler_plugins.devtools.cluster.stack import PLUGIN_SERVER, STACK, start_stack
from scheduler_plugins.devtools.cluster.testing import free_ports, settings_in
from tests.e2e.harness import GPU, GPUMEM, HERE, E2ECluster, pod_manifest
from tests.otlp_sink import OtlpSink
from tests.waiting import eventually

SCHEDULER_SERVICE: Final = "tessera-scheduler"
SERVER_SERVICE: Final = "tessera-plugin-server"
RPC: Final = "tessera.plugin.v1.Scheduler"
# Shim call span -> the plugin server's span for that RPC -> the server's child spans.
CALLS: Final = {
    "tessera.PreFilter": (f"{RPC}/PreFilter", ("decide",)),
    # Nothing on the node makes the pod wait: Reserve hands the annotations to Tessera's
    # Bind, which writes them in the Binding, and PreBind is skipped.
    "tessera.Reserve": (f"{RPC}/Reserve", ("reserve",)),
}
NODES: Final = 2
TRACE_WAIT_S: Final = 30.0
POD: Final = "traced"


# Trace stores -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    span_id: str
    parent_id: str
    name: str
    service: str
    tags: Mapping[str, Any]


class TraceStore(Protocol):
    """Where the cluster's processes export spans, and how the test reads them back."""

    @property
    def otlp_endpoint(self) -> str:
        """For ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``http://``: OTLP/gRPC without TLS)."""
        ...

    def traces(self, service: str, tags: Mapping[str, str]) -> dict[str, dict[str, Span]]:
        """Each trace holding a span of ``service`` with all of ``tags``: its spans by id, by
        trace id (hex)."""
        ...

    def services(self) -> set[str]:
        """Every service that exported a span."""
        ...


@dataclass(frozen=True)
class SinkStore:
    """The tests' own OTLP receiver."""

    sink: OtlpSink

    @property
    def otlp_endpoint(self) -> str:
        return self.sink.endpoint

    def traces(self, service: str, tags: Mapping[str, str]) -> dict[str, dict[str, Span]]:
        return {
            trace_id: {
                s.span_id: Span(s.span_id, s.parent_span_id, s.name, s.service, s.attributes)
                for s in spans
            }
            for trace_id, spans in self.sink.traces(service, tags).items()
        }

    def services(self) -> set[str]:
        return self.sink.services()


@dataclass(frozen=True)
class Jaeger:
    query_url: str
    otlp_endpoint: str
    log: Path

    def get(self, path: str, **query: str) -> Any:
        url = f"{self.query_url}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)

    def traces(self, service: str, tags: Mapping[str, str]) -> dict[str, dict[str, Span]]:
        answer = self.get(
            "/api/traces",
            service=service,
            tags=json.dumps(dict(tags)),
            limit="20",
            lookback="1h",
        )
        return {str(t["traceID"]): spans_of(t) for t in answer.get("data") or []}

    def services(self) -> set[str]:
        return set(self.get("/api/services")["data"] or [])


@pytest.fixture(scope="module")
def jaeger(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    binary = built_tools / "jaeger"
    if not binary.is_file():
        pytest.skip(f"{binary} is not built (hack/build-tools.sh jaeger); tracing e2e needs it")
    otlp, query_http, query_grpc = free_ports(3)
    log = tmp_path_factory.mktemp("jaeger") / "jaeger.log"
    env = {
        **os.environ,
        "JAEGER_OTLP_GRPC_PORT": str(otlp),
        "JAEGER_QUERY_HTTP_PORT": str(query_http),
        "JAEGER_QUERY_GRPC_PORT": str(query_grpc),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), "--config", str(repo_root() / "hack" / "jaeger.yaml")],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    j = Jaeger(f"http://{LOOPBACK}:{query_http}", f"http://{LOOPBACK}:{otlp}", log)
    try:

        def answering() -> bool:
            assert proc.poll() is None, f"jaeger exited: {processes.tail(log)}"
            try:
                return "data" in j.get("/api/services")
            except (urllib.error.URLError, ConnectionError):
                return False

        eventually(answering, timeout_s=30, interval_s=0.2, what=f"jaeger query API ({log})")
        yield j
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module", params=["otlp", "jaeger"])
def trace_store(request: pytest.FixtureRequest) -> Iterator[TraceStore]:
    """Each store in turn; pytest tears one store's cluster down before the next one starts."""
    if request.param == "jaeger":
        # The jaeger fixture skips this variant where the binary is not built.
        jaeger_store: Jaeger = request.getfixturevalue("jaeger")
        yield jaeger_store
        return
    with OtlpSink() as sink:
        yield SinkStore(sink)


@pytest.fixture(scope="module")
def traced_cluster(
    built_tools: Path, trace_store: TraceStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2ECluster]:
    """A dev cluster whose scheduler and plugin server export every span to ``trace_store``."""
    settings = settings_in(tmp_path_factory.mktemp("e2e-tracing"), "e2e-tracing")
    cluster = Cluster(settings)
    tracing_env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": trace_store.otlp_endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        # Export within 0.2 s of a span's end (default 5 s) so the test reads traces sooner.
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    try:
        info = cluster.up(timeout_s=120)
        with info.api() as api:
            names = add_nodes(api, load_profile(HERE / "nodes-small.yaml"), NODES)
            wait_ready(api, names, timeout_s=120)
            start_stack(settings, timeout_s=60, webhook=False, tracing_env=tracing_env)
            yield E2ECluster(settings, api, {})
    finally:
        cluster.down(purge=True)
        left = [
            c
            for c in STACK
            if (r := processes.read_record(settings.pid_file(c))) and processes.is_running(r)
        ]
        assert not left, f"left running after down: {left}"


# Reading a trace --------------------------------------------------------------------------------


def spans_of(trace: Mapping[str, Any]) -> dict[str, Span]:
    """Jaeger's JSON trace as spans by id."""
    services = {pid: p["serviceName"] for pid, p in trace["processes"].items()}
    out: dict[str, Span] = {}
    for s in trace["spans"]:
        parents = [r["spanID"] for r in s.get("references") or [] if r["refType"] == "CHILD_OF"]
        out[s["spanID"]] = Span(
            s["spanID"],
            parents[0] if parents else "",
            s["operationName"],
            services[s["processID"]],
            {t["key"]: t["value"] for t in s.get("tags") or []},
        )
    return out


def render(spans: Mapping[str, Span]) -> str:
    """The span tree, one span a line: service, name, outcome."""
    children: dict[str, list[Span]] = {}
    for s in spans.values():
        children.setdefault(s.parent_id if s.parent_id in spans else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.name):
            outcome = s.tags.get("tessera.outcome", "")
            lines.append(
                f"{'  ' * depth}{s.service}: {s.name}" + (f" [{outcome}]" if outcome else "")
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def problems(spans: Mapping[str, Span], pod: str) -> list[str]:
    """What the trace of ``pod``'s bound attempt lacks; empty when it is whole."""
    out: list[str] = []
    roots = [
        s for s in spans.values() if s.name == "tessera.schedule" and s.service == SCHEDULER_SERVICE
    ]
    if len(roots) != 1:
        return [f"{len(roots)} tessera.schedule roots"]
    root = roots[0]
    if root.parent_id or root.tags.get("k8s.pod.name") != pod:
        out.append(f"root: parent {root.parent_id!r}, pod {root.tags.get('k8s.pod.name')!r}")
    if root.tags.get("tessera.outcome") != "bound":
        out.append(f"root outcome {root.tags.get('tessera.outcome')!r}, want bound")
    binds = [s for s in spans.values() if s.name == "tessera.Bind" and s.parent_id == root.span_id]
    if len(binds) != 1 or binds[0].service != SCHEDULER_SERVICE:
        out.append(f"tessera.Bind: {len(binds)} shim spans under the root")
    if any(s.name == "tessera.PreBind" for s in spans.values()):
        out.append("tessera.PreBind called although Reserve could hand the annotations over")
    for call_name, (server_name, work) in CALLS.items():
        calls = [s for s in spans.values() if s.name == call_name and s.parent_id == root.span_id]
        if len(calls) != 1 or calls[0].service != SCHEDULER_SERVICE:
            out.append(f"{call_name}: {len(calls)} shim spans under the root")
            continue
        servers = [s for s in spans.values() if s.parent_id == calls[0].span_id]
        if [(s.name, s.service) for s in servers] != [(server_name, SERVER_SERVICE)]:
            out.append(f"{call_name}: children {[(s.name, s.service) for s in servers]}")
            continue
        kids = sorted(s.name for s in spans.values() if s.parent_id == servers[0].span_id)
        if kids != sorted(work):
            out.append(f"{server_name}: children {kids}, want {sorted(work)}")
        if servers[0].tags.get("k8s.pod.name") != pod:
            out.append(f"{server_name}: pod tag {servers[0].tags.get('k8s.pod.name')!r}")
    return out


# The test ---------------------------------------------------------------------------------------


def test_one_trace_spans_scheduler_and_plugin_server(
    traced_cluster: E2ECluster, trace_store: TraceStore
) -> None:
    t0 = time.monotonic()
    traced_cluster.create(pod_manifest(POD, {GPU: 1, GPUMEM: 2000}))
    bound = traced_cluster.wait_bound(POD, timeout_s=60)
    assert bound["spec"]["nodeName"]
    last: list[str] = [f"no trace of the pod yet; services seen: {sorted(trace_store.services())}"]

    def whole_trace() -> tuple[str, str] | None:
        traces = trace_store.traces(SCHEDULER_SERVICE, {"k8s.pod.name": POD})
        for trace_id, spans in traces.items():
            missing = problems(spans, POD)
            if not missing:
                return trace_id, render(spans)
            last[:] = [f"trace {trace_id}:", *missing, render(spans)]
        return None

    try:
        trace_id, tree = eventually(
            whole_trace, timeout_s=TRACE_WAIT_S, interval_s=0.5, what="a whole trace"
        )
    except AssertionError:
        pytest.fail(
            f"no trace of pod {POD} holds both services' spans as expected:\n" + "\n".join(last)
        )
    print(f"\nspan tree ({time.monotonic() - t0:.1f}s from pod creation):\n{tree}")
    services = trace_store.services()
    assert {SCHEDULER_SERVICE, SERVER_SERVICE} <= services, services
    # The plugin server's JSON log line of the reservation names the same trace.
    log = traced_cluster.settings.log_file(PLUGIN_SERVER)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    reserved = [
        x for x in lines if x.get("event") == "reserved" and x.get("pod") == f"default/{POD}"
    ]
    seen = [(x["node"], x.get("trace_id")) for x in reserved]
    assert (bound["spec"]["nodeName"], trace_id) in seen, seen
