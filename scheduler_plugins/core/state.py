"""Cluster GPU state, kept incrementally in columnar (numpy) form.

One row per physical GPU; each node owns a contiguous block of rows. Pods change usage by
deltas on their rows (O(devices)); a node whose GPU list changes gets a fresh block and its
pods are re-applied. Assumed reservations are ordinary pod records flagged ``assumed``
until the pod's own annotations replace them. The decision code reads the arrays as they
are; nothing is rebuilt per scheduling cycle. Every counted device is also kept by node and
its pod's priority (``DeviceLedger``), for preemption's what-ifs over many nodes at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from api.hami.config import DeviceConfig
from api.hami.keys import GpuMode
from api.hami.nodes import PairScores
from api.hami.register import GpuDevice, MigProfile, Placement
from scheduler_plugins.core.fragmentation import KindCounts, TaskMix, pod_shape
from scheduler_plugins.core.mig_policy import (
    MAX_SLICES,
    ChoiceTable,
    build_choice_table,
    sort_profiles,
)
from scheduler_plugins.core.nodes import NodeInfo
from scheduler_plugins.core.requests import PodAllocation
from scheduler_plugins.core.rules import MODE_CODES, Reason

_USAGE_LOG_MAX = 4096  # usage changes remembered (``ClusterState.usage_changes_since``)


@dataclass(frozen=True)
class Geometry:
    """A MIG geometry class: the allowed profiles of a GPU as its node registered them."""

    profiles: tuple[MigProfile, ...]  # sorted: rank = index
    table: ChoiceTable
    memory: npt.NDArray[np.int64]  # per rank
    cores: npt.NDArray[np.int64]  # per rank
    slices: int
    sizes: npt.NDArray[np.int64]  # [rank, start] -> placement size, 0 where none starts
    # The choice table flattened for one ``np.take`` per lookup (``ChoiceLuts``).
    luts: ChoiceLuts

    def rank_of(self, name: str) -> int:
        for i, p in enumerate(self.profiles):
            if p.name == name:
                return i
        return -1


class ChoiceLuts(NamedTuple):
    """A geometry's choice table flattened for one ``np.take`` per lookup: index
    ``mask * (R + 1) + rank`` with R profiles, rank R standing for "no profile is large
    enough". Per entry: the chosen profile's rank and start (-1: none), its memory and cores (0:
    none), and why there is no choice (``Reason`` bits, 0 where there is one)."""

    profile: npt.NDArray[np.int64]
    start: npt.NDArray[np.int64]
    mem: npt.NDArray[np.float64]
    cores: npt.NDArray[np.float64]
    why: npt.NDArray[np.int64]

    @staticmethod
    def of(
        table: ChoiceTable, memory: npt.NDArray[np.int64], cores: npt.NDArray[np.int64]
    ) -> ChoiceLuts:
        n_masks, n_ranks = table.profile.shape
        prof = np.full((n_masks, n_ranks + 1), -1, np.int64)
        prof[:, :n_ranks] = table.profile
        start = np.full((n_masks, n_ranks + 1), -1, np.int64)
        start[:, :n_ranks] = table.start
        got = prof >= 0
        start = np.where(got, start, -1)
        pmem = np.where(got, memory[np.maximum(prof, 0)], 0).astype(np.float64)
        pcore = np.where(got, cores[np.maximum(prof, 0)], 0).astype(np.float64)
        why = np.full((n_masks, n_ranks + 1), int(Reason.MIG_NO_PROFILE), np.int64)
        why[:, :n_ranks] = np.where(
            table.fragmented, int(Reason.MIG_FRAGMENTATION), int(Reason.MIG_CAPACITY)
        )
        why[got] = 0
        luts = ChoiceLuts(prof.ravel(), start.ravel(), pmem.ravel(), pcore.ravel(), why.ravel())
        for a in luts:
            a.setflags(write=False)
        return luts


class Scratch:
    """Work arrays that decisions reuse instead of allocating (numpy temporaries of a 40k-GPU
    table are large enough that glibc hands their pages back and faults them in again on
    every call). Owned by a layout's tables, so they live until the layout changes. Never
    hand these arrays out in a result: the next decision overwrites them.

    One user at a time: ``acquire`` fails (without waiting) while another decision holds it,
    and that one then works with a fresh ``Scratch`` of its own."""

    __slots__ = ("_arrays", "_lock", "memo")

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, tuple[int, ...], Any], npt.NDArray[Any]] = {}
        self._lock = threading.Lock()
        # Values derived from the (immutable) table and a request, e.g. per-profile ranks.
        self.memo: dict[Any, Any] = {}

    def acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        """The work array ``name`` of this shape and dtype (contents undefined)."""
        key = (name, shape, dtype)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = np.empty(shape, dtype)
        return a


class ChangeWatcher(Protocol):
    def state_changing(self) -> None: ...


@dataclass
class NodeEntry:
    name: str
    idx: int
    start: int  # first GPU row
    devices: tuple[GpuDevice, ...]
    rows: dict[str, int]  # GPU UUID -> row
    cpu_milli: int = 0
    memory_bytes: int = 0
    cordoned: frozenset[str] = frozenset()
    pair_scores: PairScores = field(default_factory=dict)


@dataclass
class _Record:
    alloc: PodAllocation
    assumed: bool
    applied: bool = False
    # Its devices' entries in the state's ``DeviceLedger`` while applied.
    slots: list[int] | None = None


def _by_index(d: GpuDevice) -> int:
    return d.index


def _zeros(n: int, dtype: type[Any] = np.float64) -> npt.NDArray[Any]:
    return np.zeros(n, dtype=dtype)


def _placement_sizes(profiles: tuple[MigProfile, ...]) -> npt.NDArray[np.int64]:
    sizes = np.zeros((len(profiles), MAX_SLICES), np.int64)
    for rank, p in enumerate(profiles):
        for pl in p.placements:
            sizes[rank, pl.start] = pl.size
    return sizes


# Per-node columns (by node idx): allocatable and requested CPU/memory, and the sums over the
# node's GPUs of capacity and usage that the node score needs (kept with every pod change, so a
# decision reads them instead of summing 40k GPU rows).
_NODE_COLUMNS = (
    "node_cpu_alloc",
    "node_mem_alloc",
    "node_cpu_req",
    "node_mem_req",
    "node_slots",
    "node_mem",
    "node_cores",
    "node_used_slots",
    "node_used_mem",
    "node_used_cores",
)


@dataclass
class GpuArrays:
    """Per-GPU columns. Rows not owned by a node have ``node == -1``."""

    node: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    slots: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    mem: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    cores: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    used_slots: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    used_mem: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    used_cores: npt.NDArray[np.float64] = field(default_factory=lambda: _zeros(0))
    healthy: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, np.bool_))
    mode: npt.NDArray[np.int8] = field(default_factory=lambda: np.zeros(0, np.int8))  # MODE_CODES
    numa: npt.NDArray[np.int16] = field(default_factory=lambda: np.zeros(0, np.int16))
    mig_mask: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    conflict: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    # Devices HAMi <= v2.9 placed on MIG (legacy device strings) held on the GPU.
    legacy: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    cordoned: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, np.bool_))
    # Refused as a whole whatever the pod asks: conflict, legacy or cordoned (kept with them).
    blocked: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, np.bool_))
    geom: npt.NDArray[np.int16] = field(default_factory=lambda: np.zeros(0, np.int16))
    type_id: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    slice_use: npt.NDArray[np.int16] = field(
        default_factory=lambda: np.zeros((0, MAX_SLICES), np.int16)
    )

    def grow(self, n: int) -> None:
        for name in GPU_COLUMNS:
            arr = getattr(self, name)
            extra_shape = (n, *arr.shape[1:])
            fill = -1 if name in ("node", "geom") else 0
            setattr(self, name, np.concatenate([arr, np.full(extra_shape, fill, arr.dtype)]))

    def __len__(self) -> int:
        return len(self.node)

    @property
    def is_mig(self) -> npt.NDArray[np.bool_]:
        mig: npt.NDArray[np.bool_] = self.mode == _MIG
        return mig

    def refresh_blocked(self, r: int) -> None:
        self.blocked[r] = self.conflict[r] > 0 or self.legacy[r] > 0 or self.cordoned[r]


GPU_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(GpuArrays))
_CORE, _MIG, _MPS = (MODE_CODES.index(m) for m in ("hami-core", "mig", "mps"))
# The columns a pod's devices change (``count_devices``); the others are fixed while a node's
# GPUs are (a what-if copies only these, and views the rest).
USAGE_COLUMNS: Final = (
    "used_slots",
    "used_mem",
    "used_cores",
    "mig_mask",
    "conflict",
    "legacy",
    "blocked",
    "slice_use",
)
_SLICE_BITS = np.int64(1) << np.arange(MAX_SLICES, dtype=np.int64)


class GpuSource(Protocol):
    """GPU rows and what their codes mean: the state, or a what-if's copy of some of its rows."""

    @property
    def gpus(self) -> GpuArrays: ...
    @property
    def geometries(self) -> list[Geometry]: ...
    @property
    def types(self) -> list[str]: ...


