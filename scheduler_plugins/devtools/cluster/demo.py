"""``tessera demo``: the main job — a local cluster scheduling example GPU workloads.

Brings up a dev cluster (etcd + kube-apiserver + kwok), adds fake GPU nodes, starts Tessera
(plugin server, kube-scheduler with the Tessera plugin, kwok-mode node agent), submits
example workloads and prints where each pod went and why, then tears everything down.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog

from api.hami import keys as ann
from api.hami.devices import decode_devices, decode_mig_allocations
from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import ClusterSettings, repo_root
from scheduler_plugins.devtools.cluster.nodes import add_nodes, load_profile, wait_ready
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME, start_stack
from scheduler_plugins.server.events import REASON as EVENT_REASON

log = structlog.get_logger(__name__)

NAMESPACE: Final = "default"
DEMO_NODES: Final = 5  # examples/demo/nodes.yaml: hami-core, mig, mps, hami-core, mig


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    pod: dict[str, Any]
    expect_bound: bool = True


def _pod(
    name: str,
    limits: dict[str, object] | None = None,
    *,
    annotations: dict[str, str] | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER_NAME,
        "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits or {}}}],
    }
    if node is not None:  # only this node (kube-scheduler's NodeAffinity filters the rest)
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations or {}},
        "spec": spec,
    }


def workloads(mig_empty: str, mig_fragmented: str) -> list[Workload]:
    gpu = "nvidia.com/gpu"
    mem = "nvidia.com/gpumem"
    binpack = {ann.NODE_POLICY: "binpack", ann.VGPU_MODE: "hami-core"}
    spread = {ann.NODE_POLICY: "spread", ann.VGPU_MODE: "hami-core"}
    mig = {ann.VGPU_MODE: "mig"}
    return [
        Workload(
            "binpack-1",
            "hami-core, node binpack",
            _pod("binpack-1", {gpu: 1, mem: 10000}, annotations=binpack),
        ),
        Workload(
            "binpack-2",
            "hami-core, node binpack: joins binpack-1",
            _pod("binpack-2", {gpu: 1, mem: 10000}, annotations=binpack),
        ),
        Workload(
            "spread-1",
            "hami-core, node spread: the emptier node",
            _pod("spread-1", {gpu: 1, mem: 4000, "nvidia.com/gpucores": 30}, annotations=spread),
        ),
        Workload(
            "mig-seed",
            "seed MIG example: gpu 2 x 8000 MiB -> two 2g.10gb",
            _pod("mig-seed", {gpu: 2, mem: 8000}, annotations=mig, node=mig_empty),
        ),
        Workload(
            "needs-3g",
            "MIG 3g on a fragmented GPU: stays Pending",
            _pod("needs-3g", {gpu: 1, mem: 16000}, annotations=mig, node=mig_fragmented),
            expect_bound=False,
        ),
        Workload(
            "mps-1",
            "MPS client: limits enforced by the GPU's MPS daemon",
            _pod(
                "mps-1",
                {gpu: 1, mem: 8000, "nvidia.com/gpucores": 25},
                annotations={ann.VGPU_MODE: "mps"},
            ),
        ),
        Workload("plain", "no GPU request: scheduled by the same profile", _pod("plain")),
    ]


def fragmenting_pod(node: str, gpu_uuid: str) -> dict[str, Any]:
    """A running pod holding 1g.5gb at slices 1, 3 and 5, as if scheduled earlier."""
    allocs = [
        {
            "containerIndex": 0,
            "deviceIndex": i,
            "gpuUUID": gpu_uuid,
            "profile": "1g.5gb",
            "placement": {"start": s, "size": 1},
        }
        for i, s in enumerate((1, 3, 5))
    ]
    devices = "".join(f"{gpu_uuid},NVIDIA,4864,15:" for _ in allocs) + ";"
    pod = _pod(
        "small-jobs",
        {"nvidia.com/gpu": 3, "nvidia.com/gpumem": 4000},
        annotations={
            ann.VGPU_MODE: "mig",
            ann.VGPU_NODE: node,
            ann.BIND_TIME: str(int(time.time())),
            ann.BIND_PHASE: "allocating",
            ann.DEVICES_ALLOCATED: devices,
            ann.DEVICES_TO_ALLOCATE: devices,
            ann.MIG_ALLOCATIONS: json.dumps(allocs, separators=(",", ":")),
        },
    )
    pod["spec"]["nodeName"] = node
    return pod


def _wait(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def _get_pod(api: KubeApi, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    return pod


def _settled(api: KubeApi, w: Workload) -> bool:
    pod = _get_pod(api, w.name)
    annotations = pod["metadata"].get("annotations") or {}
    if pod["spec"].get("nodeName"):
        wants_gpu = any(
            k.startswith("nvidia.com/")
            for c in pod["spec"]["containers"]
            for k in (c.get("resources", {}).get("limits") or {})
        )
        return not wants_gpu or annotations.get(ann.BIND_PHASE) in ("success", "failed")
    return bool(_condition_message(pod)) and not w.expect_bound


def _condition_message(pod: dict[str, Any]) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message", ""))
    return ""


def _tessera_explanation(api: KubeApi, pod: str) -> str:
    """The plugin server's per-node-class explanation (its latest event for the pod)."""
    events = api.get(
        f"/api/v1/namespaces/{NAMESPACE}/events",
        query={"fieldSelector": f"involvedObject.name={pod},reason={EVENT_REASON}"},
    )
    items = sorted(events.get("items", []), key=lambda e: str(e.get("lastTimestamp") or ""))
    return str(items[-1].get("message", "")) if items else ""


