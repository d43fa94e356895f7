"""Values and injected interfaces of the kubelet device plugin.

Nothing outside ``server.py`` sees protobuf: the agent answers Allocate with
``ContainerAllocation`` values through an ``AllocateHandler`` and publishes its devices
through a ``DeviceInventory``; the servicer translates both to and from the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into the container."""

    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceSpec:
    """A device node made available in the container; ``permissions`` is cgroup ``rwm``."""

    container_path: str
    host_path: str
    permissions: str


@dataclass(frozen=True)
class ContainerAllocation:
    """What the runtime must set up for one container of an Allocate request."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PluginDevice:
    """One device as advertised to the kubelet; ``numa`` < 0 means unknown (no topology)."""

    id: str
    healthy: bool
    numa: int


class AllocateHandler(Protocol):
    """The agent's side of Allocate and PreStartContainer.

    Failures are raised as ``TesseraError`` subclasses; the servicer turns them into a gRPC
    error carrying the message (``InvalidInputError`` → INVALID_ARGUMENT, ``TemporaryError`` →
    UNAVAILABLE, any other → FAILED_PRECONDITION).
    """

    def allocate(self, containers: Sequence[Sequence[str]]) -> Sequence[ContainerAllocation]:
        """One allocation per container request, in order; ids exactly as the kubelet sent."""
        ...

    def pre_start(self, device_ids: Sequence[str]) -> None:
        """Called before a container using ``device_ids`` starts."""
        ...


class DeviceInventory(Protocol):
    """The devices the plugin advertises, versioned so ListAndWatch can push changes."""

    def version(self) -> int:
        """The current version; it grows on every change of ``devices()``."""
        ...

    def devices(self) -> Sequence[PluginDevice]:
        """The full current device list."""
        ...

    def wait_changed(self, version: int, timeout: float) -> int:
        """Block until the version differs from ``version`` or ``timeout`` seconds pass.

        Returns the version now current (equal to ``version`` on timeout).
        """
        ...