class Used(NamedTuple):
    """What one device takes of a GPU row: one vGPU slot, ``mem`` MiB and ``cores``, the MIG
    slices ``[start, end)`` it occupies (``start == end``: a shared device), and whether it is
    a device HAMi <= v2.9 placed on MIG (where it sits is unknown: its GPU takes no new work
    while it is there)."""

    row: int
    mem: float
    cores: float
    start: int
    end: int
    legacy: bool


class DeviceUsage(NamedTuple):
    """``Used`` of many devices as columns (rows may repeat): what a what-if takes away from,
    or adds back to, many nodes at once."""

    rows: npt.NDArray[np.int64]
    mem: npt.NDArray[np.float64]
    cores: npt.NDArray[np.float64]
    start: npt.NDArray[np.int64]
    end: npt.NDArray[np.int64]
    legacy: npt.NDArray[np.bool_]


def device_usage(src: GpuSource, rows: Mapping[str, int], alloc: PodAllocation) -> list[Used]:
    """What ``alloc``'s devices take of the GPU rows of its node (``rows``: UUID -> row); a
    device on a GPU the node no longer registers takes nothing (nothing there to count). The
    one place a device's usage is worked out: the state counts it, what-ifs take it away or
    add it back."""
    out: list[Used] = []
    for d in alloc.devices:
        r = rows.get(d.uuid)
        if r is not None:
            out.append(Used(r, d.mem, d.cores, 0, 0, d.legacy is not None))
    for m in alloc.mig:
        r = rows.get(m.gpu_uuid)
        if r is not None:
            mem, cores = _mig_usage(src, r, m.profile, m.placement)
            start = min(m.placement.start, MAX_SLICES)
            out.append(Used(r, mem, cores, start, min(m.placement.end, MAX_SLICES), False))
    return out


def _mig_usage(src: GpuSource, row: int, profile: str, placement: Placement) -> tuple[int, int]:
    gid = int(src.gpus.geom[row])
    if gid >= 0:
        geom = src.geometries[gid]
        rank = geom.rank_of(profile)
        if rank >= 0:
            return int(geom.memory[rank]), int(geom.cores[rank])
        slices = geom.slices
    else:
        slices = 8
    # A profile the node no longer offers: count its share of the card.
    frac = placement.size / max(slices, 1)
    return int(src.gpus.mem[row] * frac), int(src.gpus.cores[row] * frac)


