"""Annotation keys and closed value sets of the HAMi-compatible Kubernetes contract."""

from __future__ import annotations

from typing import Final, Literal

NODE_REGISTER: Final = "hami.io/node-nvidia-register"

VGPU_NODE: Final = "hami.io/vgpu-node"
BIND_TIME: Final = "hami.io/bind-time"
BIND_PHASE: Final = "hami.io/bind-phase"
DEVICES_ALLOCATED: Final = "hami.io/vgpu-devices-allocated"
DEVICES_TO_ALLOCATE: Final = "hami.io/vgpu-devices-to-allocate"
MIG_ALLOCATIONS: Final = "hami.io/vgpu-mig-allocations"

VGPU_MODE: Final = "nvidia.com/vgpu-mode"
NODE_POLICY: Final = "hami.io/node-scheduler-policy"
GPU_POLICY: Final = "hami.io/gpu-scheduler-policy"
USE_GPUTYPE: Final = "nvidia.com/use-gputype"
NOUSE_GPUTYPE: Final = "nvidia.com/nouse-gputype"
USE_GPUUUID: Final = "nvidia.com/use-gpuuuid"
NOUSE_GPUUUID: Final = "nvidia.com/nouse-gpuuuid"

# Annotations only Tessera's components may write; users presetting them are rejected.
INTERNAL_PREFIXES: Final = ("hami.io/vgpu-", "hami.io/bind-")

BindPhase = Literal["allocating", "success", "failed"]
BIND_PHASES: Final[tuple[BindPhase, ...]] = ("allocating", "success", "failed")

GpuMode = Literal["hami-core", "mig"]
GPU_MODES: Final[tuple[GpuMode, ...]] = ("hami-core", "mig")


def parse_gpu_mode(value: str) -> GpuMode | None:
    """The GPU mode named ``value``, or None if it names none."""
    if value == "hami-core":
        return "hami-core"
    if value == "mig":
        return "mig"
    return None
