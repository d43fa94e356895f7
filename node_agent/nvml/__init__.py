"""The node agent's NVML backends and the factory that picks one from config or env.

``TESSERA_NVML=real|simulated`` picks the backend; the simulated one takes its GPUs from
``TESSERA_SIM_GPUS`` (comma-separated catalog models, e.g. ``A100-PCIE-40GB,A100-PCIE-40GB``)
and persists its state to ``TESSERA_SIM_STATE`` when set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from api.errors import InvalidConfigError
from api.hami.catalog import UnknownModelError, find_model
from node_agent.nvml.backend import (
    ComputeInstance,
    DeviceInfo,
    GpuInstance,
    GpuInstanceProfileInfo,
    MigMode,
    NvmlBackend,
)
from node_agent.nvml.errors import (
    InsufficientResources,
    InUse,
    InvalidArgument,
    NotFound,
    NotSupported,
    NvmlError,
    NvmlUnavailable,
    Uninitialized,
)
from node_agent.nvml.real import PynvmlBackend
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml

__all__ = [
    "BACKEND_KINDS",
    "BackendKind",
    "ComputeInstance",
    "DeviceInfo",
    "GpuInstance",
    "GpuInstanceProfileInfo",
    "InUse",
    "InsufficientResources",
    "InvalidArgument",
    "MigMode",
    "NotFound",
    "NotSupported",
    "NvmlBackend",
    "NvmlError",
    "NvmlUnavailable",
    "PynvmlBackend",
    "SimulatedGpuSpec",
    "SimulatedNvml",
    "Uninitialized",
    "backend_from_env",
    "make_backend",
]

BackendKind = Literal["real", "simulated"]

ENV_KIND: Final = "TESSERA_NVML"
ENV_SIM_GPUS: Final = "TESSERA_SIM_GPUS"
ENV_SIM_STATE: Final = "TESSERA_SIM_STATE"


@dataclass(frozen=True)
class _Options:
    gpus: tuple[SimulatedGpuSpec, ...]
    state_file: Path | None
    node_name: str
    pynvml_module: Any


def _real(o: _Options) -> NvmlBackend:
    return PynvmlBackend(o.pynvml_module)


def _simulated(o: _Options) -> NvmlBackend:
    return SimulatedNvml(list(o.gpus), o.state_file, node_name=o.node_name)


_FACTORIES: Final[dict[str, Callable[[_Options], NvmlBackend]]] = {
    "real": _real,
    "simulated": _simulated,
}
BACKEND_KINDS: Final[tuple[str, ...]] = tuple(_FACTORIES)


def make_backend(
    kind: str,
    *,
    gpus: Sequence[SimulatedGpuSpec] = (),
    state_file: Path | None = None,
    node_name: str = "tessera-sim",
    pynvml_module: Any = None,
    field: str = "nvmlBackend",
) -> NvmlBackend:
    """The backend of ``kind``; ``field`` names the config field in errors."""
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise InvalidConfigError(
            field, f"unknown NVML backend {kind!r}; valid: {', '.join(BACKEND_KINDS)}"
        )
    if kind == "simulated" and not gpus:
        raise InvalidConfigError(field, "the simulated NVML backend needs at least one GPU")
    return factory(_Options(tuple(gpus), state_file, node_name, pynvml_module))


def backend_from_env(
    env: Mapping[str, str] | None = None,
    *,
    node_name: str = "tessera-sim",
    default_kind: BackendKind = "real",
) -> NvmlBackend:
    """The backend ``TESSERA_NVML`` (default ``default_kind``) selects."""
    env = os.environ if env is None else env
    kind = env.get(ENV_KIND, "").strip() or default_kind
    gpus: list[SimulatedGpuSpec] = []
    if kind == "simulated":
        names = [n.strip() for n in env.get(ENV_SIM_GPUS, "").split(",") if n.strip()]
        if not names:
            raise InvalidConfigError(
                ENV_SIM_GPUS,
                "set it to a comma-separated list of GPU models,"
                " e.g. A100-PCIE-40GB,A100-PCIE-40GB",
            )
        for name in names:
            try:
                gpus.append(SimulatedGpuSpec(find_model(name).name))
            except UnknownModelError as e:
                raise InvalidConfigError(ENV_SIM_GPUS, str(e)) from e
    state = env.get(ENV_SIM_STATE, "").strip()
    return make_backend(
        kind,
        gpus=gpus,
        state_file=Path(state) if state else None,
        node_name=node_name,
        field=ENV_KIND,
    )
