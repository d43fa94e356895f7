"""The invariant checker of the burst tests catches what it is meant to (no cluster needed)."""

from __future__ import annotations

import json
import time

from scheduler_plugins import annotations as ann
from scheduler_plugins.config import DeviceConfig
from scheduler_plugins.devcluster.nodes import NodeGroup, node_object
from scheduler_plugins.node_register import GpuDevice, decode
from tests.e2e.harness import GPU, GPUMEM, Obj, pod_manifest
from tests.e2e.invariants import annotation_violations, capacity_violations, rebuild_state

CORE = node_object("core", NodeGroup("A100-PCIE-40GB", gpus_per_node=2), DeviceConfig(), now=0)
MIGN = node_object(
    "mign", NodeGroup("A100-PCIE-40GB", gpus_per_node=1, mode="mig"), DeviceConfig(), now=0
)


def _gpus(node: Obj) -> tuple[GpuDevice, ...]:
    return decode(node["metadata"]["annotations"][ann.NODE_REGISTER])


REGISTERS = {"core": _gpus(CORE), "mign": _gpus(MIGN)}


def _bound(name: str, node: str, limits: dict[str, object], extra: dict[str, str]) -> Obj:
    pod = pod_manifest(name, limits, annotations={ann.VGPU_NODE: node, **extra})
    pod["metadata"]["annotations"].update(
        {ann.BIND_TIME: str(int(time.time())), ann.BIND_PHASE: "success"}
    )
    pod["spec"]["nodeName"] = node
    return pod


def _shared(name: str, gpu_index: int, mem: int) -> Obj:
    uuid = REGISTERS["core"][gpu_index].id
    return _bound(
        name,
        "core",
        {GPU: 1, GPUMEM: mem},
        {ann.DEVICES_ALLOCATED: f"{uuid},NVIDIA,{mem},0:;", ann.DEVICES_TO_ALLOCATE: ";"},
    )


def _mig(name: str, start: int, size: int, profile: str) -> Obj:
    uuid = REGISTERS["mign"][0].id
    alloc = {
        "containerIndex": 0,
        "deviceIndex": 0,
        "gpuUUID": uuid,
        "profile": profile,
        "placement": {"start": start, "size": size},
        "migUUID": f"MIG-{name}",
        "gpuInstanceID": start,
        "computeInstanceID": 0,
    }
    return _bound(
        name,
        "mign",
        {GPU: 1, GPUMEM: 4000},
        {
            ann.VGPU_MODE: "mig",
            ann.DEVICES_ALLOCATED: f"{uuid},NVIDIA,4864,15:;",
            ann.DEVICES_TO_ALLOCATE: ";",
            ann.MIG_ALLOCATIONS: json.dumps([alloc]),
        },
    )


def test_clean_allocations_pass() -> None:
    pods = [_shared("a", 0, 20000), _shared("b", 0, 20000), _mig("m", 0, 1, "1g.5gb")]
    assert not capacity_violations(rebuild_state([CORE, MIGN], pods))
    for p in pods:
        assert not annotation_violations(p, REGISTERS), annotation_violations(p, REGISTERS)


def test_overcommit_and_overlap_are_caught() -> None:
    pods = [
        _shared("a", 0, 30000),
        _shared("b", 0, 20000),
        _mig("m1", 0, 2, "2g.10gb"),
        _mig("m2", 1, 1, "1g.5gb"),
    ]
    found = "\n".join(capacity_violations(rebuild_state([CORE, MIGN], pods)))
    assert "core/GPU 0 (hami-core): 50000 MiB > devmem 40960" in found, found
    assert "mign/GPU 0 (mig): 1 MIG slices used twice" in found, found


def test_annotation_problems_are_caught() -> None:
    wrong_node = _shared("x", 0, 1000)
    wrong_node["spec"]["nodeName"] = "mign"
    wrong_node["metadata"]["annotations"][ann.VGPU_NODE] = "mign"
    assert any("is not a GPU of mign" in v for v in annotation_violations(wrong_node, REGISTERS))
    illegal = _mig("y", 1, 2, "2g.10gb")  # 2g.10gb starts at 0, 2, 4 only
    assert any("not a legal placement" in v for v in annotation_violations(illegal, REGISTERS))
    no_runtime = _mig("z", 2, 1, "1g.5gb")
    raw = json.loads(no_runtime["metadata"]["annotations"][ann.MIG_ALLOCATIONS])
    for k in ("migUUID", "gpuInstanceID", "computeInstanceID"):
        del raw[0][k]
    no_runtime["metadata"]["annotations"][ann.MIG_ALLOCATIONS] = json.dumps(raw)
    assert any("no runtime identity" in v for v in annotation_violations(no_runtime, REGISTERS))
