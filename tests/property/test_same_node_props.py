"""The same state gives the same node everywhere: ``tessera simulate``, the live plugin server
(its PreFilter ranking, through gRPC) and the benchmarks' ``decide(...).best_node()``.

Random clusters (hami-core, MIG and MPS GPUs of the catalog's models, some unhealthy; some nodes
all MPS) and random pod sequences, some requesting enough CPU or memory to fill a node; each pod
is placed by simulate from the YAML files a user would write, and offered by the server fed the
same Node objects, which then reserves the node it ranks first, so both states move together.
Every step: the same node (or both unschedulable with the same explanation), that node has the
top score the server gives kube-scheduler, and the same device annotations.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import GpuDevice
from api.plugin.v1 import plugin_pb2 as pb
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.requests import parse_allocation, parse_request
from scheduler_plugins.simulate import simulate
from tests.builders import make_pod
from tests.property.test_decide_props import gpus
from tests.unit.test_plugin_server import Harness, _harness, node_obj

CFG = DeviceConfig()


@contextlib.contextmanager
def live_server() -> Iterator[Harness]:
    d = Path(tempfile.mkdtemp(prefix="tsn-", dir="/tmp"))  # Unix socket paths are short
    gen = _harness(d, prebind_wait_s=5.0, ready=True)
    try:
        yield next(gen)
    finally:
        gen.close()
        shutil.rmtree(d, ignore_errors=True)


@st.composite
def pods(draw: st.DrawFn, i: int) -> dict[str, Any]:
    pod = make_pod(f"p{i}")
    for _ in range(draw(st.integers(1, 2))):
        memory = draw(st.sampled_from(["abs", "pct"]))
        pod.gpu(
            draw(st.integers(1, 2)),
            mem=draw(st.sampled_from([1000, 4000, 9000, 20_000])) if memory == "abs" else None,
            pct=draw(st.sampled_from([10, 25, 50])) if memory == "pct" else None,
            cores=draw(st.sampled_from([None, 0, 30, 100])),
        )
    mode = draw(st.sampled_from([None, "hami-core", "mig", "mps", "hami-core,mps"]))
    if mode:
        pod.annotate(ann.VGPU_MODE, mode)
    # CPU and memory against the nodes' 16 CPUs and 64 GiB: a few pods fill a node.
    requests = {
        k: v
        for k, v in (
            ("cpu", draw(st.sampled_from([None, "500m", "6"]))),
            ("memory", draw(st.sampled_from([None, "1Gi", "30Gi"]))),
        )
        if v is not None
    }
    if requests:
        pod.obj["spec"]["containers"][0]["resources"]["requests"] = requests
    for key in (ann.NODE_POLICY, ann.GPU_POLICY):
        policy = draw(st.sampled_from([None, "binpack", "spread"]))
        if policy:
            pod.annotate(key, policy)
    return pod.build()


@st.composite
def clusters(draw: st.DrawFn) -> list[tuple[str, tuple[GpuDevice, ...]]]:
    out = []
    for n in range(draw(st.integers(1, 6))):
        mps_node = draw(st.integers(0, 3)) == 0
        devices = tuple(draw(gpus(n, i, mps_node)) for i in range(draw(st.integers(1, 3))))
        out.append((f"node-{n}", devices))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.data())
def test_simulate_the_server_and_the_benchmarks_choose_the_same_node(
    nodes: list[tuple[str, tuple[GpuDevice, ...]]], data: Any
) -> None:
    sequence = [data.draw(pods(i), label=f"pod {i}") for i in range(data.draw(st.integers(1, 8)))]
    node_objs = [node_obj(name, *devices) for name, devices in nodes]
    work = Path(tempfile.mkdtemp(prefix="tsn-files-"))
    try:
        cluster_file = work / "cluster.yaml"
        pods_file = work / "pods.yaml"
        cluster_file.write_text(yaml.safe_dump_all([{**n, "kind": "Node"} for n in node_objs]))
        pods_file.write_text(yaml.safe_dump_all(sequence))
        simulated = list(simulate(cluster_file, pods_file, CFG))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    with live_server() as h:
        for n in node_objs:
            h.cache.apply_node(n)
        for pod, sim in zip(sequence, simulated, strict=True):
            name = pod["metadata"]["name"]
            with h.cache.lock:
                benchmark_node = decide(h.cache.state, parse_request(pod, CFG)).best_node()
            r = h.prefilter(pod)  # no candidate limit: every feasible node, best first
            if sim.status == "Unschedulable":
                assert r.code == pb.PreFilterResponse.UNSCHEDULABLE, (name, list(r.feasible_nodes))
                assert r.message == sim.reason
                assert benchmark_node is None
                continue
            assert r.code == pb.PreFilterResponse.OK, (name, r.message)
            assert r.feasible_nodes[0] == sim.node == benchmark_node, name
            assert r.scores[0] == max(r.scores)
            h.reserve(name, sim.node, r.decision_id)
            reserved = h.cache.state.allocation(f"default/{name}")
            placed = parse_allocation(
                {**pod, "metadata": {**pod["metadata"], "annotations": sim.annotations}}
            )
            assert reserved is not None and placed is not None
            assert (reserved.node, reserved.devices, reserved.mig) == (
                placed.node,
                placed.devices,
                placed.mig,
            ), name