def count_devices(g: GpuArrays, used: Iterable[Used], sign: int) -> None:
    """Count (``sign`` +1) or uncount (-1) one pod's devices in ``g``'s columns, and what
    follows: a GPU's MIG occupancy, inconsistent (overlapping) MIG reservations, and whether
    the GPU is refused as a whole. Device by device: for a pod's few devices numpy's calls on
    arrays cost more than these scalar updates (``count_usage`` is the same for many)."""
    for u in used:
        r = u.row
        g.used_slots[r] += sign
        g.used_mem[r] += sign * u.mem
        g.used_cores[r] += sign * u.cores
        if u.legacy:
            g.legacy[r] += sign
            g.refresh_blocked(r)
        if u.end > u.start:
            g.slice_use[r, u.start : u.end] += sign
            use = g.slice_use[r]
            g.mig_mask[r] = int(np.dot((use > 0).astype(np.int64), _SLICE_BITS))
            g.conflict[r] = int(np.count_nonzero(use > 1))
            g.refresh_blocked(r)


def count_usage(g: GpuArrays, usage: DeviceUsage, sign: int) -> None:
    """``count_devices`` for many devices at once, as array operations (sums per row by
    ``bincount``: over tens of thousands of devices ``np.add.at`` costs ten times more)."""
    rows = usage.rows
    if not rows.size:
        return
    n = len(g.used_slots)
    g.used_slots += sign * np.bincount(rows, minlength=n)
    g.used_mem += sign * np.bincount(rows, weights=usage.mem, minlength=n)
    g.used_cores += sign * np.bincount(rows, weights=usage.cores, minlength=n)
    mig = usage.end > usage.start
    legacy = usage.legacy
    if legacy.any():
        g.legacy += sign * np.bincount(rows[legacy], minlength=n).astype(g.legacy.dtype)
    if mig.any():
        # Each device's slices [start, end) as +1 at start and -1 at end, summed along them,
        # over the rows MIG devices are on only (arrays of every row's slices are large
        # enough that allocating them costs more than the sums).
        mig_rows = rows[mig]
        per_row = np.bincount(mig_rows, minlength=n)
        t = np.flatnonzero(per_row)
        w = MAX_SLICES + 1
        at = (np.cumsum(per_row > 0) - 1)[mig_rows] * w
        edges = np.bincount(at + usage.start[mig], minlength=t.size * w)
        edges -= np.bincount(at + usage.end[mig], minlength=t.size * w)
        spans = np.cumsum(edges.reshape(t.size, w), axis=1)[:, :MAX_SLICES]
        g.slice_use[t] += sign * spans.astype(g.slice_use.dtype)
    changed = mig | legacy
    if changed.any():
        t = np.flatnonzero(np.bincount(rows[changed], minlength=n))
        use = g.slice_use[t]
        g.mig_mask[t] = (use > 0).astype(np.int64) @ _SLICE_BITS
        g.conflict[t] = np.count_nonzero(use > 1, axis=1)
        g.blocked[t] = (g.conflict[t] > 0) | (g.legacy[t] > 0) | g.cordoned[t]


class DeviceLedger:
    """Every counted device as columns: its node (by index), its GPU's position on the node,
    its usage and its pod's priority. What the pods below a priority hold on many nodes at
    once comes from here in a few array operations (``below``), not from a loop over pods.
    Positions, not rows: rows move when the state compacts, positions only when a node
    registers other GPUs (its pods are then counted again)."""

    _FIELDS: Final = (
        ("node", np.int32),
        ("col", np.int32),
        ("mem", np.float64),
        ("cores", np.float64),
        ("start", np.int8),
        ("end", np.int8),
        ("legacy", np.bool_),
        ("priority", np.int64),
    )

    def __init__(self) -> None:
        self.node = np.zeros(0, np.int32)  # -1: a free entry
        self.col = np.zeros(0, np.int32)
        self.mem = np.zeros(0, np.float64)
        self.cores = np.zeros(0, np.float64)
        self.start = np.zeros(0, np.int8)
        self.end = np.zeros(0, np.int8)
        self.legacy = np.zeros(0, np.bool_)
        self.priority = np.zeros(0, np.int64)
        self._free: list[int] = []

    def add(self, node_idx: int, first_row: int, used: Sequence[Used], priority: int) -> list[int]:
        """Enter the devices ``used`` of a pod of ``priority`` on node ``node_idx`` (whose
        first GPU is row ``first_row``); their entries."""
        if len(self._free) < len(used):
            self._grow(len(used))
        slots: list[int] = []
        for u in used:
            i = self._free.pop()
            slots.append(i)
            self.node[i] = node_idx
            self.col[i] = u.row - first_row
            self.mem[i] = u.mem
            self.cores[i] = u.cores
            self.start[i] = u.start
            self.end[i] = u.end
            self.legacy[i] = u.legacy
            self.priority[i] = priority
        return slots

    def drop(self, slots: list[int]) -> None:
        self.node[slots] = -1
        self._free.extend(slots)

    def lowest_priority(self) -> int | None:
        """The lowest priority of a pod holding a device (None: no device is held)."""
        held = self.priority[self.node >= 0]
        return int(held.min()) if held.size else None

    def below(self, priority: int) -> npt.NDArray[np.int64]:
        """The entries of devices held by pods of a priority below ``priority``."""
        return np.flatnonzero((self.node >= 0) & (self.priority < priority))

    def usage(self, slots: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]) -> DeviceUsage:
        """Entries ``slots`` as usage of ``rows`` (their GPUs' rows wherever they are now)."""
        return DeviceUsage(
            rows,
            self.mem[slots],
            self.cores[slots],
            self.start[slots].astype(np.int64),
            self.end[slots].astype(np.int64),
            self.legacy[slots],
        )

    def _grow(self, n: int) -> None:
        size = self.node.size
        more = max(n, size, 256)
        for name, dtype in self._FIELDS:
            fill = -1 if name == "node" else 0
            setattr(self, name, np.concatenate([getattr(self, name), np.full(more, fill, dtype)]))
        self._free.extend(range(size + more - 1, size - 1, -1))


