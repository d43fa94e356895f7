"""Hardware facts of MIG-capable (and a few plain) NVIDIA GPU models.

These are the facts the simulated NVML backend serves and the fake kwok nodes register:
per model the NVML device name, memory, SM count, memory-slice count and per MIG profile
its NVML profile index constant, profile id, slices, max instances, SMs, memory and legal
placements. Sources: NVIDIA's MIG user guide, ``nvml.h`` and published
``nvidia-smi mig -lgip/-lgipp`` outputs (see ``shared/reference/mig-geometry.md``); rows
marked *inferred* there (H20 SMs, B200 tail, H200 placements) follow the H100 pattern.
The scheduler never reads this module: it only sees what a node registers.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from api.hami.config import DeviceConfig
from api.hami.keys import GPU_MODES, GpuMode, parse_gpu_mode
from api.hami.register import (
    GpuDevice,
    MigProfile,
    Placement,
    encode,
    registered_count,
    registered_type,
)

# NVML profile *index* constants (NVML_GPU_INSTANCE_PROFILE_*).
IDX_1_SLICE = 0
IDX_2_SLICE = 1
IDX_3_SLICE = 2
IDX_4_SLICE = 3
IDX_7_SLICE = 4
IDX_1_SLICE_REV1 = 7  # +me
IDX_1_SLICE_REV2 = 9  # 1g with double memory


@dataclass(frozen=True)
class ProfileFact:
    name: str
    profile_index: int
    profile_id: int
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    memory_mib: int
    placement_starts: tuple[int, ...]
    placement_size: int

    def placements(self) -> tuple[Placement, ...]:
        return tuple(Placement(s, self.placement_size) for s in self.placement_starts)


@dataclass(frozen=True)
class GpuModel:
    """One GPU model; ``name`` is what NVML's ``nvmlDeviceGetName`` returns."""

    name: str
    memory_mib: int
    multiprocessor_count: int
    memory_slices: int
    profiles: tuple[ProfileFact, ...]

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    def profile(self, name: str) -> ProfileFact | None:
        return next((p for p in self.profiles if p.name == name), None)

    def mig_profile(self, fact: ProfileFact) -> MigProfile:
        """The scheduler-facing view of a profile (``core`` as the contract defines it)."""
        return MigProfile(
            name=fact.name,
            memory_mb=fact.memory_mib,
            core=math.ceil(fact.multiprocessor_count * 100 / self.multiprocessor_count),
            slice_count=fact.slice_count,
            placements=fact.placements(),
        )


def _eight_slice(
    names: tuple[str, str, str, str, str, str, str],
    mems: tuple[int, int, int, int, int],
    sms: tuple[int, int, int, int, int, int],
) -> tuple[ProfileFact, ...]:
    """Profiles of an 8-memory-slice GPU (A100/H100/H200/H20/B200 family).

    names: 1g, 1g+me, 1g-double, 2g, 3g, 4g, 7g; mems: 1g, 1g-double(=2g), 3g(=4g), 7g, unused;
    sms: 1g, 1g-double, 2g, 3g, 4g, 7g.
    """
    n1, n1me, n1d, n2, n3, n4, n7 = names
    m1, m2, m3, m7, _ = mems
    s1, s1d, s2, s3, s4, s7 = sms
    return (
        ProfileFact(n1, IDX_1_SLICE, 19, 1, 7, s1, m1, (0, 1, 2, 3, 4, 5, 6), 1),
        ProfileFact(n1me, IDX_1_SLICE_REV1, 20, 1, 1, s1, m1, (0, 1, 2, 3, 4, 5, 6), 1),
        ProfileFact(n1d, IDX_1_SLICE_REV2, 15, 1, 4, s1d, m2, (0, 2, 4, 6), 2),
        ProfileFact(n2, IDX_2_SLICE, 14, 2, 3, s2, m2, (0, 2, 4), 2),
        ProfileFact(n3, IDX_3_SLICE, 9, 3, 2, s3, m3, (0, 4), 4),
        ProfileFact(n4, IDX_4_SLICE, 5, 4, 1, s4, m3, (0,), 4),
        ProfileFact(n7, IDX_7_SLICE, 0, 7, 1, s7, m7, (0,), 8),
    )


_A100_40 = _eight_slice(
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    (4864, 9984, 20096, 40448, 0),
    (14, 14, 28, 42, 56, 98),
)
_A100_80 = _eight_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9728, 19968, 40192, 80896, 0),
    (14, 14, 28, 42, 56, 98),
)
_H100_80 = _eight_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 20096, 40448, 81152, 0),
    (16, 26, 32, 60, 64, 132),
)
_H100_PCIE = _eight_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 20096, 40448, 81152, 0),
    (14, 24, 30, 46, 62, 114),
)
_H100_94 = _eight_slice(
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    (11008, 22144, 47488, 95360, 0),
    (16, 26, 32, 60, 64, 132),
)
_H200 = _eight_slice(
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (16384, 33024, 71168, 143360, 0),
    (16, 26, 32, 60, 64, 132),
)
# H20: per-profile SMs unpublished; scaled from H100 (132 SMs) to 78 SMs (inferred).
_H20 = _eight_slice(
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    (11264, 23552, 48128, 97280, 0),
    (9, 15, 19, 35, 38, 78),
)
_B200 = _eight_slice(
    ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    (22528, 45312, 91136, 182784, 0),
    (18, 30, 36, 72, 72, 148),
)
_A30 = (
    ProfileFact("1g.6gb", IDX_1_SLICE, 14, 1, 4, 14, 5952, (0, 1, 2, 3), 1),
    ProfileFact("1g.6gb+me", IDX_1_SLICE_REV1, 21, 1, 1, 14, 5952, (0, 1, 2, 3), 1),
    ProfileFact("2g.12gb", IDX_2_SLICE, 5, 2, 2, 28, 11968, (0, 2), 2),
    ProfileFact("4g.24gb", IDX_4_SLICE, 0, 4, 1, 56, 24000, (0,), 4),
)
_RTX_PRO_6000 = (
    ProfileFact("1g.24gb", IDX_1_SLICE, 14, 1, 4, 46, 24192, (0, 3, 6, 9), 3),
    ProfileFact("1g.24gb+me", IDX_1_SLICE_REV1, 21, 1, 1, 46, 24192, (0, 3, 6, 9), 3),
    ProfileFact("2g.48gb", IDX_2_SLICE, 5, 2, 2, 94, 48512, (0, 6), 6),
    ProfileFact("4g.96gb", IDX_4_SLICE, 0, 4, 1, 188, 97280, (0,), 12),
)

