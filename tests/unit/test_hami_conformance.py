"""HAMi v2.10 conformance: which GPUs a pod gets, case by case, with the expected answer worked
out by hand from HAMi v2.10's documented semantics (docs/hami-compatibility.md), not from
Tessera's code.

Every case starts from objects as a HAMi cluster holds them: the node's register annotation
in HAMi's bytes, operator-written ``hami.io/device-cordon``, the device plugin's
``hami.io/node-nvidia-score``, and pods with the device strings HAMi's scheduler wrote. They
go through the same reading path as the live scheduler (``build_cluster``: ``parse_node`` and
``parse_allocation``), then ``decide`` and the plan of the node it ranks first.

HAMi's device order, the rules the expectations follow:

- Fit walks the sorted GPU list from its end: the GPU that sorts last is tried first. binpack
  sorts by GPU score ascending (the most used GPU is tried first), spread descending (the
  least used first). In a chain the keys decide in the order written; ``numa`` sorts NUMA ids
  ascending (the highest NUMA node is tried first); the last tie-break is the index
  (the highest index first).
- ``nvidia.com/numa-bind: true`` moves numa to the front and takes all of a container's GPUs
  from one NUMA node, trying the highest first.
- ``mutex``: only GPUs no pod holds. ``topology-aware``: a multi-GPU container takes the set
  of fitting GPUs with the highest sum of pair scores, a one-GPU container the GPU whose
  scores with the other candidates sum lowest.
- ``hami.io/device-cordon``: listed GPUs take no new work; pods on them keep counting.
- ``hami.io/device-scoring-weights`` weighs the slot, core and memory terms of the GPU score.

The GPU score here includes the pod's own request (the seed formula); on GPUs of one model
that is the same constant on every GPU, so the order is HAMi's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import GpuDevice, encode
from scheduler_plugins.core.binding import bind_annotations
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.simulate import build_cluster
from tests.builders import gpu, make_pod, mig_gpu

CFG = DeviceConfig()
NODE = "gpu-node"


def node(name: str, devices: tuple[GpuDevice, ...], **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {ann.NODE_REGISTER: encode(devices), **annotations},
        },
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    }


def holding(name: str, node_name: str, devices: str, phase: str = "Running") -> dict[str, Any]:
    """A pod HAMi placed: its ``hami.io/vgpu-devices-allocated`` as HAMi's scheduler wrote it."""
    return (
        make_pod(name)
        .gpu(1)
        .on(node_name, phase)
        .annotate(ann.VGPU_NODE, node_name)
        .annotate(ann.BIND_PHASE, "success")
        .annotate(ann.DEVICES_ALLOCATED, devices)
        .build()
    )