def _devices(annotations: dict[str, str]) -> str:
    if ann.MIG_ALLOCATIONS in annotations:
        return " ".join(
            f"{m.profile}@[{m.placement.start},{m.placement.end})"
            + (f" {m.runtime.mig_uuid[:12]}…" if m.runtime else "")
            for m in decode_mig_allocations(annotations[ann.MIG_ALLOCATIONS])
        )
    if ann.DEVICES_ALLOCATED in annotations:
        return " ".join(
            f"{d.uuid[:12]}… {d.mem}MiB {d.cores}%"
            for c in decode_devices(annotations[ann.DEVICES_ALLOCATED])
            for d in c
        )
    return "-"


def report(api: KubeApi, items: list[Workload]) -> str:
    rows = [("POD", "WHAT", "STATUS", "NODE", "DEVICES", "WHY")]
    for w in items:
        pod = _get_pod(api, w.name)
        annotations = pod["metadata"].get("annotations") or {}
        node = pod["spec"].get("nodeName") or "-"
        if node != "-":
            phase = annotations.get(ann.BIND_PHASE)
            status = "Bound" + (f" ({phase})" if phase else "")
            why = ""
        else:
            status = "Pending"
            why = _tessera_explanation(api, w.name) or _condition_message(pod)
        rows.append((w.name, w.what, status, node, _devices(annotations), why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r[:5])) + "  " + r[5] for r in rows
    )


def run_demo(settings: ClusterSettings, *, keep: bool, timeout_s: float) -> int:
    cluster = Cluster(settings)
    info = cluster.up()
    try:
        with info.api() as api:
            profile = load_profile(repo_root() / "examples" / "demo" / "nodes.yaml")
            names = add_nodes(api, profile, DEMO_NODES)
            wait_ready(api, names, timeout_s=timeout_s)
            mig_nodes = []
            for name in names:
                node = api.get(f"/api/v1/nodes/{name}")
                register = json.loads(node["metadata"]["annotations"][ann.NODE_REGISTER])
                if register[0]["mode"] == "mig":
                    mig_nodes.append((name, register[0]["id"]))
            (mig_empty, _), (mig_frag, frag_gpu) = mig_nodes[:2]
            start_stack(settings, timeout_s=timeout_s)
            api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", fragmenting_pod(mig_frag, frag_gpu))
            items = workloads(mig_empty, mig_frag)
            for w in items:
                api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", w.pod)
                # One at a time, so each placement counts for the next (binpack/spread).
                _wait(f"pod {w.name}", functools.partial(_settled, api, w), timeout_s)
            time.sleep(1.0)  # the plugin server posts its explanation events asynchronously
            print(report(api, items))
        return 0
    finally:
        if keep:
            print(
                f"cluster kept: KUBECONFIG={settings.kubeconfig}; stop: tessera cluster down "
                f"--name {settings.name}"
            )
        else:
            cluster.down(purge=True)


def add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", help="local cluster + Tessera scheduling example workloads")
    demo.add_argument("--name", default="demo", help="cluster name (default: demo)")
    demo.add_argument("--apiserver-port", type=int, default=16443)
    demo.add_argument("--etcd-port", type=int, default=12379)
    demo.add_argument("--etcd-peer-port", type=int, default=0, help="default: etcd port + 1")
    demo.add_argument("--kwok-port", type=int, default=11247)
    demo.add_argument("--keep", action="store_true", help="leave the cluster running")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds per wait")
    demo.set_defaults(func=_cmd_demo)


def _cmd_demo(a: argparse.Namespace) -> int:
    settings = ClusterSettings(
        name=a.name,
        apiserver_port=a.apiserver_port,
        etcd_port=a.etcd_port,
        etcd_peer_port=a.etcd_peer_port,
        kwok_port=a.kwok_port,
    )
    return run_demo(settings, keep=a.keep, timeout_s=a.timeout)


__all__ = ["add_demo_command", "fragmenting_pod", "run_demo", "workloads"]
