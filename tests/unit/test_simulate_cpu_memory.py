"""``tessera simulate`` with kube-scheduler's CPU and memory beside Tessera: every pod must fit
a node's allocatable less what the pods there request; pods without a GPU request go where
kube-scheduler's default scores put them; each placement counts for the next."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.hami.catalog import simulated_gpu_uuid, simulated_register_json
from scheduler_plugins.cli import main

MODEL = "A100-PCIE-40GB"  # 40960 MiB
CLASS = "1× NVIDIA A100-PCIE-40GB (hami-core)"


def node(name: str, cpu: object, memory: object, gpus: int = 0) -> dict[str, Any]:
    annotations = (
        {"hami.io/node-nvidia-register": simulated_register_json(name, MODEL, gpus, "hami-core")}
        if gpus
        else {}
    )
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": annotations},
        "status": {"allocatable": {"cpu": cpu, "memory": memory}},
    }


def pod(
    name: str,
    cpu: object = None,
    memory: object = None,
    *,
    gpu_mem: int = 0,
    on: str = "",
    priority: int = 0,
) -> dict[str, Any]:
    """A pod requesting ``cpu``/``memory`` (None: not at all) and, with ``gpu_mem``, one GPU
    of that many MiB, binpacking nodes; ``on``: bound there (with its device, if any, on the
    node's first GPU)."""
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": gpu_mem} if gpu_mem else {}
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "annotations": {"hami.io/node-scheduler-policy": "binpack"} if gpu_mem else {},
        },
        "spec": {
            "priority": priority,
            "containers": [{"name": "c", "resources": {"requests": requests, "limits": limits}}],
        },
    }
    if on:
        obj["spec"]["nodeName"] = on
        obj["status"] = {"phase": "Running", "startTime": "2024-01-01T00:00:00Z"}
        if gpu_mem:
            uuid = simulated_gpu_uuid(on, 0)
            obj["metadata"]["annotations"] = {
                "hami.io/vgpu-node": on,
                "hami.io/bind-phase": "success",
                "hami.io/vgpu-devices-allocated": f"{uuid},NVIDIA,{gpu_mem},0:;",
            }
    return obj


def cluster() -> list[dict[str, Any]]:
    """Two GPU nodes with a free GPU each (g1 has 1 CPU left), two GPU-less ones."""
    return [
        node("g1", "16", "64Gi", gpus=1),
        node("g2", "16", "64Gi", gpus=1),
        node("c1", "8", "32Gi"),
        node("c2", "8", "32Gi"),
        pod("g1-job", "15", "8Gi", gpu_mem=10000, on="g1"),
        pod("c2-web", "4", "16Gi", on="c2"),
    ]


def run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    nodes_and_pods: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    *flags: str,
) -> tuple[int, list[dict[str, Any]], str]:
    cluster_file, pods_file = tmp_path / "cluster.yaml", tmp_path / "pods.yaml"
    cluster_file.write_text(yaml.safe_dump_all(nodes_and_pods))
    pods_file.write_text(yaml.safe_dump_all(pods))
    argv = ["simulate", "--cluster", str(cluster_file), "--pods", str(pods_file), *flags]
    code = main([*argv, "--output", "json"])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line], err


