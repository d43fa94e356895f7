"""The fragmentation node policy with the real ``tessera-scheduler``, and kube-scheduler's CPU
fit in Tessera's verdicts.

Three one-GPU nodes (A100-40GB: 10 slots, 100 cores, 40960 MiB; 32 CPUs each). Pods name the
policy with ``hami.io/node-scheduler-policy: fragmentation`` and leave the node to Tessera (no
selector or affinity): each is offered its best node alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from scheduler_plugins.devtools.cluster.nodes import cpu_node_object, create_node, wait_ready
from tests.e2e.harness import (
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    E2ECluster,
    annots,
    node_of,
    pod_manifest,
    tessera_cluster,
)

FRAGMENTATION: Final = {ann.VGPU_MODE: "hami-core", ann.NODE_POLICY: "fragmentation"}
HOG: Final = {"tessera.dev/test": "cpu-hog"}
HOG_SELECTOR: Final = "tessera.dev/test=cpu-hog"


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-fragmentation")
    with tessera_cluster(
        state,
        "e2e-frag",
        HERE / "nodes-scores.yaml",
        3,
        # Pods without a GPU that name no scheduler go to Tessera's (the chart's
        # webhook.hostOnlyPods), and the plugin asks the server about every such pod.
        tessera_args={"hostOnlyPods": True},
        webhook_args=["--host-only-pods"],
    ) as c:
        yield c


def _pod(name: str, mem: int, cores: int, cpu: str) -> dict[str, Any]:
    return pod_manifest(
        name,
        {GPU: 1, GPUMEM: mem, GPUCORES: cores},
        annotations=FRAGMENTATION,
        requests={"cpu": cpu},
    )


def test_half_pods_share_a_gpu_and_a_cpu_starved_node_is_avoided(cluster: E2ECluster) -> None:
    c = cluster
    nodes = c.nodes_in_mode("hami-core")
    # Tessera places the pods without GPUs here (the webhook's option): once one asked, of
    # nodes a pod strands alike the policy takes the fuller (with kube-scheduler placing
    # them, the emptier)
    c.create(_cpu_pod("cpu-first", "100m"))
    c.wait_bound("cpu-first")
    c.create(_pod("half-1", 20480, 50, "1"))
    first = node_of(c.wait_bound("half-1"))
    # the second half completes the first one's GPU: the policy keeps the other GPUs whole
    c.create(_pod("half-2", 20480, 50, "1"))
    assert node_of(c.wait_bound("half-2")) == first

    starved, fed = (n for n in nodes if n != first)
    c.create(pod_manifest("cpu-hog", requests={"cpu": "31"}, nodes=[starved], labels=HOG))
    c.wait_bound("cpu-hog", timeout_s=30)
    # starved has a whole GPU free but 1 CPU left: not where a 4-CPU pod can go
    c.create(_pod("whole-1", 40960, 100, "4"))
    assert node_of(c.wait_bound("whole-1")) == fed

    # only starved's GPU is left, and it lacks the CPU: Pending, and Tessera says why
    c.create(_pod("whole-2", 40960, 100, "4"))
    messages = c.wait_event("whole-2")
    assert any("insufficient cpu" in m for m in messages), messages
    assert not node_of(c.pod("whole-2"))

    # the hog, a pod without a GPU, goes: whole-2 is tried again at once (not at
    # kube-scheduler's periodic retry of waiting pods, five minutes on) and fits there now
    c.delete_pods(HOG_SELECTOR)
    assert node_of(c.wait_bound("whole-2", timeout_s=30)) == starved


def _cpu_pod(name: str, cpu: str) -> dict[str, Any]:
    """A pod asking for no GPU, for hami-scheduler, under the fragmentation policy."""
    return pod_manifest(name, annotations={ann.NODE_POLICY: "fragmentation"}, requests={"cpu": cpu})


def test_a_pod_without_a_gpu_takes_a_node_without_gpus_first(cluster: E2ECluster) -> None:
    """Tessera places a pod that asks for no GPU under the fragmentation policy: on a node
    without GPUs it strands no GPU capacity, so that node comes first, although
    kube-scheduler's own scores (least allocated) prefer a GPU node with freer CPUs; once it
    has no room, a GPU node. Nothing of a GPU pod's is written on either: DefaultBinder
    binds them."""
    c = cluster
    create_node(c.api, cpu_node_object("frag-cpu-0", cpu="8", memory="32Gi"))
    wait_ready(c.api, ["frag-cpu-0"], timeout_s=60)
    c.create(pod_manifest("cpu-pin", requests={"cpu": "2"}, nodes=["frag-cpu-0"]))
    assert node_of(c.wait_bound("cpu-pin")) == "frag-cpu-0"

    c.create(_cpu_pod("cpu-a", "1"))
    placed = c.wait_bound("cpu-a")
    assert node_of(placed) == "frag-cpu-0"
    assert not {ann.VGPU_NODE, ann.BIND_PHASE, ann.DEVICES_TO_ALLOCATE} & set(annots(placed))

    c.create(_cpu_pod("cpu-b", "6"))  # 5 CPUs left on frag-cpu-0
    placed = c.wait_bound("cpu-b")
    assert node_of(placed) in c.nodes_in_mode("hami-core")
    assert ann.VGPU_NODE not in annots(placed)

    # A pod that names no scheduler: the webhook routes it to Tessera's (it is no
    # default-scheduler pod any more), and it takes the 5 CPUs left off the GPU nodes.
    unnamed = _cpu_pod("cpu-c", "4")
    del unnamed["spec"]["schedulerName"]
    assert c.create(unnamed)["spec"]["schedulerName"] == "hami-scheduler"
    assert node_of(c.wait_bound("cpu-c")) == "frag-cpu-0"
