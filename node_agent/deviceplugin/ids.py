"""The device ids Tessera exposes to the kubelet, and the inventory built from them.

A GPU shared ``count`` ways is advertised as ``count`` devices ``f"{gpu_uuid}-{slot}"``,
slot 0..count-1 (HAMi's scheme, so kubelet checkpoints survive a switch between the two).
The kubelet only counts these ids: which GPU a pod really gets comes from its scheduler
reservation, not from the slot. Every slot of an unhealthy GPU is advertised Unhealthy, and
each slot carries its GPU's NUMA node.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence

from api.errors import InvalidInputError, short_repr
from api.hami.register import GpuDevice
from node_agent.deviceplugin.types import PluginDevice

# Slot is canonical decimal (no sign, no leading zeros) so parse∘format is the identity, and
# at most 9 digits (int() refuses more than 4300); the UUID part is greedy because GPU UUIDs
# contain dashes themselves.
_DEVICE_ID = re.compile(r"(?P<uuid>\S+)-(?P<slot>0|[1-9][0-9]{0,8})")


class InvalidDeviceIdError(InvalidInputError):
    """A device id is not ``<gpu-uuid>-<slot>`` or is not one this plugin advertises."""

    def __init__(self, device_id: str, problem: str) -> None:
        self.device_id = device_id
        self.problem = problem
        super().__init__(f"device id {short_repr(device_id)}: {problem}")


def device_id(gpu_uuid: str, slot: int) -> str:
    """The kubelet device id of ``slot`` on GPU ``gpu_uuid``."""
    if not gpu_uuid or any(c.isspace() for c in gpu_uuid):
        raise InvalidInputError(
            f"GPU uuid {short_repr(gpu_uuid)}: must be non-empty without whitespace"
        )
    if slot < 0:
        raise InvalidInputError(f"GPU {gpu_uuid}: slot {slot} must be >= 0")
    return f"{gpu_uuid}-{slot}"


def gpu_of(device_id: str) -> tuple[str, int]:
    """``(gpu_uuid, slot)`` of a device id; ``InvalidDeviceIdError`` if it is malformed."""
    m = _DEVICE_ID.fullmatch(device_id)
    if m is None:
        raise InvalidDeviceIdError(
            device_id, "expected <gpu-uuid>-<slot> with a decimal slot, e.g. GPU-1f2e…-0"
        )
    return m["uuid"], int(m["slot"])


def plugin_devices(gpus: Iterable[GpuDevice]) -> tuple[PluginDevice, ...]:
    """The devices advertised for ``gpus``: one per slot, in GPU then slot order."""
    return tuple(
        PluginDevice(id=device_id(g.id, slot), healthy=g.health, numa=g.numa)
        for g in gpus
        for slot in range(g.count)
    )


def prefer_spread(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The preferred ``size`` device ids: every ``must_include`` id, then spread over GPUs.

    After the must-include ids (kept in their order, duplicates dropped), slots are added
    one at a time from the GPU that has the fewest slots chosen so far, ties broken by the most
    free slots left, then by first appearance in ``available``; within a GPU the lowest slot
    goes first. So a container asking for two devices gets two distinct GPUs whenever
    possible. Returns fewer than ``size`` ids when not enough are available (the kubelet then
    falls back to its own choice). Raises ``InvalidDeviceIdError`` for a malformed id.
    """
    chosen: list[str] = list(dict.fromkeys(must_include))
    taken = set(chosen)
    used: dict[str, int] = {}
    for dev in chosen:
        uuid, _ = gpu_of(dev)
        used[uuid] = used.get(uuid, 0) + 1

    free: dict[str, list[tuple[int, str]]] = {}
    for dev in available:
        uuid, slot = gpu_of(dev)
        if dev not in taken:
            free.setdefault(uuid, []).append((slot, dev))
    order = {uuid: i for i, uuid in enumerate(free)}
    for slots in free.values():
        slots.sort(reverse=True)  # pop() takes the lowest slot

    while len(chosen) < size and free:
        uuid = min(free, key=lambda u: (used.get(u, 0), -len(free[u]), order[u]))
        _, dev = free[uuid].pop()
        chosen.append(dev)
        taken.add(dev)
        used[uuid] = used.get(uuid, 0) + 1
        if not free[uuid]:
            del free[uuid]
    return chosen


def prefer_gpus(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpus: Mapping[str, int],
) -> list[str]:
    """The preferred ``size`` ids when the container's GPUs are known: slots of ``gpus``.

    ``gpus`` maps GPU UUID -> how many devices the container takes on it (the scheduler's
    reservation). After the must-include ids (they count toward their GPU), each GPU gets
    its remaining share from its lowest free slots; whatever cannot be placed that way (a
    GPU with too few free slots, a GPU not offered) is filled by ``prefer_spread``. Never
    more than ``size`` ids. Raises ``InvalidDeviceIdError`` for a malformed id.
    """
    chosen: list[str] = list(dict.fromkeys(must_include))
    taken = set(chosen)
    need = {uuid: n for uuid, n in gpus.items() if n > 0}
    for dev in chosen:
        uuid, _ = gpu_of(dev)
        if need.get(uuid, 0) > 0:
            need[uuid] -= 1
    free: dict[str, list[tuple[int, str]]] = {}
    for dev in available:
        uuid, slot = gpu_of(dev)
        if dev not in taken and need.get(uuid, 0) > 0:
            free.setdefault(uuid, []).append((slot, dev))
    for uuid, slots in free.items():  # GPUs in order of first appearance in ``available``
        for _, dev in sorted(slots)[: need[uuid]]:
            if len(chosen) >= size:
                break
            chosen.append(dev)
            taken.add(dev)
    if len(chosen) < size:
        return prefer_spread(available, chosen, size)
    return chosen


class SlotInventory:
    """A ``DeviceInventory`` fed with the node's discovered GPUs.

    ``update`` swaps in a new GPU list; only a change in the advertised devices bumps the
    version and wakes ListAndWatch streams, so periodic rediscovery is free when nothing moved.
    """

    def __init__(self, gpus: Iterable[GpuDevice] = ()) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._devices = plugin_devices(gpus)

    def update(self, gpus: Iterable[GpuDevice]) -> bool:
        """Advertise ``gpus`` from now on; True when the device list changed."""
        devices = plugin_devices(gpus)
        with self._cond:
            if devices == self._devices:
                return False
            self._devices = devices
            self._version += 1
            self._cond.notify_all()
            return True

    def version(self) -> int:
        with self._cond:
            return self._version

    def devices(self) -> Sequence[PluginDevice]:
        with self._cond:
            return self._devices

    def wait_changed(self, version: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version