MODELS: tuple[GpuModel, ...] = (
    GpuModel("NVIDIA A100-PCIE-40GB", 40960, 98, 8, _A100_40),
    GpuModel("NVIDIA A100-SXM4-40GB", 40960, 98, 8, _A100_40),
    GpuModel("NVIDIA A100-SXM4-80GB", 81920, 98, 8, _A100_80),
    GpuModel("NVIDIA A100 80GB PCIe", 81920, 98, 8, _A100_80),
    GpuModel("NVIDIA H100 80GB HBM3", 81559, 132, 8, _H100_80),
    GpuModel("NVIDIA H100 PCIe", 81559, 114, 8, _H100_PCIE),
    GpuModel("NVIDIA H100 NVL", 95830, 132, 8, _H100_94),
    GpuModel("NVIDIA H200", 143771, 132, 8, _H200),
    GpuModel("NVIDIA H20", 97871, 78, 8, _H20),
    GpuModel("NVIDIA B200", 183359, 148, 8, _B200),
    GpuModel("NVIDIA A30", 24576, 56, 4, _A30),
    GpuModel("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, 188, 12, _RTX_PRO_6000),
    GpuModel("NVIDIA L4", 23034, 58, 0, ()),
    GpuModel("Tesla V100-PCIE-32GB", 32768, 80, 0, ()),
)

_BY_NAME = {m.name: m for m in MODELS}


class UnknownModelError(LookupError):
    pass


def find_model(name: str) -> GpuModel:
    """Exact NVML name, or a unique case-insensitive substring of one (``"H200"``)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    hits = [m for m in MODELS if name.upper() in m.name.upper()]
    exact_suffix = [m for m in hits if m.name.upper().endswith(name.upper())]
    if len(hits) == 1:
        return hits[0]
    if len(exact_suffix) == 1:
        return exact_suffix[0]
    known = ", ".join(m.name for m in MODELS)
    if not hits:
        raise UnknownModelError(f"unknown GPU model {name!r}; known models: {known}")
    raise UnknownModelError(f"GPU model {name!r} is ambiguous: {', '.join(m.name for m in hits)}")


def simulated_gpu_uuid(node_name: str, index: int) -> str:
    """A stable ``GPU-…`` UUID for a simulated GPU (same node and index, same UUID)."""
    h = hashlib.sha1(f"{node_name}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def simulated_numa(index: int, gpu_count: int) -> int:
    """NUMA node of a simulated GPU: one node up to 4 GPUs, else two halves."""
    return 0 if gpu_count <= 4 else index * 2 // gpu_count


def simulated_devices(
    node_name: str, model: str, gpu_count: int, mode: GpuMode, config: DeviceConfig | None = None
) -> tuple[GpuDevice, ...]:
    """The GPUs a node of ``gpu_count`` × ``model`` registers in ``mode`` under ``config``.

    ``migProfiles`` lists the allowlisted profiles the model resolves, only in mig mode (a
    model with none registers no GPU there; ``count`` is the most instances of one);
    memory scaling applies in hami-core and mps mode, and an mps GPU has at most
    ``MPS_MAX_CLIENTS`` slots (as the node agent's discovery registers them).
    """
    cfg = config or DeviceConfig()
    m = find_model(model)
    node_cfg = cfg.node(node_name)
    split = node_cfg.device_split_count or cfg.device_split_count
    scaling = node_cfg.device_memory_scaling or cfg.device_memory_scaling
    allowed = cfg.allowed_profiles(m.name)
    facts = [f for name in allowed if (f := m.profile(name)) is not None] if mode == "mig" else []
    profiles = tuple(m.mig_profile(fact) for fact in facts)
    count = registered_count(mode, split, [fact.instance_count for fact in facts])
    if mode == "mig" and not profiles:
        return ()  # nothing to register in mig mode (as the node agent's discovery)
    return tuple(
        GpuDevice(
            id=simulated_gpu_uuid(node_name, i),
            index=i,
            count=count,
            devmem=int(m.memory_mib * (scaling if mode in ("hami-core", "mps") else 1.0)),
            devcore=100,
            type=registered_type(m.name),
            numa=simulated_numa(i, gpu_count),
            health=True,
            mode=mode,
            mig_profiles=profiles,
        )
        for i in range(gpu_count)
    )


def simulated_register_json(
    node_name: str, model: str, gpu_count: int, mode: str, config: DeviceConfig | None = None
) -> str:
    """The exact ``hami.io/node-nvidia-register`` value of such a simulated node."""
    gpu_mode = parse_gpu_mode(mode)
    if gpu_mode is None:
        raise ValueError(f"operating mode {mode!r} is not one of {', '.join(GPU_MODES)}")
    return encode(simulated_devices(node_name, model, gpu_count, gpu_mode, config))
