"""Annotation and label keys, and closed value sets, of the HAMi-compatible Kubernetes contract
(HAMi v2.10; docs/hami-compatibility.md lists what Tessera does with each)."""

from __future__ import annotations

from typing import Final, Literal

# Node annotations.
NODE_REGISTER: Final = "hami.io/node-nvidia-register"
NODE_PAIR_SCORES: Final = "hami.io/node-nvidia-score"  # GPU pair scores, for topology-aware
DEVICE_CORDON: Final = "hami.io/device-cordon"  # GPUs that take no new allocation

# Pod annotations the scheduler writes (VGPU_NODE is also a pod label of the same name).

VGPU_NODE: Final = "hami.io/vgpu-node"
VGPU_NODE_LABEL: Final = VGPU_NODE  # the same key, as a pod label
BIND_TIME: Final = "hami.io/bind-time"
BIND_PHASE: Final = "hami.io/bind-phase"
DEVICES_ALLOCATED: Final = "hami.io/vgpu-devices-allocated"
DEVICES_TO_ALLOCATE: Final = "hami.io/vgpu-devices-to-allocate"
MIG_ALLOCATIONS: Final = "hami.io/vgpu-mig-allocations"

# Pod annotations users write.
VGPU_MODE: Final = "nvidia.com/vgpu-mode"
NODE_POLICY: Final = "hami.io/node-scheduler-policy"
GPU_POLICY: Final = "hami.io/gpu-scheduler-policy"
USE_GPUTYPE: Final = "nvidia.com/use-gputype"
NOUSE_GPUTYPE: Final = "nvidia.com/nouse-gputype"
USE_GPUUUID: Final = "nvidia.com/use-gpuuuid"
NOUSE_GPUUUID: Final = "nvidia.com/nouse-gpuuuid"
NUMA_BIND: Final = "nvidia.com/numa-bind"
SCORING_WEIGHTS: Final = "hami.io/device-scoring-weights"
# The user annotations a placement decision reads (``parse_request``): the shim signs a pod by
# them and requeues a pod Tessera rejected when one of them changes (its ``policyAnnotations``).
DECISION_ANNOTATIONS: Final = (
    VGPU_MODE,
    NODE_POLICY,
    GPU_POLICY,
    USE_GPUTYPE,
    NOUSE_GPUTYPE,
    USE_GPUUUID,
    NOUSE_GPUUUID,
    NUMA_BIND,
    SCORING_WEIGHTS,
)

# Annotations only Tessera's components may write; users presetting them are rejected.
INTERNAL_PREFIXES: Final = ("hami.io/vgpu-", "hami.io/bind-")

BindPhase = Literal["allocating", "success", "failed"]
BIND_PHASES: Final[tuple[BindPhase, ...]] = ("allocating", "success", "failed")

GpuMode = Literal["hami-core", "mig", "mps"]
GPU_MODES: Final[tuple[GpuMode, ...]] = ("hami-core", "mig", "mps")
# Clients one MPS control daemon serves at once on Volta and newer GPUs (CUDA's limit): an MPS
# GPU registers at most this many slots, whatever deviceSplitCount says.
MPS_MAX_CLIENTS: Final = 48


# The longest value a Kubernetes label may have; node names may be up to 253 characters.
LABEL_VALUE_MAX: Final = 63


def vgpu_node_labels(node: str) -> dict[str, str]:
    """The ``hami.io/vgpu-node`` pod label for a pod placed on ``node``: none where the name is
    longer than a label value may be (the API server would refuse the whole write, and the
    pod would never bind). HAMi's monitor, which lists a node's pods by the label, then does
    not see that node's pods; Tessera's own components never select by it."""
    return {VGPU_NODE_LABEL: node} if len(node) <= LABEL_VALUE_MAX else {}


def parse_gpu_mode(value: str) -> GpuMode | None:
    """The GPU mode named exactly ``value``, or None if it names none."""
    for mode in GPU_MODES:
        if value == mode:
            return mode
    return None


def modes_named(value: str) -> frozenset[GpuMode]:
    """The GPU modes a pod's ``nvidia.com/vgpu-mode`` accepts: HAMi's rule, a GPU's mode is
    accepted when the value contains its name (``hami-core,mig`` accepts both)."""
    return frozenset(m for m in GPU_MODES if m in value)


_GO_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_go_bool(value: str) -> bool | None:
    """A boolean as Go's ``strconv.ParseBool`` reads it (HAMi's annotations); None if it is
    none of its spellings."""
    if value in _GO_TRUE:
        return True
    if value in _GO_FALSE:
        return False
    return None