def test_cpu_only_pods_go_to_the_least_allocated_node_each_counting_for_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scores by hand (2 CPUs, 4 GiB each): g1 lacks the CPU; g2 empty 90 + 73, c1 empty
    81 + 71, c2 31 + 71. With one such pod g2 is 81 + 73, with two 71 + 73 (< c1's 152)."""
    code, out, _ = run(tmp_path, capsys, cluster(), [pod(f"web-{i}", "2", "4Gi") for i in range(3)])
    assert code == 0
    assert [(r["status"], r["node"]) for r in out] == [
        ("Scheduled", "g2"),
        ("Scheduled", "g2"),
        ("Scheduled", "c1"),
    ]
    assert all(r["annotations"] == {} for r in out)
    assert out[0]["reason"] == (
        "no GPU request: kube-scheduler's scores 90 (NodeResourcesFit, least allocated) + 73 "
        "(NodeResourcesBalancedAllocation), 3/4 nodes fit its CPU and memory"
    )
    assert "scores 81 (NodeResourcesFit" in out[1]["reason"]
    assert "scores 81 (NodeResourcesFit" in out[2]["reason"]


def test_a_gpu_pod_is_refused_where_the_gpu_is_free_but_the_cpu_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Binpack prefers g1 (its GPU is in use); with 2 CPUs the pod goes to g2, without a CPU
    request to g1; 20 CPUs fit no GPU node, and the reason says so."""
    pods = [
        pod("train", "2", "1Gi", gpu_mem=10000),
        pod("no-cpu", gpu_mem=10000),
        pod("big", "20", "1Gi", gpu_mem=10000),
    ]
    code, out, _ = run(tmp_path, capsys, cluster(), pods)
    assert code == 0
    train, no_cpu, big = out
    assert (train["status"], train["node"]) == ("Scheduled", "g2")
    assert train["annotations"]["hami.io/vgpu-node"] == "g2"
    assert "2/4 nodes feasible" not in train["reason"]  # g1 fails on CPU, c1/c2 have no GPU
    assert "1/4 nodes feasible" in train["reason"]
    assert (no_cpu["status"], no_cpu["node"]) == ("Scheduled", "g1")
    assert big["status"] == "Unschedulable" and big["node"] is None
    assert big["reason"] == (
        f"0/4 nodes are available: 2 nodes [{CLASS}]: insufficient cpu (g1, g2); "
        "2 nodes [no GPUs]: no GPU registered (c1, c2)"
    )


def test_a_pod_that_fits_nowhere_by_memory_gets_the_memory_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pods = [pod("huge", "1", "100Gi"), pod("huge-gpu", "1", "100Gi", gpu_mem=1000)]
    code, out, _ = run(tmp_path, capsys, cluster(), pods)
    assert code == 0
    huge, huge_gpu = out
    assert (huge["status"], huge["node"]) == ("Unschedulable", None)
    assert huge["reason"] == (
        f"0/4 nodes are available: 2 nodes [{CLASS}]: insufficient memory (g1, g2); "
        "2 nodes [no GPUs]: insufficient memory (c1, c2)"
    )
    assert huge_gpu["status"] == "Unschedulable"
    assert f"2 nodes [{CLASS}]: insufficient memory (g1, g2)" in huge_gpu["reason"]


def test_unreadable_or_negative_allocatable_is_a_warning_and_not_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As with other node data that cannot be read: the node stays, without what is missing
    (here: its CPU and memory are not checked), and the warning names it."""
    nodes = [*cluster(), node("odd", "lots", "-1Gi")]
    code, out, err = run(tmp_path, capsys, nodes, [pod("greedy", "100", "1Ti")])
    assert code == 0
    assert (out[0]["status"], out[0]["node"]) == ("Scheduled", "odd")
    assert (
        "warning: Node odd read in part: status.allocatable.cpu: invalid quantity 'lots'; "
        "pods' cpu requests are not checked on this node" in err
    )
    assert "Node odd read in part: status.allocatable.memory: quantity '-1Gi' is negative" in err


@pytest.mark.parametrize(
    ("cpu", "fragment"),
    [("lots", "invalid quantity 'lots'"), ("-1", "cpu '-1' is negative")],
)
def test_an_unreadable_request_of_a_pod_to_place_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cpu: str, fragment: str
) -> None:
    code, out, err = run(tmp_path, capsys, cluster(), [pod("bad", cpu)])
    assert code == 2 and out == []
    assert "Pod default/bad: container 'c': " in err and fragment in err


def test_an_existing_pods_unreadable_request_counts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The API server admitted it: what cannot be read of its requests counts 0 (as the live
    scheduler counts it)."""
    nodes = [node("c", "4", "8Gi"), pod("old", "lots", "4Gi", on="c")]
    code, out, _ = run(tmp_path, capsys, nodes, [pod("new", "4", "4Gi")])
    assert code == 0 and out[0]["node"] == "c"


def test_preemption_weighs_cpu_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kube-scheduler's dry run filters with NodeResourcesFit too: pods whose CPU is in the
    way are the victims, GPU pods or not, on the node whose victims matter least."""
    nodes = [
        node("g", "4", "16Gi", gpus=1),
        node("x", "4", "16Gi"),
        node("y", "4", "16Gi"),
        pod("g-low", "3", "1Gi", gpu_mem=10000, on="g", priority=1),
        pod("x-low", "3", "1Gi", on="x"),
        pod("y-mid", "3", "1Gi", on="y", priority=5),
    ]
    pods = [
        pod("urgent-gpu", "2", "1Gi", gpu_mem=10000, priority=10),
        pod("urgent", "2", "1Gi", priority=10),
        pod("ordinary", "2", "1Gi"),
    ]
    code, out, _ = run(tmp_path, capsys, nodes, pods)
    assert code == 0
    urgent_gpu, urgent, ordinary = out
    assert urgent_gpu["status"] == "Unschedulable"
    assert f"1 node [{CLASS}]: insufficient cpu (g)" in urgent_gpu["reason"]
    assert urgent_gpu["preempt"] == {"node": "g", "victims": ["default/g-low"]}
    # Every node lacks the CPU; the lowest priority among the victims decides between nodes.
    assert urgent["status"] == "Unschedulable"
    assert urgent["preempt"] == {"node": "x", "victims": ["default/x-low"]}
    assert "would preempt default/x-low on node x" in urgent["reason"]
    assert ordinary["status"] == "Unschedulable" and ordinary["preempt"] is None


