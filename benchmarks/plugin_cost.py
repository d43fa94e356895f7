"""The plugin server's CPU per pod in one process, without a cluster around it.

The cluster benchmark measures the plugin server's CPU per bound pod on a 2-core machine that
every component shares, where a change of a tenth of it is lost in run-to-run noise. This
drives a real ``SchedulerServicer`` over its gRPC Unix socket the way the shim and the watch
do, on the cluster benchmark's nodes and pods (``tessera bench``'s default profile, mix and
seed): per GPU pod, on one ``Cycle`` stream as the shim sends them, PreFilter (the shim's
candidate limit) and Reserve on the best node with the annotations handed over for the
Binding; then the watch's two events of the pod (bound with those annotations; the node
agent's ``bind-phase: success``). Nothing else runs, so process CPU per step is the
server's work plus the gRPC client's share of each message. Each node count runs twice:
every call its own message, then each Reserve in the next PreFilter's ``before`` (what the
shim sends while cycles follow each other).

    python -m benchmarks.plugin_cost [--nodes 1000] [--pods 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import grpc

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from benchmarks.results_io import save_results
from scheduler_plugins import logs
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.devtools.bench.workload import bench_profile, generate, tessera_manifest
from scheduler_plugins.devtools.cluster.nodes import node_object, plan
from scheduler_plugins.server.servicer import SchedulerServicer

CANDIDATES: Final = 100  # the shim's default candidate limit
NAMESPACE: Final = "bench"
STEPS: Final = ("cycle", "watch")  # PreFilter + Reserve messages; the watch's events


class NoWrites:
    """The server's Kubernetes client: a pod handed its annotations at Reserve is written
    by the shim's Binding, so nothing here may write (or read) through it."""

    def get(self, path: str) -> Any:
        raise AssertionError(f"unexpected GET {path}")

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any:
        raise AssertionError(f"unexpected PATCH {path}")