class ClusterState:
    """Nodes, GPUs and the pods that hold them. Single-threaded; callers serialize."""

    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self.gpus = GpuArrays()
        self.nodes: dict[str, NodeEntry] = {}
        self.node_names: list[str] = []  # by node idx; "" for a free idx
        self._free_idx: list[int] = []
        self._used_rows = 0  # rows handed out (including dead ones)
        self._live_rows = 0
        self.types: list[str] = []
        self._type_ids: dict[str, int] = {}
        self.geometries: list[Geometry] = []
        self._geom_ids: dict[tuple[str, tuple[MigProfile, ...]], int] = {}
        self._records: dict[str, _Record] = {}
        self._by_node: dict[str, set[str]] = {}
        self.ledger = DeviceLedger()  # every counted device, by node and priority
        self.layout_version = 0  # bumped whenever rows or node indices change
        self.pair_scores_version = 0  # bumped whenever a node's GPU pair scores may change
        self._layout: Layout | None = None
        # Decisions that still read the live GPU columns (lazy reasons): told before any change.
        self._watchers: weakref.WeakSet[ChangeWatcher] = weakref.WeakSet()
        # Rows whose usage changed, oldest first, for copies of some rows kept between
        # decisions (see ``usage_changes_since``); _usage_log[0] is change ``_usage_log_start``.
        self._usage_log: list[int] = []
        self._usage_log_start = 0
        # Per-node columns (by node idx), see _NODE_COLUMNS.
        self.node_cpu_alloc: npt.NDArray[np.float64] = _zeros(0)
        self.node_mem_alloc: npt.NDArray[np.float64] = _zeros(0)
        self.node_cpu_req: npt.NDArray[np.float64] = _zeros(0)
        self.node_mem_req: npt.NDArray[np.float64] = _zeros(0)
        self.node_slots: npt.NDArray[np.float64] = _zeros(0)
        self.node_mem: npt.NDArray[np.float64] = _zeros(0)
        self.node_cores: npt.NDArray[np.float64] = _zeros(0)
        self.node_used_slots: npt.NDArray[np.float64] = _zeros(0)
        self.node_used_mem: npt.NDArray[np.float64] = _zeros(0)
        self.node_used_cores: npt.NDArray[np.float64] = _zeros(0)
        # The kinds of shared-GPU pods that asked for room: the workload the fragmentation
        # policy weighs (``decide._asking``; pods found holding GPUs count too).
        self.kinds = KindCounts()

    # ----- change notification -----------------------------------------------------------

    def watch(self, watcher: ChangeWatcher) -> None:
        """Call ``watcher.state_changing()`` once, before the next change of the GPU columns."""
        self._watchers.add(watcher)

    @property
    def usage_clock(self) -> int:
        """How many usage changes of GPU rows there have been (see ``usage_changes_since``)."""
        return self._usage_log_start + len(self._usage_log)

    def usage_changes_since(self, clock: int) -> list[int] | None:
        """The GPU rows whose usage columns (``used_*``, ``mig_mask``, ``conflict``) changed by
        pods since ``usage_clock`` was ``clock``, repeats included, and the first GPU row of
        every node whose requested or allocatable CPU or memory changed; None when that is too
        long ago to tell. Changes of rows themselves (nodes) bump ``layout_version`` instead."""
        if clock < self._usage_log_start:
            return None
        return self._usage_log[clock - self._usage_log_start :]

    def _changing(self) -> None:
        if len(self._watchers):
            watchers = list(self._watchers)
            self._watchers.clear()
            for w in watchers:
                w.state_changing()

    # ----- nodes -------------------------------------------------------------------------

    def upsert_node(
        self,
        name: str,
        devices: tuple[GpuDevice, ...],
        *,
        cpu_milli: int = 0,
        memory_bytes: int = 0,
        cordoned: frozenset[str] = frozenset(),
        pair_scores: PairScores | None = None,
    ) -> None:
        """The node's GPUs as it registers them, kept in index order (HAMi's device plugin
        registers them in any order; the index breaks ties between GPUs); ``cordoned``: UUIDs
        that take no new work (``hami.io/device-cordon``); ``pair_scores``: how its GPUs are
        connected."""
        devices = tuple(sorted(devices, key=_by_index))
        entry = self.nodes.get(name)
        if entry is not None and entry.devices == devices:
            if (entry.cpu_milli, entry.memory_bytes) != (cpu_milli, memory_bytes) and devices:
                self._usage_log.append(entry.start)  # its allocatable CPU or memory changed
            entry.cpu_milli, entry.memory_bytes = cpu_milli, memory_bytes
            self.node_cpu_alloc[entry.idx] = cpu_milli
            self.node_mem_alloc[entry.idx] = memory_bytes
            if entry.cordoned != cordoned:
                self._changing()
                entry.cordoned = cordoned
                for uuid, r in entry.rows.items():
                    self.gpus.cordoned[r] = uuid in cordoned
                    self.gpus.refresh_blocked(r)
            if entry.pair_scores != (pair_scores or {}):
                self._changing()
                entry.pair_scores = pair_scores or {}
                self.pair_scores_version += 1
            return
        self._changing()
        if entry is not None:
            self._unapply_node_pods(name)
            self._release_rows(entry)
            idx = entry.idx
        else:
            idx = self._alloc_node_idx(name)
        start = self._alloc_rows(len(devices))
        entry = NodeEntry(
            name, idx, start, devices, {}, cpu_milli, memory_bytes, cordoned, pair_scores or {}
        )
        self.pair_scores_version += 1
        g = self.gpus
        for i, d in enumerate(devices):
            r = start + i
            entry.rows[d.id] = r
            g.node[r] = idx
            g.slots[r] = d.count
            g.mem[r] = d.devmem
            g.cores[r] = d.devcore
            g.used_slots[r] = g.used_mem[r] = g.used_cores[r] = 0
            g.healthy[r] = d.health
            g.mode[r] = MODE_CODES.index(d.mode)
            g.numa[r] = min(d.numa, 2**15 - 1)
            g.mig_mask[r] = 0
            g.conflict[r] = 0
            g.legacy[r] = 0
            g.cordoned[r] = d.id in cordoned
            g.refresh_blocked(r)
            g.slice_use[r] = 0
            g.type_id[r] = self._type_id(d.type)
            g.geom[r] = self._geometry_id(d) if d.mode == "mig" else -1
        self._live_rows += len(devices)
        self.nodes[name] = entry
        self.node_cpu_alloc[idx] = cpu_milli
        self.node_mem_alloc[idx] = memory_bytes
        self.node_slots[idx] = sum(d.count for d in devices)
        self.node_mem[idx] = sum(d.devmem for d in devices)
        self.node_cores[idx] = sum(d.devcore for d in devices)
        self.node_used_slots[idx] = self.node_used_mem[idx] = self.node_used_cores[idx] = 0
        self.layout_version += 1
        self._apply_node_pods(name)

    def upsert_node_info(self, info: NodeInfo) -> None:
        """``upsert_node`` with what ``nodes.parse_node`` read of a Node."""
        self.upsert_node(
            info.name,
            info.devices,
            cpu_milli=info.cpu_milli,
            memory_bytes=info.memory_bytes,
            cordoned=info.cordoned,
            pair_scores=info.pair_scores,
        )

    def remove_node(self, name: str) -> None:
        entry = self.nodes.pop(name, None)
        if entry is None:
            return
        self._changing()
        self._unapply_node_pods(name, entry)
        self._release_rows(entry)
        self.node_names[entry.idx] = ""
        self._free_idx.append(entry.idx)
        for attr in _NODE_COLUMNS:
            getattr(self, attr)[entry.idx] = 0
        self.layout_version += 1

    def _alloc_node_idx(self, name: str) -> int:
        if self._free_idx:
            idx = self._free_idx.pop()
            self.node_names[idx] = name
            return idx
        self.node_names.append(name)
        idx = len(self.node_names) - 1
        if idx >= len(self.node_cpu_alloc):
            n = max(64, len(self.node_cpu_alloc))
            for attr in _NODE_COLUMNS:
                setattr(self, attr, np.concatenate([getattr(self, attr), _zeros(n)]))
        return idx

    def _alloc_rows(self, n: int) -> int:
        if self._used_rows + n > len(self.gpus):
            if self._live_rows + n <= len(self.gpus) // 2:
                self._compact()
            if self._used_rows + n > len(self.gpus):
                self.gpus.grow(max(n, len(self.gpus), 256))
        start = self._used_rows
        self._used_rows += n
        return start

    def _release_rows(self, entry: NodeEntry) -> None:
        n = len(entry.devices)
        self.gpus.node[entry.start : entry.start + n] = -1
        self._live_rows -= n

    def _compact(self) -> None:
        """Move live node blocks together; dead rows come from nodes that re-registered."""
        g = self.gpus
        order = sorted(self.nodes.values(), key=lambda e: e.start)
        pos = 0
        for e in order:
            n = len(e.devices)
            if e.start != pos:
                for name in GPU_COLUMNS:
                    arr = getattr(g, name)
                    arr[pos : pos + n] = arr[e.start : e.start + n].copy()
                e.rows = {uuid: pos + (r - e.start) for uuid, r in e.rows.items()}
                e.start = pos
            pos += n
        g.node[pos:] = -1
        self._used_rows = pos
        self.layout_version += 1

    def _type_id(self, gpu_type: str) -> int:
        tid = self._type_ids.get(gpu_type)
        if tid is None:
            tid = len(self.types)
            self.types.append(gpu_type)
            self._type_ids[gpu_type] = tid
        return tid

    def _geometry_id(self, d: GpuDevice) -> int:
        allowed = set(self.config.allowed_profiles(d.type))
        profiles = sort_profiles([p for p in d.mig_profiles if p.name in allowed])
        if not profiles:
            return -1
        key = (d.type, profiles)
        gid = self._geom_ids.get(key)
        if gid is None:
            table = build_choice_table(profiles, self.config.mig_placement_policy)
            gid = len(self.geometries)
            memory = np.array([p.memory_mb for p in table.profiles], np.int64)
            cores = np.array([p.core for p in table.profiles], np.int64)
            self.geometries.append(
                Geometry(
                    profiles=table.profiles,
                    table=table,
                    memory=memory,
                    cores=cores,
                    slices=table.total_slices,
                    sizes=_placement_sizes(table.profiles),
                    luts=ChoiceLuts.of(table, memory, cores),
                )
            )
            self._geom_ids[key] = gid
        return gid

    # ----- pods --------------------------------------------------------------------------

    def upsert_pod(self, alloc: PodAllocation | None, key: str) -> None:
        """Record what a pod holds (None: it holds nothing, e.g. it ended)."""
        self._drop(key)
        if alloc is not None:
            self._add(key, alloc, assumed=False)

    def remove_pod(self, key: str) -> None:
        self._drop(key)

    def assume(self, alloc: PodAllocation) -> None:
        """Count a reservation now, before the pod's annotations are visible."""
        self._drop(alloc.key)
        self._add(alloc.key, alloc, assumed=True)

    def confirm(self, alloc: PodAllocation) -> None:
        """The pod's own record ``alloc`` shows the devices its assumed reservation counts:
        counted once already, so nothing's usage changes (no row is marked changed for the
        decisions' kept work); the record becomes ``alloc`` (what the pod wrote, its uid)
        and ``forget`` no longer drops it. Anything else (no such record, other devices or
        priority) is recorded in full, as ``upsert_pod``."""
        rec = self._records.get(alloc.key)
        if rec is None or rec.alloc != alloc or rec.alloc.priority != alloc.priority:
            self.upsert_pod(alloc, alloc.key)
            return
        rec.alloc = alloc
        rec.assumed = False

    def forget(self, key: str) -> bool:
        """Drop an assumed reservation (idempotent); a confirmed one is kept."""
        rec = self._records.get(key)
        if rec is None or not rec.assumed:
            return False
        self._drop(key)
        return True

    def is_assumed(self, key: str) -> bool:
        rec = self._records.get(key)
        return rec is not None and rec.assumed

    def allocation(self, key: str) -> PodAllocation | None:
        rec = self._records.get(key)
        return rec.alloc if rec else None

    def allocations(self) -> Iterator[PodAllocation]:
        return (r.alloc for r in self._records.values())

    def ledger_entries(self, keys: Iterable[str]) -> list[int]:
        """The ``ledger`` entries of the devices pods ``keys`` hold (none for pods not
        counted)."""
        out: list[int] = []
        for key in keys:
            rec = self._records.get(key)
            if rec is not None and rec.slots:
                out.extend(rec.slots)
        return out

    def pods_on(self, node: str) -> list[PodAllocation]:
        """What the pods counted on ``node`` hold, by pod key."""
        return [self._records[k].alloc for k in sorted(self._by_node.get(node, ()))]

    def _add(self, key: str, alloc: PodAllocation, *, assumed: bool) -> None:
        rec = _Record(alloc, assumed)
        self._records[key] = rec
        self._by_node.setdefault(alloc.node, set()).add(key)
        entry = self.nodes.get(alloc.node)
        if entry is not None:
            self._apply(entry, rec, +1)

    def _drop(self, key: str) -> None:
        rec = self._records.pop(key, None)
        if rec is None:
            return
        keys = self._by_node.get(rec.alloc.node)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_node[rec.alloc.node]
        entry = self.nodes.get(rec.alloc.node)
        if entry is not None and rec.applied:
            self._apply(entry, rec, -1)

    def _apply_node_pods(self, name: str) -> None:
        entry = self.nodes[name]
        for key in sorted(self._by_node.get(name, ())):
            rec = self._records[key]
            if not rec.applied:
                self._apply(entry, rec, +1)

    def _unapply_node_pods(self, name: str, entry: NodeEntry | None = None) -> None:
        entry = entry or self.nodes[name]
        for key in self._by_node.get(name, ()):
            rec = self._records[key]
            if rec.applied:
                self._apply(entry, rec, -1)

    def _apply(self, entry: NodeEntry, rec: _Record, sign: int) -> None:
        self._changing()
        alloc = rec.alloc
        idx = entry.idx
        self.node_cpu_req[idx] += sign * alloc.cpu_milli
        self.node_mem_req[idx] += sign * alloc.memory_bytes
        used = device_usage(self, entry.rows, alloc)
        count_devices(self.gpus, used, sign)
        if sign > 0:
            rec.slots = self.ledger.add(idx, entry.start, used, alloc.priority)
        elif rec.slots is not None:
            self.ledger.drop(rec.slots)
            rec.slots = None
        self._usage_log.extend(u.row for u in used)
        if (alloc.cpu_milli or alloc.memory_bytes) and entry.devices:
            self._usage_log.append(entry.start)  # the node's CPU or memory changed
        if len(self._usage_log) > _USAGE_LOG_MAX:  # copies that old refresh in full
            self._usage_log_start += len(self._usage_log)
            self._usage_log.clear()
        self.node_used_slots[idx] += sign * len(used)
        self.node_used_mem[idx] += sign * sum(u.mem for u in used)
        self.node_used_cores[idx] += sign * sum(u.cores for u in used)
        shared = [u for u in used if u.start == u.end and not u.legacy]
        if sign > 0 and shared and len(shared) == len(used):
            g = self.gpus
            row = shared[0].row
            share = max(shared[0].cores / g.cores[row], shared[0].mem / g.mem[row])
            self.kinds.arrive(  # a pod that never asked here (bound before a restart) counts now
                alloc.uid or alloc.key,
                pod_shape(alloc.cpu_milli, alloc.memory_bytes, len(shared), share),
            )
        rec.applied = sign > 0

    def task_mix(self) -> TaskMix:
        """The workload as the fragmentation policy weighs it: the kinds of the pods that
        asked for room last."""
        return self.kinds.mix()

    # ----- views -------------------------------------------------------------------------

    def layout(self) -> Layout:
        """Segments of rows per node, rebuilt only when rows or nodes changed."""
        if self._layout is None or self._layout.version != self.layout_version:
            self._layout = Layout.of(self)
        return self._layout

    def node_rows(self, name: str) -> range:
        e = self.nodes[name]
        return range(e.start, e.start + len(e.devices))

    def live_node_indices(self) -> npt.NDArray[np.int64]:
        return np.array(sorted(e.idx for e in self.nodes.values()), np.int64)

    def usage_snapshot(self) -> dict[str, Any]:
        """Per-GPU usage keyed by node/uuid, for comparing two states in tests and checks."""
        out: dict[str, Any] = {}
        g = self.gpus
        for name, e in sorted(self.nodes.items()):
            for uuid, r in sorted(e.rows.items()):
                out[f"{name}/{uuid}"] = (
                    float(g.used_slots[r]),
                    float(g.used_mem[r]),
                    float(g.used_cores[r]),
                    int(g.mig_mask[r]),
                    int(g.conflict[r]),
                    int(g.legacy[r]),
                    bool(g.blocked[r]),
                )
            out[f"{name}/cpu-mem"] = (
                float(self.node_cpu_req[e.idx]),
                float(self.node_mem_req[e.idx]),
            )
            out[f"{name}/gpu-sums"] = tuple(
                float(getattr(self, col)[e.idx])
                for col in (
                    "node_used_slots",
                    "node_used_mem",
                    "node_used_cores",
                    "node_slots",
                    "node_mem",
                    "node_cores",
                )
            )
        return out


