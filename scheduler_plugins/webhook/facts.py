"""What the cluster's GPUs can hold at most, learned from ``hami.io/node-nvidia-register``.

The webhook rejects only requests no registered node could ever satisfy, so every figure
here is an upper bound: the most devices one container can get on one node and the largest
memory one device can have, per requested GPU mode. ``NodeFactsStore`` keeps them current
from the nodes' list+watch; with no registered node yet the facts are unknown and the
cluster checks are skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from api.errors import InvalidAnnotationError
from api.hami.keys import NODE_REGISTER, GpuMode
from api.hami.register import GpuDevice, MigProfile, decode

log = structlog.get_logger("tessera.webhook.facts")

RequestMode = GpuMode | None  # None: the pod names no nvidia.com/vgpu-mode (either kind)


@dataclass(frozen=True, order=True)
class LargestGpu:
    """The largest memory one device can have, and where it was seen."""

    memory_mib: int
    model: str
    node: str


@dataclass(frozen=True)
class NodeCapacity:
    """Upper bounds for one container's devices on one node."""

    core_devices: int  # hami-core GPUs: a container's devices there are distinct GPUs
    mig_devices: int  # MIG instances the node's mig-mode GPUs can hold at the same time
    core_largest: LargestGpu | None  # largest hami-core GPU
    mig_largest: LargestGpu | None  # largest MIG profile


def max_disjoint_placements(profile: MigProfile) -> int:
    """Most instances of ``profile`` one GPU holds at once (interval scheduling by end)."""
    count, free_from = 0, 0
    for p in sorted(profile.placements, key=lambda p: (p.end, p.start)):
        if p.start >= free_from:
            count += 1
            free_from = p.end
    return count


def node_capacity(node: str, devices: Sequence[GpuDevice]) -> NodeCapacity:
    core = [d for d in devices if d.mode != "mig"]
    mig = [d for d in devices if d.mode == "mig"]
    # Each MIG device also takes one of its GPU's vGPU slots.
    mig_devices = sum(
        min(d.count, max((max_disjoint_placements(p) for p in d.mig_profiles), default=0))
        for d in mig
    )
    core_largest = max((LargestGpu(d.devmem, d.type, node) for d in core), default=None)
    mig_largest = max(
        (LargestGpu(p.memory_mb, f"{d.type} {p.name}", node) for d in mig for p in d.mig_profiles),
        default=None,
    )
    return NodeCapacity(len(core), mig_devices, core_largest, mig_largest)


@dataclass(frozen=True)
class ModeLimit:
    """For pods of one requested mode: the most devices a container can get on any node, and
    the largest memory of any device (None: no GPU of that mode is registered)."""

    devices: int
    largest: LargestGpu | None


@dataclass(frozen=True)
class ClusterFacts:
    nodes: int = 0  # nodes with a readable register annotation
    limits: Mapping[RequestMode, ModeLimit] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.nodes > 0

    def limit(self, mode: RequestMode) -> ModeLimit:
        return self.limits.get(mode) or ModeLimit(0, None)

    @staticmethod
    def of(capacities: Iterable[NodeCapacity]) -> ClusterFacts:
        caps = list(capacities)
        if not caps:
            return UNKNOWN

        def largest(items: Iterable[LargestGpu | None]) -> LargestGpu | None:
            return max((i for i in items if i is not None), default=None)

        core = ModeLimit(max(c.core_devices for c in caps), largest(c.core_largest for c in caps))
        mig = ModeLimit(max(c.mig_devices for c in caps), largest(c.mig_largest for c in caps))
        either = ModeLimit(
            max(c.core_devices + c.mig_devices for c in caps),
            largest([core.largest, mig.largest]),
        )
        return ClusterFacts(len(caps), {"hami-core": core, "mig": mig, None: either})


UNKNOWN = ClusterFacts()


def _name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, dict) else ""


def _register(node: Mapping[str, Any]) -> str | None:
    meta = node.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    value = annotations.get(NODE_REGISTER) if isinstance(annotations, dict) else None
    return value if isinstance(value, str) else None


class NodeFactsStore:
    """Node capacities kept current from list+watch callbacks; thread-safe.

    A node's annotation is decoded only when it changes (nodes are updated often, their
    GPUs rarely). A node without a readable annotation does not count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: dict[str, str] = {}
        self._caps: dict[str, NodeCapacity] = {}
        self._facts: ClusterFacts | None = UNKNOWN
        self.synced = threading.Event()

    def replace(self, nodes: list[dict[str, Any]], listed_at: float = 0.0) -> None:
        with self._lock:
            raw, caps = dict(self._raw), dict(self._caps)
            self._raw, self._caps = {}, {}
            for node in nodes:
                self._apply_locked(node, raw, caps)
            self._facts = None
        self.synced.set()

    def event(self, typ: str, node: dict[str, Any]) -> None:
        with self._lock:
            if typ == "DELETED":
                name = _name(node)
                self._raw.pop(name, None)
                self._caps.pop(name, None)
            else:
                self._apply_locked(node, self._raw, self._caps)
            self._facts = None

    def facts(self) -> ClusterFacts:
        with self._lock:
            if self._facts is None:
                self._facts = ClusterFacts.of(self._caps.values())
            return self._facts

    def _apply_locked(
        self, node: dict[str, Any], known_raw: dict[str, str], known: dict[str, NodeCapacity]
    ) -> None:
        """Set ``node``'s capacity, reusing ``known``'s when its annotation is unchanged."""
        name = _name(node)
        value = _register(node)
        if not name:
            return
        if value is None:
            self._raw.pop(name, None)
            self._caps.pop(name, None)
            return
        if known_raw.get(name) == value and name in known:
            self._raw[name], self._caps[name] = value, known[name]
            return
        try:
            devices = decode(value, obj=f"node {name}")
        except InvalidAnnotationError as e:
            log.warning("node.register_unreadable", node=name, error=str(e))
            self._raw.pop(name, None)
            self._caps.pop(name, None)
            return
        if not devices:  # a node without GPUs says nothing about what a GPU can hold
            self._raw.pop(name, None)
            self._caps.pop(name, None)
            return
        self._raw[name], self._caps[name] = value, node_capacity(name, devices)
