"""MPS (CUDA Multi-Process Service) control daemons behind an injected backend, and the
factory that picks one.

``TESSERA_MPS=real|simulated`` picks the backend (default: the kind ``TESSERA_NVML``
picks, so a simulated node gets simulated daemons). Both keep their files under the MPS
root (``--mps-root``, default ``/var/lib/tessera/mps``): the real one the daemons' pipe and
log directories, the simulated one its state and fault files as well.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from api.errors import InvalidConfigError
from node_agent.mps.backend import CONTAINER_PIPE_ROOT, DEFAULT_ROOT, MpsBackend, MpsLayout
from node_agent.mps.errors import (
    MpsAlreadyRunningError,
    MpsClientLimitError,
    MpsDaemonDownError,
    MpsError,
    MpsNotRunningError,
    MpsStartError,
    MpsUnavailableError,
)
from node_agent.mps.manager import MpsDaemons
from node_agent.mps.real import ControlDaemons
from node_agent.mps.simulated import SimulatedMps

__all__ = [
    "BACKEND_KINDS",
    "CONTAINER_PIPE_ROOT",
    "DEFAULT_ROOT",
    "ControlDaemons",
    "MpsAlreadyRunningError",
    "MpsBackend",
    "MpsClientLimitError",
    "MpsDaemonDownError",
    "MpsDaemons",
    "MpsError",
    "MpsLayout",
    "MpsNotRunningError",
    "MpsStartError",
    "MpsUnavailableError",
    "SimulatedMps",
    "make_mps_backend",
    "mps_backend_from_env",
]

ENV_KIND: Final = "TESSERA_MPS"
ENV_NVML_KIND: Final = "TESSERA_NVML"


def _real(root: Path, node_name: str) -> MpsBackend:
    return ControlDaemons(MpsLayout(root))


def _simulated(root: Path, node_name: str) -> MpsBackend:
    return SimulatedMps(root, node_name=node_name)


_FACTORIES: Final[dict[str, Callable[[Path, str], MpsBackend]]] = {
    "real": _real,
    "simulated": _simulated,
}
BACKEND_KINDS: Final[tuple[str, ...]] = tuple(_FACTORIES)


def make_mps_backend(
    kind: str, *, root: Path = DEFAULT_ROOT, node_name: str = "tessera-sim", field: str = ENV_KIND
) -> MpsBackend:
    """The backend of ``kind`` over ``root``; ``field`` names the setting in errors."""
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise InvalidConfigError(
            field, f"unknown MPS backend {kind!r}; valid: {', '.join(BACKEND_KINDS)}"
        )
    return factory(root, node_name)


def mps_backend_from_env(
    env: Mapping[str, str] | None = None,
    *,
    root: Path = DEFAULT_ROOT,
    node_name: str = "tessera-sim",
) -> MpsBackend:
    """The backend ``TESSERA_MPS`` selects (default: ``TESSERA_NVML``'s kind, else real)."""
    env = os.environ if env is None else env
    kind = env.get(ENV_KIND, "").strip() or env.get(ENV_NVML_KIND, "").strip() or "real"
    return make_mps_backend(kind, root=root, node_name=node_name)