@dataclass(frozen=True, eq=False)
class PathTable:
    """One placement path's GPUs (hami-core, MPS, or MIG with a geometry) as a dense per-node
    table.

    Row ``i`` is segment ``nodes[i]``; column ``j`` its j-th GPU; entries that are not a
    healthy live GPU of the path (padding, other mode, unhealthy) have ``ok`` False and
    capacities of 1 (never fit, always finite). Per-node reductions are axis-1 operations.
    """

    nodes: npt.NDArray[np.int64]  # [P] segment of each table row
    idx: npt.NDArray[np.int64]  # [P, W] GPU row (0 where not ok)
    ok: npt.NDArray[np.bool_]  # [P, W] healthy live GPU of this path
    pos: npt.NDArray[np.int64]  # [n_rows] flat position in the table, -1 where not ok
    slots: npt.NDArray[np.float64]  # [P, W] capacities
    mem: npt.NDArray[np.float64]
    cores: npt.NDArray[np.float64]
    type_id: npt.NDArray[np.int32]  # [P, W]
    numa: npt.NDArray[np.int16]  # [P, W] NUMA node, -1 where not ok
    # [P, W] HAMi's tie order, larger first: NUMA node, then column (GPU index); 0 where not ok
    tie_key: npt.NDArray[np.int32]
    geoms: tuple[tuple[int, npt.NDArray[np.int64]], ...]  # (geometry, flat positions); MIG only
    min_cores: float  # fewest cores of an ok GPU (inf if none)
    # MIG: the geometries' choice tables (``Geometry.luts``) concatenated after one "nothing
    # fits" entry; a position's answer is at ``lut_off + (mask & lut_full) * lut_stride + rank``
    # (positions without a geometry: offset 0, stride 0, full 0, so rank 0 reads the sentinel).
    lut_off: npt.NDArray[np.int64] | None = None  # [P * W]
    lut_stride: npt.NDArray[np.int64] | None = None
    lut_full: npt.NDArray[np.int64] | None = None
    lut: ChoiceLuts | None = None
    # Work arrays of decisions over this table (see ``Scratch``); not part of the table's value.
    scratch: Scratch = field(default_factory=Scratch, repr=False, compare=False)

    @staticmethod
    def of(
        state: GpuSource,
        n_rows: int,
        gpu_rows_t: npt.NDArray[np.int64],
        in_seg: npt.NDArray[np.bool_],
        rows_ok: npt.NDArray[np.bool_],
        geoms: bool,
    ) -> PathTable:
        g = state.gpus
        ok_all = in_seg & rows_ok[gpu_rows_t] if n_rows else in_seg
        nodes = np.flatnonzero(ok_all.any(axis=1))
        ok = np.ascontiguousarray(ok_all[nodes])
        idx = np.where(ok, gpu_rows_t[nodes], 0)
        pos = np.full(n_rows, -1, np.int64)
        pos[idx[ok]] = np.flatnonzero(ok)
        one = np.float64(1)
        cores = np.where(ok, g.cores[idx], one)
        geom_pos: tuple[tuple[int, npt.NDArray[np.int64]], ...] = ()
        if geoms and ok.size:
            gflat = np.where(ok, g.geom[idx], -1).ravel()
            geom_pos = tuple(
                (int(gid), np.flatnonzero(gflat == gid)) for gid in np.unique(gflat[gflat >= 0])
            )
        luts: dict[str, Any] = {}
        if geoms:
            size = ok.size
            off = np.zeros(size, np.int64)
            stride = np.zeros(size, np.int64)
            full = np.zeros(size, np.int64)
            parts: list[list[npt.NDArray[Any]]] = [
                [np.array([-1], np.int64)],
                [np.array([-1], np.int64)],
                [np.zeros(1)],
                [np.zeros(1)],
                [np.zeros(1, np.int64)],
            ]
            base = 1
            for gid, gp in geom_pos:
                geom = state.geometries[gid]
                off[gp] = base
                stride[gp] = len(geom.profiles) + 1
                full[gp] = geom.table.full_mask
                for part, arr in zip(parts, geom.luts, strict=True):
                    part.append(arr)
                base += geom.luts.profile.size
            luts = dict(
                lut_off=off,
                lut_stride=stride,
                lut_full=full,
                lut=ChoiceLuts(*(np.concatenate(part) for part in parts)),
            )
        return PathTable(
            nodes=nodes,
            idx=idx,
            ok=ok,
            pos=pos,
            slots=np.where(ok, g.slots[idx], one),
            mem=np.where(ok, g.mem[idx], one),
            cores=cores,
            type_id=np.where(ok, g.type_id[idx], 0).astype(np.int32),
            numa=np.where(ok, g.numa[idx], -1).astype(np.int16),
            tie_key=tie_key(ok, g.numa[idx]),
            geoms=geom_pos,
            min_cores=float(cores[ok].min()) if ok.any() else float("inf"),
            **luts,
        )