def _ref(pod: Mapping[str, Any]) -> pb.PodRef:
    meta = pod["metadata"]
    return pb.PodRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def run(nodes: int, pods: int, seed: int = 1, *, batched: bool = True) -> dict[str, Any]:
    """Place the GPU pods of ``pods`` drawn pods on ``nodes`` nodes; CPU per step.

    ``batched``: each Reserve goes with the next pod's PreFilter, in its ``before``, as the
    shim sends it when the next cycle follows at once; else every call is its own message."""
    config = DeviceConfig()
    cache = ClusterCache(config, clock=time.monotonic)
    now = time.time()
    for name, group in plan(bench_profile(), nodes, 0):
        cache.apply_node(node_object(name, group, config, now=now))
    manifests = []
    for i, p in enumerate(generate(pods, seed=seed)):
        if p.gpus:
            m = tessera_manifest(p, namespace=NAMESPACE, labels={})
            m["metadata"]["uid"] = f"uid-{i}"
            manifests.append(m)
    ready = threading.Event()
    ready.set()
    servicer = SchedulerServicer(cache, NoWrites(), ready)
    cpu = dict.fromkeys(STEPS, 0.0)
    placed = refused = 0
    with tempfile.TemporaryDirectory(prefix="pc-", dir="/tmp") as d, ThreadPoolExecutor(8) as ex:
        server = grpc.server(ex)
        pb_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        sock = Path(d) / "plugin.sock"
        server.add_insecure_port(f"unix:{sock}")
        server.start()
        channel = grpc.insecure_channel(f"unix:{sock}")
        stub = pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        calls: queue.Queue[pb.CycleRequest | None] = queue.Queue()
        answers = stub.Cycle(iter(calls.get, None))  # the shim's one ordered stream
        # The Reserve not sent yet (batched), with its pod and node.
        waiting: tuple[pb.CycleRequest, dict[str, Any], str] | None = None

        def settle(reserved: pb.CycleResponse, pod: dict[str, Any], node: str) -> None:
            """The pod's Reserve answer, then the watch's two events of it."""
            nonlocal placed
            if reserved.code:
                raise RuntimeError(f"Reserve of {_ref(pod).name}: {reserved.message}")
            t0 = time.process_time()
            bound = copy.deepcopy(pod)
            annotations = bound["metadata"].setdefault("annotations", {})
            annotations.update(reserved.reserve.annotations)
            rv = 2 * int(pod["metadata"]["uid"].removeprefix("uid-"))
            bound["metadata"]["resourceVersion"] = str(rv)
            bound["spec"]["nodeName"] = node
            cache.apply_pod(bound)
            done = copy.deepcopy(bound)
            done["metadata"]["annotations"][ann.BIND_PHASE] = "success"
            done["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
            done["metadata"]["resourceVersion"] = str(rv + 1)
            cache.apply_pod(done)
            cpu["watch"] += time.process_time() - t0
            placed += 1

        try:
            for n, pod in enumerate(manifests, start=1):
                request = pb.CycleRequest(
                    id=2 * n,
                    pre_filter=pb.PreFilterRequest(
                        version=pb.PROTOCOL_VERSION_1,
                        pod=_ref(pod),
                        pod_json=json.dumps(pod).encode(),
                        candidate_nodes=CANDIDATES,
                    ),
                )
                if waiting is not None:
                    request.before.append(waiting[0])
                t0 = time.process_time()
                calls.put(request)
                answer = next(answers)
                cpu["cycle"] += time.process_time() - t0
                if waiting is not None:
                    settle(answer.before[0], *waiting[1:])
                    waiting = None
                if answer.code or answer.pre_filter.code != pb.PreFilterResponse.OK:
                    refused += 1
                    continue
                node = answer.pre_filter.feasible_nodes[0]
                reserve = pb.CycleRequest(
                    id=2 * n + 1,
                    reserve=pb.ReserveRequest(
                        version=pb.PROTOCOL_VERSION_1,
                        pod=_ref(pod),
                        node=node,
                        decision_id=answer.pre_filter.decision_id,
                        hand_over=True,
                    ),
                )
                if batched:
                    waiting = (reserve, pod, node)
                    continue
                t1 = time.process_time()
                calls.put(reserve)
                reserved = next(answers)
                cpu["cycle"] += time.process_time() - t1
                settle(reserved, pod, node)
            if waiting is not None:  # the last one, alone
                t0 = time.process_time()
                calls.put(waiting[0])
                reserved = next(answers)
                cpu["cycle"] += time.process_time() - t0
                settle(reserved, *waiting[1:])
        finally:
            calls.put(None)
            channel.close()
            server.stop(0).wait()
    per = {k: round(1e3 * v / placed, 3) if placed else None for k, v in cpu.items()}
    total = round(1e3 * sum(cpu.values()) / placed, 3) if placed else None
    return {
        "nodes": nodes,
        "batched": batched,
        "gpu_pods": len(manifests),
        "placed": placed,
        "refused": refused,
        "assumed_left": sum(
            1 for m in manifests if cache.state.is_assumed(f"{NAMESPACE}/{m['metadata']['name']}")
        ),
        "cpu_ms_per_pod": {**per, "total": total},
    }


def table(results: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "# Plugin server CPU per pod, in process",
        "",
        "| nodes | Reserve sent | GPU pods | placed | PreFilter + Reserve ms | watch ms "
        "| total ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["cpu_ms_per_pod"]
        how = "with the next PreFilter" if r["batched"] else "alone"
        lines.append(
            f"| {r['nodes']} | {how} | {r['gpu_pods']} | {r['placed']} | {c['cycle']} | "
            f"{c['watch']} | {c['total']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000", help="comma-separated node counts")
    parser.add_argument("--pods", type=int, default=3000, help="pods drawn (GPU pods are placed)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here (and .md beside)")
    args = parser.parse_args(argv)
    # Logged as the plugin server logs (JSON lines at info), into the void: its per-pod
    # lines cost what they cost in production, without filling the terminal.
    logs.configure("json", "info", stream=open(os.devnull, "w"))  # noqa: SIM115
    # Alone first, then batched, per node count: each pair in one process, minutes apart.
    results = [
        run(int(n), args.pods, args.seed, batched=batched)
        for n in args.nodes.split(",")
        for batched in (False, True)
    ]
    text = table(results)
    if args.json:
        save_results(args.json, {"runs": results}, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