# The standard node: four 8 GiB GPUs, 0 and 1 on NUMA node 0, 2 and 3 on NUMA node 1.
# In use: GPU-0 4000 MiB / 30 cores, GPU-1 1000 / 10, GPU-3 2000 / 20; GPU-2 idle. So by
# GPU score (same slots each): GPU-2 < GPU-1 < GPU-3 < GPU-0.
GPUS = tuple(gpu(f"GPU-{i}", index=i, numa=i // 2) for i in range(4))
HELD = (
    holding("a", NODE, "GPU-0,NVIDIA,4000,30:;"),
    holding("b", NODE, "GPU-1,NVIDIA,1000,10:;"),
    holding("c", NODE, "GPU-3,NVIDIA,2000,20:;"),
)


# The same GPUs as HAMi's device plugin registers them in mps operating mode.
MPS_GPUS = tuple(replace(g, mode="mps") for g in GPUS)


# Pair scores: 0-1 100, 0-2 20, 0-3 10, 1-2 10, 1-3 10, 2-3 300 (NVLink between 2 and 3).
PAIR_SCORES: Final = {
    ann.NODE_PAIR_SCORES: (
        '[{"uuid":"GPU-0","score":{"GPU-1":100,"GPU-2":20,"GPU-3":10}},'
        '{"uuid":"GPU-1","score":{"GPU-0":100,"GPU-2":10,"GPU-3":10}},'
        '{"uuid":"GPU-2","score":{"GPU-0":20,"GPU-1":10,"GPU-3":300}},'
        '{"uuid":"GPU-3","score":{"GPU-0":10,"GPU-1":10,"GPU-2":300}}]'
    )
}
# GPU-0: 6000 MiB, 10 cores used; GPU-1: 1000 MiB, 90 cores.
MEMORY_VS_CORES: Final = (
    holding("a", NODE, "GPU-0,NVIDIA,6000,10:;"),
    holding("b", NODE, "GPU-1,NVIDIA,1000,90:;"),
)


@dataclass(frozen=True)
class Case:
    name: str
    annotations: dict[str, str] = field(default_factory=dict)
    count: int = 1
    mem: int = 1000
    cores: int | None = None
    expected: tuple[str, ...] | None = None  # the GPUs taken (one container), or None
    reason: str = ""  # a fragment of the explanation when nothing fits
    node_annotations: dict[str, str] = field(default_factory=dict)
    held: tuple[dict[str, Any], ...] = HELD
    devices: tuple[GpuDevice, ...] = GPUS


GPU_POLICY = ann.GPU_POLICY
CASES = [
    # --- one sort key ---------------------------------------------------------------------
    Case("spread (the default) takes the least used GPU", expected=("GPU-2",)),
    Case("spread named", {GPU_POLICY: "spread"}, expected=("GPU-2",)),
    Case("binpack takes the most used GPU", {GPU_POLICY: "binpack"}, expected=("GPU-0",)),
    Case(
        "spread, two GPUs: the two least used",
        {GPU_POLICY: "spread"},
        count=2,
        expected=("GPU-1", "GPU-2"),
    ),
    Case(
        "binpack, two GPUs: the two most used",
        {GPU_POLICY: "binpack"},
        count=2,
        expected=("GPU-0", "GPU-3"),
    ),
    # --- chains: keys decide in the order written ------------------------------------------
    Case("binpack,numa: binpack decides", {GPU_POLICY: "binpack,numa"}, expected=("GPU-0",)),
    Case(
        "numa,binpack: the highest NUMA node, then its most used GPU",
        {GPU_POLICY: "numa,binpack"},
        expected=("GPU-3",),
    ),
    Case(
        "numa,spread: the highest NUMA node, then its least used GPU",
        {GPU_POLICY: "numa,spread"},
        expected=("GPU-2",),
    ),
    Case(
        "numa alone: the highest NUMA node, then the highest index",
        {GPU_POLICY: "numa"},
        expected=("GPU-3",),
    ),
    Case(
        "spaces and repeats are ignored",
        {GPU_POLICY: " numa , binpack ,numa"},
        expected=("GPU-3",),
    ),
    Case(
        "a chain of filters only sorts by spread",
        {GPU_POLICY: "mutex,topology-aware"},
        expected=("GPU-2",),
    ),
    # --- numa-bind ---------------------------------------------------------------------------
    Case(
        "numa-bind: both GPUs from the highest NUMA node that has two",
        {ann.NUMA_BIND: "true"},
        count=2,
        expected=("GPU-2", "GPU-3"),
    ),
    Case(
        "numa-bind: a full GPU on NUMA 1 sends the pair to NUMA 0",
        {ann.NUMA_BIND: "true"},
        count=2,
        mem=6500,  # GPU-3 has 6192 MiB free
        expected=("GPU-0", "GPU-1"),
        held=(
            holding("b", NODE, "GPU-1,NVIDIA,1000,10:;"),
            holding("c", NODE, "GPU-3,NVIDIA,2000,20:;"),
        ),
    ),
    Case(
        "numa-bind: no NUMA node has two fitting GPUs",
        {ann.NUMA_BIND: "1"},
        count=2,
        mem=6500,  # fits GPU-1 (7192 free) and GPU-2 (8192): one on each NUMA node
        reason="NUMA",
    ),
    Case(
        "without numa-bind the same pod spans NUMA nodes",
        {ann.NUMA_BIND: "false"},
        count=2,
        mem=6500,
        expected=("GPU-1", "GPU-2"),
    ),
    Case(
        "numa-bind with the single name binpack tries the lowest NUMA node first",
        {ann.NUMA_BIND: "true", GPU_POLICY: "binpack"},
        count=2,
        expected=("GPU-0", "GPU-1"),
    ),
    Case(
        "numa-bind with a binpack chain tries the highest NUMA node first",
        {ann.NUMA_BIND: "true", GPU_POLICY: "binpack,spread"},
        count=2,
        expected=("GPU-2", "GPU-3"),
    ),
    Case(
        "numa-bind, one GPU, single binpack: the most used GPU of the lowest NUMA node",
        {ann.NUMA_BIND: "TRUE", GPU_POLICY: "binpack"},
        expected=("GPU-0",),
    ),
    # --- ties: same score ----------------------------------------------------------------------
    Case(
        "a single name breaks ties by the highest NUMA node",
        {GPU_POLICY: "spread"},
        held=(),
        devices=(
            gpu("GPU-0", index=0, numa=1),
            gpu("GPU-1", index=1, numa=0),
        ),
        expected=("GPU-0",),
    ),
    Case(
        "a chain breaks ties by the highest index only",
        {GPU_POLICY: "spread,binpack"},
        held=(),
        devices=(
            gpu("GPU-0", index=0, numa=1),
            gpu("GPU-1", index=1, numa=0),
        ),
        expected=("GPU-1",),
    ),
    Case(
        "ties go by index whatever order the device plugin registered the GPUs in",
        held=(),
        devices=(gpu("GPU-b", index=1), gpu("GPU-c", index=2), gpu("GPU-a", index=0)),
        expected=("GPU-c",),
    ),
    # --- mutex -------------------------------------------------------------------------------
    Case("mutex: only a GPU no pod holds", {GPU_POLICY: "mutex,binpack"}, expected=("GPU-2",)),
    Case(
        "mutex: two idle GPUs needed, one exists",
        {GPU_POLICY: "mutex"},
        count=2,
        reason="mutex",
    ),
    # --- device-cordon -------------------------------------------------------------------------
    Case(
        "a cordoned GPU takes no new work",
        node_annotations={ann.DEVICE_CORDON: "GPU-2"},
        expected=("GPU-1",),
    ),
    Case(
        "cordon list with spaces and empty entries",
        node_annotations={ann.DEVICE_CORDON: " GPU-2 ,, GPU-1 "},
        expected=("GPU-3",),
    ),
    Case(
        "every GPU cordoned",
        node_annotations={ann.DEVICE_CORDON: "GPU-0,GPU-1,GPU-2,GPU-3"},
        reason="cordoned",
    ),
    # --- device-scoring-weights ----------------------------------------------------------------
    # MEMORY_VS_CORES: binpack with even weights takes GPU-1 (cores weigh more); with cores
    # weighted 0, GPU-0 (memory).
    Case(
        "binpack with even weights",
        {GPU_POLICY: "binpack"},
        cores=0,
        expected=("GPU-1",),
        held=MEMORY_VS_CORES,
        devices=GPUS[:2],
    ),
    Case(
        "binpack with cores weighted 0",
        {GPU_POLICY: "binpack", ann.SCORING_WEIGHTS: "slot=1, core=0, memory=1"},
        cores=0,
        expected=("GPU-0",),
        held=MEMORY_VS_CORES,
        devices=GPUS[:2],
    ),
    # --- topology-aware (PAIR_SCORES) ---------------------------------------------------------
    Case(
        "topology-aware, two GPUs: the best-connected pair",
        {GPU_POLICY: "topology-aware"},
        count=2,
        expected=("GPU-2", "GPU-3"),
        held=(),
        node_annotations=PAIR_SCORES,
    ),
    Case(
        "topology-aware, one GPU: the least connected (leaves the NVLink pair whole)",
        {GPU_POLICY: "topology-aware"},
        expected=("GPU-1",),  # sums: GPU-0 130, GPU-1 120, GPU-2 330, GPU-3 320
        held=(),
        node_annotations=PAIR_SCORES,
    ),
    Case(
        "topology-aware among the GPUs that fit: GPU-3 is full, so 0-1 is the best pair",
        {GPU_POLICY: "topology-aware"},
        count=2,
        mem=7000,
        expected=("GPU-0", "GPU-1"),
        held=(holding("c", NODE, "GPU-3,NVIDIA,2000,20:;"),),
        node_annotations=PAIR_SCORES,
    ),
    # --- MPS GPUs (HAMi's device plugin in mps mode): the same policies as hami-core ---------
    Case("MPS: spread takes the least used GPU", expected=("GPU-2",), devices=MPS_GPUS),
    Case(
        "MPS: binpack, two GPUs: the two most used",
        {GPU_POLICY: "binpack"},
        count=2,
        expected=("GPU-0", "GPU-3"),
        devices=MPS_GPUS,
    ),
    Case(
        "MPS: numa-bind takes both GPUs from the highest NUMA node",
        {ann.NUMA_BIND: "true", ann.VGPU_MODE: "mps"},
        count=2,
        expected=("GPU-2", "GPU-3"),
        devices=MPS_GPUS,
    ),
    Case(
        "MPS: topology-aware, one GPU: the least connected",
        {GPU_POLICY: "topology-aware", ann.VGPU_MODE: "hami-core,mps"},
        expected=("GPU-1",),
        held=(),
        node_annotations=PAIR_SCORES,
        devices=MPS_GPUS,
    ),
    Case(
        "MPS: topology-aware among the GPUs that fit",
        {GPU_POLICY: "topology-aware"},
        count=2,
        mem=7000,
        expected=("GPU-0", "GPU-1"),
        held=(holding("c", NODE, "GPU-3,NVIDIA,2000,20:;"),),
        node_annotations=PAIR_SCORES,
        devices=MPS_GPUS,
    ),
    Case(
        "MPS: mutex takes only a GPU no client holds",
        {GPU_POLICY: "mutex,binpack"},
        expected=("GPU-2",),
        devices=MPS_GPUS,
    ),
    Case(
        "MPS: a cordoned GPU takes no new client",
        node_annotations={ann.DEVICE_CORDON: "GPU-2"},
        expected=("GPU-1",),
        devices=MPS_GPUS,
    ),
    Case(  # binpack would take GPU-1 (2 of 2 clients: the highest slot share) if it fit
        "MPS: the registered count (the client limit) bounds the clients",
        {GPU_POLICY: "binpack"},
        expected=("GPU-0",),
        held=(*HELD, holding("d", NODE, "GPU-1,NVIDIA,100,0:;")),
        devices=tuple(replace(g, count=2 if g.id == "GPU-1" else 48) for g in MPS_GPUS),
        mem=100,
        cores=0,
    ),
    Case(
        "MPS only, on hami-core GPUs",
        {ann.VGPU_MODE: "mps"},
        reason="GPU mode does not match nvidia.com/vgpu-mode",
    ),
    Case(
        "hami-core only, on MPS GPUs",
        {ann.VGPU_MODE: "hami-core"},
        reason="GPU mode does not match nvidia.com/vgpu-mode",
        devices=MPS_GPUS,
    ),
    # --- what HAMi <= v2.9 and v2.10 nodes leave ------------------------------------------------
    Case(
        "a GPU holding a legacy MIG slot takes no new work (stricter: v2.10 counts it free)",
        expected=("GPU-1",),
        held=(*HELD, holding("old", NODE, "GPU-2[1-1],NVIDIA,19968,28:;")),
    ),
    Case(
        "a finished pod's legacy slot holds nothing",
        expected=("GPU-2",),
        held=(*HELD, holding("old", NODE, "GPU-2[1-1],NVIDIA,19968,28:;", phase="Succeeded")),
    ),
]


def _place(case: Case, tmp: Path) -> tuple[tuple[str, ...] | None, str]:
    objects = [node(NODE, case.devices, **case.node_annotations), *case.held]
    state, skipped = build_cluster(objects, CFG, tmp)
    assert skipped == []
    pod = make_pod("new").gpu(case.count, mem=case.mem, cores=case.cores)
    for k, v in case.annotations.items():
        pod.annotate(k, v)
    decision = decide(state, parse_request(pod.build(), CFG))
    best = decision.best_node()
    if best is None:
        return None, explain(decision, state)
    plan = decision.plan_for(best)
    assert plan is not None
    (devices,) = plan.containers
    return tuple(sorted(d.uuid for d in devices)), ""


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_placement_follows_hami_v2_10(case: Case, tmp_path: Path) -> None:
    got, why = _place(case, tmp_path)
    assert got == case.expected, why
    if case.expected is None:
        assert case.reason in why, why


@pytest.mark.parametrize(
    ("mode", "nodes"),
    [
        (None, {"core", "mig", "mps"}),  # the unified pool: every mode
        ("hami-core", {"core"}),
        ("mig", {"mig"}),
        ("mps", {"mps"}),
        ("hami-core,mig", {"core", "mig"}),
        ("mig|hami-core", {"core", "mig"}),
        ("hami-core,mps", {"core", "mps"}),
        ("mps-please", {"mps"}),  # containment: the value contains "mps"
        ("mig,mps,hami-core", {"core", "mig", "mps"}),
    ],
)
def test_modes_by_containment(mode: str | None, nodes: set[str], tmp_path: Path) -> None:
    mps = GpuDevice("GPU-s", 0, 10, 8192, 100, "NVIDIA Tesla V100-PCIE-32GB", 0, True, "mps")
    objects = [
        node("core", (gpu("GPU-c"),)),
        node("mig", (mig_gpu("GPU-m"),)),
        node("mps", (mps,)),
        holding("on-mps", "mps", "GPU-s,NVIDIA,2000,0:;"),
    ]
    state, _ = build_cluster(objects, CFG, tmp_path)
    assert state.usage_snapshot()["mps/GPU-s"][1] == 2000.0  # HAMi's device string, counted
    pod = make_pod("p").gpu(1, mem=1000)
    if mode is not None:
        pod.annotate(ann.VGPU_MODE, mode)
    d = decide(state, parse_request(pod.build(), CFG))
    assert {n for i, n in enumerate(d.layout.names) if d.feasible[i]} == nodes
    for name in {"core", "mig", "mps"} - nodes:
        assert d.reasons[d.node_index(name)] == Reason.MODE


def test_an_mps_device_is_written_as_hami_core_writes_it(tmp_path: Path) -> None:
    """The node agent reads an MPS pod's devices as a hami-core pod's: the same bytes."""
    state, _ = build_cluster([node(NODE, MPS_GPUS, **PAIR_SCORES)], CFG, tmp_path)
    pod = make_pod("p").gpu(1, mem=3000, cores=25).mode("mps").build()
    decision = decide(state, parse_request(pod, CFG))
    plan = decision.plan_for(NODE)
    assert plan is not None
    (device,) = plan.containers[0]
    written = f"{device.uuid},NVIDIA,3000,25:;"
    assert bind_annotations(plan) == {
        ann.VGPU_NODE: NODE,
        ann.DEVICES_ALLOCATED: written,
        ann.DEVICES_TO_ALLOCATE: written,
    }


def test_malformed_pair_scores_lose_only_the_scores(tmp_path: Path) -> None:
    """HAMi drops such a node's whole registration; Tessera keeps its GPUs, warns, and places
    by the GPU policy's order."""
    bad = node(NODE, GPUS, **{ann.NODE_PAIR_SCORES: '[{"uuid":"GPU-0","score":{"GPU-1":0.5}}]'})
    state, warnings = build_cluster([bad], CFG, tmp_path)
    assert [(w.kind, w.name) for w in warnings] == [("Node", NODE)]
    assert "node-nvidia-score" in warnings[0].reason
    pod = make_pod("p").gpu(2, mem=1000).annotate(ann.GPU_POLICY, "topology-aware").build()
    decision = decide(state, parse_request(pod, CFG))
    plan = decision.plan_for(NODE)
    assert plan is not None and len(plan.containers[0]) == 2