def tie_key(ok: npt.NDArray[np.bool_], numa: npt.NDArray[np.int16]) -> npt.NDArray[np.int32]:
    """Per table entry, a key whose largest among tied columns is the GPU HAMi takes: the
    highest NUMA node, then the highest column (columns are in GPU index order)."""
    w = ok.shape[1]
    key = np.maximum(numa.astype(np.int32), 0) * w + np.arange(1, w + 1, dtype=np.int32)
    return np.where(ok, key, 0).astype(np.int32)


@dataclass(frozen=True)
class Layout:
    """Nodes with GPUs as segments of consecutive rows, in row order.

    Segment i covers rows ``[starts[i], starts[i+1])``; rows in it that no node owns
    (``node == -1``) must be masked out by callers. ``gpu_rows`` lists each segment's live rows
    as a column of a [GPUs per node, segments] table, for per-node reductions along axis 0
    (much faster than ``reduceat`` over thousands of short segments).
    """

    version: int
    n_rows: int
    starts: npt.NDArray[np.int64]
    node_idx: npt.NDArray[np.int64]
    names: tuple[str, ...]
    seg_of_row: npt.NDArray[np.int64]  # -1 for dead rows
    gpu_less: tuple[str, ...]  # nodes that register no GPU
    geom_rows: tuple[tuple[int, npt.NDArray[np.int64]], ...]  # (geometry id, live MIG rows)
    seg_index: Mapping[str, int]  # node name -> segment
    gpu_rows: npt.NDArray[np.int64]  # [W, S] row of the segment's j-th GPU; 0 where none
    gpu_rows_ok: npt.NDArray[np.bool_] | None  # [W, S] where gpu_rows is a GPU; None: all are
    gpu_count: npt.NDArray[np.int64]  # [S] GPUs per segment
    name_rank: npt.NDArray[np.int64]  # [S] position of the name in sorted order
    core: PathTable | None = None  # healthy live hami-core GPUs
    mig: PathTable | None = None  # healthy live MIG GPUs with a geometry
    # Healthy live MPS GPUs: a path of their own (one container's devices are of one mode),
    # evaluated by the same code as hami-core's.
    mps: PathTable | None = None
    # Per-segment work arrays of decisions (see ``Scratch``); its lock guards the tables' too.
    scratch: Scratch = field(default_factory=Scratch, repr=False, compare=False)

    def tables(self) -> tuple[tuple[GpuMode, PathTable | None], ...]:
        """The placement paths' tables by mode, in the order the engine weighs them (the
        earlier wins a tie)."""
        return (("hami-core", self.core), ("mig", self.mig), ("mps", self.mps))

    @staticmethod
    def of(state: ClusterState) -> Layout:
        entries = sorted((e for e in state.nodes.values() if e.devices), key=lambda e: e.start)
        return Layout.build(
            state.layout_version,
            state,
            state._used_rows,
            names=tuple(e.name for e in entries),
            node_idx=np.array([e.idx for e in entries], np.int64),
            starts=np.array([e.start for e in entries], np.int64),
            counts=np.array([len(e.devices) for e in entries], np.int64),
            gpu_less=tuple(sorted(e.name for e in state.nodes.values() if not e.devices)),
        )

    @staticmethod
    def build(
        version: int,
        src: GpuSource,
        n_rows: int,
        *,
        names: tuple[str, ...],
        node_idx: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
        gpu_less: tuple[str, ...],
    ) -> Layout:
        """The layout of the first ``n_rows`` rows of ``src``: nodes ``names`` (in row order;
        ``node_idx``: the state's index of each), whose GPUs are ``counts`` consecutive rows
        from ``starts``. The state's whole layout, or a what-if's few nodes."""
        g = src.gpus
        S = len(names)
        seg_of_row = np.full(n_rows, -1, np.int64)
        width = int(counts.max()) if S else 0
        j = np.arange(width, dtype=np.int64)[:, None]
        ok = j < counts[None, :]
        gpu_rows = np.where(ok, starts[None, :] + j, 0)
        seg_of_row[gpu_rows[ok]] = np.broadcast_to(np.arange(S, dtype=np.int64), ok.shape)[ok]
        live = g.node[:n_rows] >= 0
        geom = g.geom[:n_rows]
        mode = g.mode[:n_rows]
        mig_live = live & (mode == _MIG) & (geom >= 0)
        geom_rows = tuple(
            (int(gid), np.flatnonzero(mig_live & (geom == gid)))
            for gid in np.unique(geom[mig_live])
        )
        rows_t = np.ascontiguousarray(gpu_rows.T)
        ok_t = np.ascontiguousarray(ok.T)
        healthy = live & g.healthy[:n_rows]
        core = PathTable.of(src, n_rows, rows_t, ok_t, healthy & (mode == _CORE), geoms=False)
        mig = PathTable.of(src, n_rows, rows_t, ok_t, healthy & mig_live, geoms=True)
        mps = PathTable.of(src, n_rows, rows_t, ok_t, healthy & (mode == _MPS), geoms=False)
        name_rank = np.empty(S, np.int64)
        name_rank[sorted(range(S), key=names.__getitem__)] = np.arange(S)
        return Layout(
            version=version,
            n_rows=n_rows,
            starts=starts,
            node_idx=node_idx,
            names=names,
            seg_of_row=seg_of_row,
            gpu_less=gpu_less,
            geom_rows=geom_rows,
            seg_index={name: i for i, name in enumerate(names)},
            gpu_rows=gpu_rows,
            gpu_rows_ok=None if ok.all() else ok,
            gpu_count=counts,
            name_rank=name_rank,
            core=core,
            mig=mig,
            mps=mps,
        )


def build_state(
    config: DeviceConfig,
    nodes: Iterable[tuple[str, tuple[GpuDevice, ...], int, int]],
    pods: Mapping[str, PodAllocation],
) -> ClusterState:
    """A state built from scratch (what a restart does); equals the incremental one."""
    state = ClusterState(config)
    for name, devices, cpu, mem in nodes:
        state.upsert_node(name, devices, cpu_milli=cpu, memory_bytes=mem)
    for key, alloc in pods.items():
        state.upsert_pod(alloc, key)
    return state