@pytest.mark.parametrize(("cpu_pod_first", "second_on"), [(False, "g2"), (True, "g1")])
def test_the_fragmentation_policy_says_what_the_pod_strands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cpu_pod_first: bool, second_on: str
) -> None:
    """Two half-GPU pods under the fragmentation policy: the second strands no more on g1,
    completing the first's GPU, than on the empty g2, and the reason gives the policy's score
    and that change. The tie goes to the emptier node, or to the fuller once Tessera places
    a pod without GPUs (it then places them all)."""
    half = [pod(f"half-{i}", "1", "1Gi", gpu_mem=20480) for i in range(2)]
    for p in half:
        p["metadata"]["annotations"]["hami.io/node-scheduler-policy"] = "fragmentation"
    cpu = [fragmentation(pod("web", "1", "1Gi"), "hami-scheduler")] if cpu_pod_first else []
    nodes = [node("g1", "16", "64Gi", gpus=2), node("g2", "16", "64Gi", gpus=2)]
    code, out, _ = run(tmp_path, capsys, nodes, [*cpu, *half])
    assert code == 0
    out = out[len(cpu) :]
    assert [r["node"] for r in out] == ["g1", second_on]
    devices = [r["annotations"]["hami.io/vgpu-devices-allocated"].split(",")[0] for r in out]
    assert (devices[0] == devices[1]) is (second_on == "g1")
    assert out[1]["reason"].startswith("fragmentation score ")
    assert "could not use there changes by +0.00 GPU, 2/2 nodes feasible" in out[1]["reason"]
    tie = "the fuller (Tessera places" if cpu_pod_first else "the emptier (the pods without"
    assert f"of nodes alike, {tie}" in out[1]["reason"]


def fragmentation(obj: dict[str, Any], scheduler: str | None) -> dict[str, Any]:
    obj["metadata"]["annotations"]["hami.io/node-scheduler-policy"] = "fragmentation"
    if scheduler is not None:
        obj["spec"]["schedulerName"] = scheduler
    return obj


@pytest.mark.parametrize(
    ("scheduler", "flags", "tessera"),
    [
        ("hami-scheduler", (), True),
        (None, (), False),  # no webhook option: kube-scheduler's
        (None, ("--host-only-pods",), True),
        ("default-scheduler", ("--host-only-pods",), True),
        ("other-scheduler", ("--host-only-pods",), False),
    ],
)
def test_a_cpu_only_pod_tessera_gets_under_fragmentation_takes_a_gpu_less_node(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    scheduler: str | None,
    flags: tuple[str, ...],
    tessera: bool,
) -> None:
    """kube-scheduler's scores put a 2-CPU pod on g2 (see the test above); Tessera's rule on
    c1, the free node without GPUs, then c1 again (c2 has less room), then g2 once c1 is
    full."""
    pods = [fragmentation(pod(f"web-{i}", "3", "4Gi"), scheduler) for i in range(3)]
    code, out, _ = run(tmp_path, capsys, cluster(), pods, *flags)
    assert code == 0
    nodes = [r["node"] for r in out]
    if not tessera:
        assert nodes[0] == "g2" and "kube-scheduler's scores" in out[0]["reason"]
        return
    assert nodes == ["c1", "c1", "c2"]
    assert "a node without GPUs" in out[0]["reason"]
    assert all(r["annotations"] == {} for r in out)


def test_a_cpu_only_pod_with_no_room_off_gpu_nodes_strands_the_least(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No node without GPUs has 6 CPUs free (c1 8 → full after the first): the second goes
    to g2, the only GPU node with room, and the reason says what it strands."""
    pods = [fragmentation(pod(f"batch-{i}", "6", "1Gi"), "hami-scheduler") for i in range(2)]
    code, out, _ = run(tmp_path, capsys, cluster(), pods)
    assert code == 0
    assert [r["node"] for r in out] == ["c1", "g2"]
    assert "no node without GPUs has room" in out[1]["reason"]
