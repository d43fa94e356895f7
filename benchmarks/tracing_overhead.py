"""Tracing overhead of the plugin server per RPC: off vs on with no exporter.

Two measurements, each in three modes:

- ``handler``: the tracing calls one RPC makes, in process (no gRPC): the server span around
  the handler (trace context read from the metadata), one child span inside, the outcome
  recorded. ``baseline`` is the call without them, ``off`` is ``Tracing.off()`` (what runs
  unless OTEL_TRACES_EXPORTER is set), ``on`` is an SDK provider without exporter (every span
  is made, then dropped; exporting happens on the BatchSpanProcessor's thread, off the call
  path).
- ``rpc``: a whole PreFilter round trip over gRPC on a Unix socket against a one-node
  cluster, client in the same process; ``baseline`` is absent here (same code as ``off``).

Run: ``python -m benchmarks.tracing_overhead [--calls N] [--rpc-calls N] [--repeat R]``;
prints JSON: per mode the min and median over ``repeat`` runs of the mean CPU time per call
(the process's, all threads), the modes interleaved.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import structlog

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import GpuDevice, encode
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.server.servicer import SchedulerServicer
from scheduler_plugins.server.tracing import Tracing, record_response

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
METADATA = (("traceparent", TRACEPARENT),)


class _Context:
    """The part of grpc.ServicerContext the wrapper reads."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return METADATA


def _per_call_ns(call: Callable[[], object], calls: int) -> float:
    """CPU time of this process per call (every thread: the gRPC server's too). CPU time, not
    wall time, so that other work on a busy machine does not count."""
    t0 = time.process_time_ns()
    for _ in range(calls):
        call()
    return (time.process_time_ns() - t0) / calls


def handler_call(tracing: Tracing, mode: str) -> Callable[[], object]:
    """What tracing adds to one RPC, as ``mode`` runs it: the server span around the handler,
    one child span inside it, the outcome recorded. ``baseline`` is the same call without any
    of it."""
    request = pb.ReserveRequest(pod=pb.PodRef(namespace="default", name="p"), node="node1")
    response = pb.ReserveResponse()
    context: Any = _Context()

    def without_tracing() -> pb.ReserveResponse:
        return response

    def traced() -> pb.ReserveResponse:
        with tracing.server_span("Reserve", context.invocation_metadata(), request) as span:
            with tracing.span("reserve"):
                pass
            record_response(span, response)
            return response

    return without_tracing if mode == "baseline" else traced


@contextmanager
def _server(tracing: Tracing) -> Iterator[pb_grpc.SchedulerStub]:
    tmp = Path(tempfile.mkdtemp(prefix="tbench-", dir="/tmp"))
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    gpu = GpuDevice("GPU-1", 0, 10, 40960, 100, "NVIDIA A100-PCIE-40GB", 0, True, "hami-core")
    cache.apply_node(
        {
            "metadata": {"name": "node1", "annotations": {ann.NODE_REGISTER: encode([gpu])}},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
        }
    )
    ready = threading.Event()
    ready.set()
    servicer = SchedulerServicer(cache, _NoKube(), ready, tracing=tracing)
    executor = ThreadPoolExecutor(4)
    server = grpc.server(executor)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix:{tmp / 's.sock'}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{tmp / 's.sock'}")
    try:
        yield pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        server.stop(0).wait()
        executor.shutdown(wait=True)
        shutil.rmtree(tmp, ignore_errors=True)


class _NoKube:
    """Nothing to read or write: the benchmark's PreFilter calls never reach the API."""

    def get(self, path: str) -> Any:
        return {}

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        return {}


@contextmanager
def rpc_call(tracing: Tracing) -> Iterator[Callable[[], object]]:
    """One PreFilter round trip of a one-GPU pod, with the shim's trace context."""
    pod = {
        "metadata": {"name": "p", "namespace": "default", "uid": "uid-p"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
    }
    req = pb.PreFilterRequest(
        version=pb.PROTOCOL_VERSION_1,
        pod=pb.PodRef(namespace="default", name="p", uid="uid-p"),
        pod_json=json.dumps(pod).encode(),
    )
    with _server(tracing) as stub:

        def call() -> None:
            r = stub.PreFilter(req, timeout=10, metadata=METADATA)
            assert r.code == pb.PreFilterResponse.OK, r.message

        call()  # connect
        yield call


def _summary(runs: dict[str, list[float]], scale: float) -> dict[str, dict[str, float]]:
    return {
        mode: {"min": round(min(v) / scale, 2), "median": round(statistics.median(v) / scale, 2)}
        for mode, v in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=5000, help="calls per run (handler)")
    p.add_argument("--rpc-calls", type=int, default=500, help="calls per run (rpc)")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    # The servicer logs each decision; keep the terminal (and the timings) free of it.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    tracings = {"baseline": Tracing.off(), "off": Tracing.off(), "on": Tracing.exporting_to(None)}
    handler_runs: dict[str, list[float]] = {m: [] for m in tracings}
    rpc_runs: dict[str, list[float]] = {"off": [], "on": []}
    with ExitStack() as stack:
        handlers = {m: handler_call(t, m) for m, t in tracings.items()}
        rpcs = {m: stack.enter_context(rpc_call(tracings[m])) for m in rpc_runs}
        # Modes interleaved, so a busy machine slows them alike; min is the least disturbed run.
        for _ in range(args.repeat):
            for mode, call in handlers.items():
                handler_runs[mode].append(_per_call_ns(call, args.calls))
            for mode, call in rpcs.items():
                rpc_runs[mode].append(_per_call_ns(call, args.rpc_calls))
    tracings["on"].shutdown()
    h = _summary(handler_runs, 1.0)
    report: dict[str, Any] = {
        "handler_ns": h,
        "rpc_us": _summary(rpc_runs, 1000.0),
        "off_adds_ns_per_call_min": round(h["off"]["min"] - h["baseline"]["min"]),
        "on_adds_ns_per_call_min": round(h["on"]["min"] - h["baseline"]["min"]),
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
