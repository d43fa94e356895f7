"""Test builders: ``make_node("n").with_gpus(...)``, ``make_pod("p").gpu(1, mem=1000)``."""

from __future__ import annotations

import json
from typing import Any

from api.hami.catalog import find_model
from api.hami.config import DeviceConfig
from api.hami.keys import GpuMode
from api.hami.register import GpuDevice
from scheduler_plugins.core.state import ClusterState


def gpu(
    uuid: str,
    *,
    index: int = 0,
    count: int = 10,
    mem: int = 8192,
    cores: int = 100,
    type: str = "NVIDIA Tesla V100-PCIE-32GB",
    healthy: bool = True,
    numa: int = 0,
) -> GpuDevice:
    return GpuDevice(uuid, index, count, mem, cores, type, numa, healthy, "hami-core")


def mps_gpu(
    uuid: str,
    *,
    index: int = 0,
    count: int = 10,
    mem: int = 8192,
    cores: int = 100,
    type: str = "NVIDIA Tesla V100-PCIE-32GB",
    healthy: bool = True,
    numa: int = 0,
) -> GpuDevice:
    """A GPU as an MPS node registers it: ``count`` client slots (at most ``MPS_MAX_CLIENTS``),
    memory and cores like hami-core, ``health`` false while its MPS control daemon is down."""
    return GpuDevice(uuid, index, count, mem, cores, type, numa, healthy, "mps")


def mig_gpu(
    uuid: str, model: str = "A100-PCIE-40GB", *, index: int = 0, config: DeviceConfig | None = None
) -> GpuDevice:
    m = find_model(model)
    allowed = set((config or DeviceConfig()).allowed_profiles(m.name))
    profiles = tuple(m.mig_profile(p) for p in m.profiles if p.name in allowed)
    return GpuDevice(uuid, index, 10, m.memory_mib, 100, m.name, 0, True, "mig", profiles)


class PodBuilder:
    def __init__(self, name: str, namespace: str = "default") -> None:
        self.obj: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": {}},
            "spec": {"containers": []},
        }

    def container(self, name: str = "", init: bool = False, **limits: Any) -> PodBuilder:
        spec = self.obj["spec"]
        field = "initContainers" if init else "containers"
        items = spec.setdefault(field, [])
        items.append({"name": name or f"c{len(items)}", "resources": {"limits": dict(limits)}})
        return self

    def gpu(
        self,
        count: int | None = 1,
        *,
        mem: int | None = None,
        pct: int | None = None,
        cores: int | None = None,
    ) -> PodBuilder:
        limits: dict[str, Any] = {}
        if count is not None:
            limits["nvidia.com/gpu"] = count
        if mem is not None:
            limits["nvidia.com/gpumem"] = mem
        if pct is not None:
            limits["nvidia.com/gpumem-percentage"] = pct
        if cores is not None:
            limits["nvidia.com/gpucores"] = cores
        self.obj["spec"]["containers"].append(
            {"name": f"c{len(self.obj['spec']['containers'])}", "resources": {"limits": limits}}
        )
        return self

    def annotate(self, key: str, value: str) -> PodBuilder:
        self.obj["metadata"]["annotations"][key] = value
        return self

    def mode(self, mode: GpuMode) -> PodBuilder:
        return self.annotate("nvidia.com/vgpu-mode", mode)

    def on(self, node: str, phase: str = "Running") -> PodBuilder:
        self.obj["spec"]["nodeName"] = node
        self.obj["status"] = {"phase": phase}
        return self

    def mig_allocations(self, entries: list[dict[str, Any]]) -> PodBuilder:
        return self.annotate("hami.io/vgpu-mig-allocations", json.dumps(entries))

    def build(self) -> dict[str, Any]:
        return self.obj


def make_pod(name: str, namespace: str = "default") -> PodBuilder:
    return PodBuilder(name, namespace)


def state_with(config: DeviceConfig | None = None, **nodes: tuple[GpuDevice, ...]) -> ClusterState:
    state = ClusterState(config or DeviceConfig())
    for name, devices in nodes.items():
        state.upsert_node(name.replace("_", "-"), devices)
    return state
