"""Node registration: publishes ``hami.io/node-nvidia-register`` and ``hami.io/node-handshake``.

``Registrar.sync`` discovers the GPUs through NVML (with the node's operating mode, split
count and memory scaling from the device config; in ``mps`` mode a GPU is healthy only
while its MPS control daemon is up, as ``MpsDaemons`` last saw it), reads the node's
current annotations
and patches only when the register value differs (so a health change shows up at the
next sync, an unchanged node costs one GET). The handshake (``Reported <time>``) is
written with every register change and whenever the scheduler asked for one (a value
not starting with ``Reported``). ``run`` syncs periodically until stopped.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, Protocol

import structlog

from api.errors import TesseraError
from api.hami.config import DeviceConfig
from api.hami.keys import NODE_REGISTER
from api.hami.register import GpuDevice, encode
from node_agent.mps.manager import MpsDaemons
from node_agent.nvml.backend import NvmlBackend
from node_agent.nvml.discovery import discover

log = structlog.get_logger(__name__)

HANDSHAKE: Final = "hami.io/node-handshake"
REPORTED: Final = "Reported"


class NodeApi(Protocol):
    def get(self, path: str) -> Any: ...

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any: ...


class Registrar:
    def __init__(
        self,
        node_name: str,
        kube: NodeApi,
        backend: NvmlBackend,
        config: DeviceConfig,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        mps: MpsDaemons | None = None,
    ) -> None:
        self.node_name = node_name
        self._kube = kube
        self._backend = backend
        self._config = config
        self._now = now
        self._mps = mps
        node = config.node(node_name)
        self._mode = node.operating_mode
        self._split = node.device_split_count or config.device_split_count
        self._scaling = node.device_memory_scaling or config.device_memory_scaling
        self._core_scaling = node.device_core_scaling or config.device_core_scaling
        self._registers = node.registers

    def devices(self) -> tuple[GpuDevice, ...]:
        """The GPUs as registered; in mps mode a GPU whose daemon is down (or that has no
        daemon manager to vouch for it) is unhealthy."""
        found = self.discovered()
        if self._mode != "mps":
            return found
        mps = self._mps
        return tuple(
            dataclasses.replace(d, health=d.health and mps is not None and mps.healthy(d.id))
            for d in found
        )

    def mps_gpus(self) -> tuple[str, ...]:
        """The GPUs that need an MPS control daemon: every registered one in mps mode."""
        if self._mode != "mps":
            return ()
        return tuple(d.id for d in self.discovered())

    def discovered(self) -> tuple[GpuDevice, ...]:
        """The GPUs as NVML shows them (health from NVML alone)."""
        return discover(
            self._backend,
            self._config.allowed_profiles,
            self._mode,
            self._split,
            self._scaling,
            core_scaling=self._core_scaling,
            registers=self._registers,
        )

    def sync(self) -> bool:
        """Publish if anything changed; True when a patch was sent."""
        value = encode(self.devices())
        path = f"/api/v1/nodes/{self.node_name}"
        node = self._kube.get(path)
        current: Mapping[str, str] = (node.get("metadata") or {}).get("annotations") or {}
        patch: dict[str, str] = {}
        if current.get(NODE_REGISTER) != value:
            patch[NODE_REGISTER] = value
        if patch or not str(current.get(HANDSHAKE, "")).startswith(REPORTED):
            patch[HANDSHAKE] = f"{REPORTED} {self._now().strftime('%Y-%m-%dT%H:%M:%SZ')}"
        if not patch:
            return False
        self._kube.merge_patch(path, {"metadata": {"annotations": patch}})
        log.info("register.published", node=self.node_name, keys=sorted(patch))
        return True

    def run(self, stop: threading.Event, interval_s: float = 30.0) -> None:
        """Sync every ``interval_s`` until ``stop`` is set; errors are logged and retried."""
        while not stop.is_set():
            try:
                self.sync()
            except TesseraError as e:
                log.warning("register.failed", node=self.node_name, error=str(e))
            stop.wait(interval_s)
