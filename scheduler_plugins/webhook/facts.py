"""What the cluster's GPUs can hold at most, learned from ``hami.io/node-nvidia-register``.

The webhook rejects only requests no registered node could ever satisfy, so every figure
here is an upper bound: the most devices one container can get on one node and the largest
memory one device can have, per set of GPU modes a pod may accept (of hami-core, MIG, MPS).
``NodeFactsStore`` keeps them current from the nodes' list+watch; with no registered node yet
the facts are unknown and the cluster checks are skipped.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from api.errors import InvalidAnnotationError
from api.hami.keys import GPU_MODES, NODE_REGISTER, GpuMode
from api.hami.register import GpuDevice, MigProfile, decode

log = structlog.get_logger("tessera.webhook.facts")

RequestMode = GpuMode | frozenset[GpuMode] | None
"""The GPU modes a pod accepts: one, several (``nvidia.com/vgpu-mode: hami-core,mps``), or
None when it names none (the unified pool: every mode)."""

_EVERY_MODE: Final = frozenset(GPU_MODES)


@dataclass(frozen=True, order=True)
class LargestGpu:
    """The largest memory one device can have, and where it was seen."""

    memory_mib: int
    model: str
    node: str


@dataclass(frozen=True)
class NodeCapacity:
    """Upper bounds for one container's devices on one node, per GPU mode: how many (shared
    modes, hami-core and MPS: distinct GPUs; MIG: the instances the node's MIG GPUs can hold
    at the same time) and the largest memory one device can have (None: no GPU of the mode)."""

    devices: Mapping[GpuMode, int]
    largest: Mapping[GpuMode, LargestGpu | None]


def max_disjoint_placements(profile: MigProfile) -> int:
    """Most instances of ``profile`` one GPU holds at once (interval scheduling by end)."""
    count, free_from = 0, 0
    for p in sorted(profile.placements, key=lambda p: (p.end, p.start)):
        if p.start >= free_from:
            count += 1
            free_from = p.end
    return count


def node_capacity(node: str, devices: Sequence[GpuDevice]) -> NodeCapacity:
    counts: dict[GpuMode, int] = {}
    largest: dict[GpuMode, LargestGpu | None] = {}
    for mode in GPU_MODES:
        gpus = [d for d in devices if d.mode == mode]
        if mode == "mig":
            # Each MIG device also takes one of its GPU's vGPU slots.
            counts[mode] = sum(
                min(d.count, max((max_disjoint_placements(p) for p in d.mig_profiles), default=0))
                for d in gpus
            )
            largest[mode] = max(
                (
                    LargestGpu(p.memory_mb, f"{d.type} {p.name}", node)
                    for d in gpus
                    for p in d.mig_profiles
                ),
                default=None,
            )
        else:
            counts[mode] = len(gpus)
            largest[mode] = max((LargestGpu(d.devmem, d.type, node) for d in gpus), default=None)
    return NodeCapacity(counts, largest)


@dataclass(frozen=True)
class ModeLimit:
    """For pods of one requested mode: the most devices a container can get on any node, and
    the largest memory of any device (None: no GPU of that mode is registered)."""

    devices: int
    largest: LargestGpu | None


@dataclass(frozen=True)
class ClusterFacts:
    nodes: int = 0  # nodes with a readable register annotation
    # By the set of modes a pod accepts (every non-empty one).
    limits: Mapping[frozenset[GpuMode], ModeLimit] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.nodes > 0

    def limit(self, mode: RequestMode) -> ModeLimit:
        if mode is None:
            mode = _EVERY_MODE
        elif isinstance(mode, str):
            mode = frozenset((mode,))
        return self.limits.get(mode) or ModeLimit(0, None)

    @staticmethod
    def of(capacities: Iterable[NodeCapacity]) -> ClusterFacts:
        """The best node per set of modes: for several, the node's devices of all of them
        together (an upper bound: the scheduler gives one container devices of one mode) and
        the largest device of any."""
        caps = list(capacities)
        if not caps:
            return UNKNOWN
        limits: dict[frozenset[GpuMode], ModeLimit] = {}
        for size in range(1, len(GPU_MODES) + 1):
            for subset in itertools.combinations(GPU_MODES, size):
                limits[frozenset(subset)] = ModeLimit(
                    max(sum(c.devices[m] for m in subset) for c in caps),
                    max(
                        (big for c in caps for m in subset if (big := c.largest[m]) is not None),
                        default=None,
                    ),
                )
        return ClusterFacts(len(caps), limits)


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
