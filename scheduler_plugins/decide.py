"""One scheduling decision per pod: every node's verdict, score and planned devices.

This is what the plugin server answers in one round trip. Every node's verdict comes from
vectorized numpy over per-path tables of the GPU rows of ``ClusterState``: mostly from how many
GPUs of a node can take a device of each container (``_feasible``), with the full evaluation
(``_evaluate``: devices picked and counted container by container) only for the nodes those
counts can't decide. A node's planned devices are evaluated when asked for (``plan_for``; a
scheduling cycle reserves one node), and failure reasons when an explanation needs them. A
Decision is valid until the next change of the state it was computed from.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from enum import IntFlag
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from scheduler_plugins.annotations import GpuMode
from scheduler_plugins.node_register import Placement
from scheduler_plugins.pod_annotations import DeviceAlloc, MigAllocation
from scheduler_plugins.pods import ContainerRequest, PodAllocation, PodRequest
from scheduler_plugins.policy import Policy
from scheduler_plugins.state import (
    MAX_SLICES,
    ClusterState,
    Geometry,
    GpuArrays,
    Layout,
    PathTable,
    Scratch,
)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]


class Reason(IntFlag):
    """Why a GPU (and, OR-ed over its GPUs, a node) cannot take the request."""

    NO_GPU = 1 << 0
    UNHEALTHY = 1 << 1
    TYPE = 1 << 2
    UUID = 1 << 3
    MODE = 1 << 4
    SLOTS = 1 << 5
    MEMORY = 1 << 6
    CORES = 1 << 7
    EXCLUSIVE = 1 << 8
    TOO_FEW_GPUS = 1 << 9
    MIG_NO_PROFILE = 1 << 10
    MIG_CAPACITY = 1 << 11
    MIG_FRAGMENTATION = 1 << 12
    MIG_CONFLICT = 1 << 13
    TOO_FEW_FITTING = 1 << 14


REASON_TEXT: dict[Reason, str] = {
    Reason.NO_GPU: "no GPU registered",
    Reason.UNHEALTHY: "GPU unhealthy",
    Reason.TYPE: "GPU type excluded by use-gputype/nouse-gputype",
    Reason.UUID: "GPU excluded by use-gpuuuid/nouse-gpuuuid",
    Reason.MODE: "GPU mode does not match nvidia.com/vgpu-mode",
    Reason.SLOTS: "no free vGPU slot",
    Reason.MEMORY: "insufficient GPU memory",
    Reason.CORES: "insufficient GPU cores",
    Reason.EXCLUSIVE: "gpucores 100 needs an unused GPU",
    Reason.TOO_FEW_GPUS: "fewer GPUs than requested",
    Reason.MIG_NO_PROFILE: "no allowed MIG profile large enough",
    Reason.MIG_CAPACITY: "MIG capacity: not enough free slices",
    Reason.MIG_FRAGMENTATION: "MIG fragmentation: enough free slices but no legal placement",
    Reason.MIG_CONFLICT: "inconsistent MIG reservations on GPU (fail closed)",
    Reason.TOO_FEW_FITTING: "fewer fitting GPUs than requested",
}


def reason_names(bits: int) -> list[str]:
    return [REASON_TEXT[r] for r in Reason if bits & r]


@dataclass(frozen=True)
class PlannedDevice:
    uuid: str
    mem: int
    cores: int
    mig_profile: str | None = None
    placement: Placement | None = None
    gpu_score: float = 0.0


@dataclass(frozen=True)
class PodPlan:
    """The devices a pod would take on one node, per container (pod order)."""

    pod: str
    node: str
    containers: tuple[tuple[PlannedDevice, ...], ...]

    def allocation(self, cpu_milli: int = 0, memory_bytes: int = 0) -> PodAllocation:
        shared: list[DeviceAlloc] = []
        mig: list[MigAllocation] = []
        for ci, devices in enumerate(self.containers):
            for di, d in enumerate(devices):
                if d.mig_profile is not None and d.placement is not None:
                    mig.append(MigAllocation(ci, di, d.uuid, d.mig_profile, d.placement))
                else:
                    shared.append(DeviceAlloc(d.uuid, d.mem, d.cores))
        return PodAllocation(
            self.pod, self.node, tuple(shared), tuple(mig), cpu_milli, memory_bytes
        )

    def device_allocs(self) -> tuple[tuple[DeviceAlloc, ...], ...]:
        return tuple(
            tuple(DeviceAlloc(d.uuid, d.mem, d.cores) for d in devices)
            for devices in self.containers
        )


@dataclass
class _ContainerPlan:
    request: ContainerRequest
    rows: I64  # [S, count], -1 where none
    mig_rank: I64  # [S, count], -1 for hami-core devices
    mig_start: I64  # [S, count]
    gpu_score: F64  # [S, count] GPU score (usage including this request)


class Decision:
    """Verdicts for every node (segments of the layout, plus GPU-less nodes).

    ``feasible`` is exact for every node. What only some callers need is computed on first
    use: ``reasons`` (Reason bits per node, meaningful where not feasible; only explanations
    need them) and a node's planned devices (``plan_for``; a scheduling cycle reserves one
    node). Both come from the GPU columns as they were at the decision: until they are
    computed the decision reads the state's live columns; the state tells it before they
    change, and it keeps a copy of them.
    """

    def __init__(
        self,
        request: PodRequest,
        layout: Layout,
        feasible: B,
        score: F64,
        desirability: F64,
        state: ClusterState,
        masks: _Masks,
        reasons: I64 | None = None,
        evaluated: _Evaluated | None = None,
    ) -> None:
        self.request = request
        self.layout = layout
        self.feasible = feasible  # [S]
        self.score = score  # [S] node usage score before this pod
        self.desirability = desirability  # [S] higher is better (score signed by node policy)
        self._state = state
        self._masks = masks
        self._reasons = reasons
        # Plans by segment, as computed: (plans, row of the segment in them).
        self._plans: dict[int, tuple[list[_ContainerPlan], int]] = {}
        self._evaluated = evaluated  # what the decision evaluated in full already
        self._view: _View | None = None
        if reasons is None or feasible.any():
            self._view = _View(state.gpus, state.geometries, state.types)
            state.watch(self)

    @property
    def reasons(self) -> I64:
        """[S] Reason bits, meaningful where not feasible."""
        if self._reasons is None:
            assert self._view is not None
            self._reasons = _reasons(
                self._view, self.layout, self.request, self._masks.uuid_ok, self.feasible
            )
            if not self.feasible.any():  # no plan will ever be asked for
                self._view = None
        return self._reasons

    def state_changing(self) -> None:
        """The state is about to change: keep the columns the lazy results need."""
        if self._view is not None:
            self._view = self._view.frozen(self.layout.n_rows)

    # --- queries ---

    def feasible_count(self) -> int:
        return int(np.count_nonzero(self.feasible))

    def best_node(self) -> str | None:
        """Highest desirability; ties by node name."""
        s = _best(self.feasible, self.desirability, self.layout)
        return None if s < 0 else str(self.layout.names[s])

    def node_index(self, node: str) -> int:
        return self.layout.seg_index.get(node, -1)

    def plan_for(self, node: str) -> PodPlan | None:
        self._check_fresh()
        s = self.node_index(node)
        if s < 0 or not self.feasible[s]:
            return None
        plans, row = self._plans_of(s)
        state = self._state
        g = state.gpus
        per_container: dict[int, tuple[PlannedDevice, ...]] = {}
        for cp in plans:
            devices: list[PlannedDevice] = []
            for k in range(cp.request.count):
                r = int(cp.rows[row, k])
                uuid = _row_uuid(state, node, r)
                rank = int(cp.mig_rank[row, k])
                if rank >= 0:
                    geom = state.geometries[int(g.geom[r])]
                    prof = geom.profiles[rank]
                    start = int(cp.mig_start[row, k])
                    size = next(p.size for p in prof.placements if p.start == start)
                    devices.append(
                        PlannedDevice(
                            uuid,
                            prof.memory_mb,
                            prof.core,
                            prof.name,
                            Placement(start, size),
                            float(cp.gpu_score[row, k]),
                        )
                    )
                else:
                    devices.append(
                        PlannedDevice(
                            uuid,
                            cp.request.mem_for(int(g.mem[r])),
                            cp.request.cores,
                            gpu_score=float(cp.gpu_score[row, k]),
                        )
                    )
            per_container[cp.request.index] = tuple(devices)
        return PodPlan(
            self.request.key,
            node,
            tuple(per_container.get(i, ()) for i in range(self.request.container_count)),
        )

    def verdicts(self) -> list[tuple[str, bool, float, list[str]]]:
        """(node, feasible, score, reasons) for every node, sorted by name (for people)."""
        out = [
            (
                name,
                bool(self.feasible[i]),
                float(self.score[i]),
                [] if self.feasible[i] else reason_names(int(self.reasons[i])),
            )
            for i, name in enumerate(self.layout.names)
        ]
        out += [(name, False, 0.0, [REASON_TEXT[Reason.NO_GPU]]) for name in self.layout.gpu_less]
        return sorted(out)

    def _plans_of(self, s: int) -> tuple[list[_ContainerPlan], int]:
        """The plans of feasible segment ``s``, and its row in them: from what the decision
        evaluated already, or evaluated now for ``s`` alone."""
        found = self._plans.get(s)
        if found is None:
            if self._evaluated is not None and (row := self._evaluated.row(s)) >= 0:
                found = (self._evaluated.plans, row)
            else:
                found = (self._evaluate_node(s), 0)
            self._plans[s] = found
        return found

    def _evaluate_node(self, s: int) -> list[_ContainerPlan]:
        """The full evaluation (``_evaluate``) of segment ``s`` alone: its planned devices."""
        assert self._view is not None
        layout = self.layout
        owned = layout.scratch.acquire()  # for the tables' memo; never waits
        try:
            ok, plans = _evaluate(
                self._view, layout, self.request, self._masks, np.array([s], np.int64), owned
            )
        finally:
            if owned:
                layout.scratch.release()
        if not ok[0]:
            raise RuntimeError(
                f"node {layout.names[s]} was counted feasible for {self.request.key} but its "
                "evaluation finds no devices (a scheduling-core bug; please report it)"
            )
        return plans

    def _check_fresh(self) -> None:
        if self._state.layout_version != self.layout.version:
            raise RuntimeError("decision used after the cluster layout changed; decide again")


def _best(feasible: B, desirability: F64, layout: Layout) -> int:
    """The feasible segment of highest desirability, ties by node name; -1 if none."""
    idx = np.flatnonzero(feasible)
    if idx.size == 0:
        return -1
    des = desirability[idx]
    tied = idx[des >= des.max() - 1e-9]
    rank = layout.name_rank
    if rank is None or tied.size < 8:
        return int(min(tied.tolist(), key=layout.names.__getitem__))
    return int(tied[rank[tied].argmin()])


@dataclass(frozen=True)
class _Evaluated:
    """Plans from a full evaluation of some segments (``segs``; None: all of them)."""

    segs: I64 | None
    plans: list[_ContainerPlan]

    def row(self, s: int) -> int:
        """The row of segment ``s`` in ``plans``; -1 if not evaluated."""
        if self.segs is None:
            return s
        i = int(np.searchsorted(self.segs, s))
        return i if i < self.segs.size and int(self.segs[i]) == s else -1


def _row_uuid(state: ClusterState, node: str, row: int) -> str:
    entry = state.nodes[node]
    return entry.devices[row - entry.start].id


class _StateLike(Protocol):
    @property
    def gpus(self) -> GpuArrays: ...
    @property
    def geometries(self) -> list[Geometry]: ...
    @property
    def types(self) -> list[str]: ...


_COLUMNS = tuple(f.name for f in fields(GpuArrays) if f.name != "slice_use")


class _View:
    """The GPU columns a lazy computation reads: the state's live ones, or a frozen copy."""

    def __init__(self, gpus: GpuArrays, geometries: list[Geometry], types: list[str]) -> None:
        self.gpus = gpus
        self.geometries = geometries
        self.types = types

    def frozen(self, n: int) -> _View:
        g = self.gpus
        copy_ = GpuArrays(**{name: getattr(g, name)[:n].copy() for name in _COLUMNS})
        # Geometries and types are only ever appended to: a snapshot of the list is enough.
        return _View(copy_, list(self.geometries), list(self.types))


class _Usage:
    """Usage columns; copied on first write so the state is never touched by a decision."""

    def __init__(self, state: _StateLike, n: int) -> None:
        g = state.gpus
        self.slots: F64 = g.used_slots[:n]
        self.mem: F64 = g.used_mem[:n]
        self.cores: F64 = g.used_cores[:n]
        self.mask: I64 = g.mig_mask[:n]
        self._copied = False

    def writable(self) -> _Usage:
        if not self._copied:
            self.slots, self.mem = self.slots.copy(), self.mem.copy()
            self.cores, self.mask = self.cores.copy(), self.mask.copy()
            self._copied = True
        return self

    def scratch(self) -> _Usage:
        """A private writable copy, for tentative devices that must not reach the caller's."""
        u = copy.copy(self)
        u._copied = False
        return u.writable()


def _per_gpu(values: npt.NDArray[Any], layout: Layout, fill: float) -> npt.NDArray[Any]:
    """``values`` of each segment's GPUs as a [GPU, segment] table; ``fill`` where none."""
    table = values[layout.gpu_rows]
    if layout.gpu_rows_ok is not None:
        table = np.where(layout.gpu_rows_ok, table, fill)
    return table


def _bits(mask: B, reason: Reason) -> I64:
    """``reason`` where ``mask``, else 0. A multiply: np.where is ~8x slower on mixed masks."""
    return mask * np.int64(reason)


_OK_OFFSET = np.array([-np.inf, 0.0])  # indexed by a bool: -inf where not ok
_OK_OFFSET.setflags(write=False)


def _seg_max_first(values: F64, ok: B, layout: Layout) -> tuple[I64, B]:
    """Per segment: the first row with the maximum value among ``ok`` rows (``values`` finite)."""
    v = _per_gpu(values + np.take(_OK_OFFSET, ok.view(np.uint8)), layout, -np.inf)
    seg_max = v.max(axis=0)
    found = seg_max > -np.inf  # ok rows have finite values
    # argmax of a bool column is its first True: rows of a segment ascend with the GPU index.
    first = (v >= seg_max - 1e-9).argmax(axis=0)
    best = layout.gpu_rows[first, np.arange(first.size)]
    return np.where(found, best, -1), found


def decide(state: ClusterState, request: PodRequest) -> Decision:
    layout = state.layout()
    # The layout's work arrays (and its tables'), unless another decision holds them now.
    owned = layout.scratch.acquire()
    try:
        return _decide(state, request, layout, owned)
    finally:
        if owned:
            layout.scratch.release()


@dataclass(frozen=True)
class _Masks:
    """What a request excludes regardless of usage: GPU types and UUIDs (by its selectors), and
    every GPU with inconsistent MIG reservations when there is any (``conflict``)."""

    ok_types: B | None  # by type id
    uuid_ok: B | None  # by GPU row
    conflict: bool


def _decide(state: ClusterState, request: PodRequest, layout: Layout, owned: bool) -> Decision:
    n = layout.n_rows
    S = len(layout.names)
    uuid_ok = (
        _uuid_mask(state, layout, request, owned)
        if request.use_uuids or request.nouse_uuids
        else None
    )
    if S == 0:  # no node registers a GPU
        empty = np.zeros(0)
        masks = _Masks(None, uuid_ok, False)
        return Decision(
            request,
            layout,
            np.zeros(0, np.bool_),
            empty,
            empty,
            state,
            masks,
            reasons=np.zeros(0, np.int64),
        )
    ok_types: B | None = None
    if request.use_types or request.nouse_types:
        ok_types = np.array([_type_ok(t, request) for t in state.types] or [True], np.bool_)
    masks = _Masks(ok_types, uuid_ok, bool(state.gpus.conflict[:n].any()))
    score = _node_scores(state, layout)
    desirability = score * request.node_policy.sign
    feasible, evaluated = _feasible(state, layout, request, masks, owned, desirability)
    return Decision(
        request=request,
        layout=layout,
        feasible=feasible,
        score=score,
        desirability=desirability,
        state=state,
        masks=masks,
        evaluated=evaluated,
    )


# Feasibility without planning devices. A container fits a path of a node when enough of the
# node's GPUs on that path can each take one of its devices, counted on the usage before the
# pod: usage only grows while a pod is planned, so a GPU that can't take a device then never
# can, and a GPU no earlier container of the pod touched is as it was. Hence, with D devices
# planned before container c (at most D GPUs touched):
#   sure:     some path has >= count(c) + D fitting GPUs          (untouched ones suffice)
#   possible: some path has >= count(c) fitting GPUs (hami-core: distinct cards) or >= 1 (MIG:
#             one card can take several instances)
# A node is feasible if every container is sure, infeasible if one is not possible; only the
# nodes in between get the full evaluation. Single-container pods (apart from MIG with several
# devices) have none in between.


def _feasible(
    state: ClusterState,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    owned: bool,
    desirability: F64,
) -> tuple[B, _Evaluated | None]:
    """Every node's verdict, and the plans of the nodes evaluated in full for it: those the
    counts can't decide and, with them, the best node the counts find feasible (so the plan of
    the best node, whichever it turns out to be, is among them)."""
    S = len(layout.names)
    if not request.containers:
        return np.ones(S, np.bool_), None
    paths = _paths(state, layout, request, masks, owned, None, kept_usage=owned)
    sure = np.ones(S, np.bool_)
    possible = sure.copy()
    counts: dict[tuple[int, int, int], list[npt.NDArray[Any] | None]] = {}
    before = 0  # devices of the containers planned before this one
    for c in request.containers:
        key = (c.mem_mib, c.mem_percent, c.cores)
        per_path = counts.get(key)
        if per_path is None:
            per_path = counts[key] = [p.fit_counts(c) for p in paths]
        # The first container's count is exact on hami-core, and on MIG for one device.
        exact = before == 0 and (c.count == 1 or not any(p.mig for p in paths))
        sure_c = np.zeros(S, np.bool_)
        possible_c = sure_c if exact else np.zeros(S, np.bool_)
        for path, cnt in zip(paths, per_path, strict=True):
            if cnt is None:  # no GPU of this path can take one device
                continue
            nodes = path.table.nodes
            sure_c[nodes] |= cnt >= before + c.count
            if not exact:
                possible_c[nodes] |= cnt >= (1 if path.mig else c.count)
        sure &= sure_c
        possible &= possible_c
        before += c.count
    unsure = possible
    unsure &= ~sure
    if not unsure.any():
        return sure, None
    best = _best(sure, desirability, layout)
    if best >= 0:
        unsure[best] = True
    segs = np.flatnonzero(unsure)
    if segs.size * 3 > S:  # the full tables are cheaper than gathering most of their rows
        ok, plans = _evaluate(state, layout, request, masks, None, owned)
        return ok, _Evaluated(None, plans)
    ok, plans = _evaluate(state, layout, request, masks, segs, owned)
    sure[segs] = ok
    return sure, _Evaluated(segs, plans)


def _paths(
    src: _StateLike,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    owned: bool,
    segs: I64 | None,
    *,
    kept_usage: bool = False,
) -> list[_Path]:
    """The request's paths (hami-core, MIG: the allowed ones with GPUs), over the whole tables
    or only the rows of segments ``segs``. ``kept_usage``: the paths read the usage each table
    keeps (``_kept_usage``; ``src`` is the state, the tables' scratch is owned) and must not
    count devices in it."""
    allow_core = request.mode in (None, "hami-core")
    allow_mig = request.mode in (None, "mig")
    paths: list[_Path] = []
    for allow, table, mig in ((allow_core, layout.core, False), (allow_mig, layout.mig, True)):
        if not allow or table is None or not table.nodes.size:
            continue
        memo = table.scratch.memo if owned else None
        if segs is None:
            scratch = table.scratch if owned else Scratch()
            usage = None
            if kept_usage:
                assert isinstance(src, ClusterState) and owned
                usage = _kept_usage(src, table, mig)
            paths.append(_Path(src, table, masks, mig=mig, scratch=scratch, memo=memo, usage=usage))
            continue
        sub = _rows_of(table, segs, memo)
        if sub is not None:
            paths.append(_Path(src, sub, masks, mig=mig, scratch=Scratch(), memo=memo, full=table))
    return paths


def _kept_usage(state: ClusterState, table: PathTable, mig: bool) -> tuple[F64, F64, F64, I64]:
    """The state's usage columns gathered into ``table`` [P, W] (used slots, memory, cores, MIG
    mask; an empty mask for hami-core), kept with the table and refreshed where pods changed
    rows since: gathering 40k-row columns is most of what a decision costs otherwise. Only the
    table's ok positions are kept current. Call while owning the table's scratch; read-only."""
    memo = table.scratch.memo
    g = state.gpus
    columns: list[npt.NDArray[Any]] = [g.used_slots, g.used_mem, g.used_cores]
    if mig:
        columns.append(g.mig_mask)
    clock = state.usage_clock
    kept: tuple[int, list[npt.NDArray[Any]]] | None = memo.get("usage")
    arrays: list[npt.NDArray[Any]] | None = None
    if kept is not None:
        changed = state.usage_changes_since(kept[0])
        if changed is not None and len(changed) * 8 < table.idx.size:
            arrays = kept[1]
            pos = table.pos[changed] if changed else table.pos[:0]
            pos = pos[pos >= 0]
            if pos.size:
                rows = table.idx.ravel()[pos]
                for a, column in zip(arrays, columns, strict=True):
                    a.ravel()[pos] = column[rows]
    if arrays is None:
        arrays = [np.take(column, table.idx) for column in columns]
    memo["usage"] = (clock, arrays)
    mask = arrays[3] if mig else np.zeros(0, np.int64)
    return arrays[0], arrays[1], arrays[2], mask


def _evaluate(
    src: _StateLike,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    segs: I64 | None,
    owned: bool,
) -> tuple[B, list[_ContainerPlan]]:
    """Every container on every allowed path, each container's planned devices counted before
    the next: (feasible, plans) of the segments ``segs`` (all when None), indexed like them.
    Every step is per node, so a subset of segments gets what the whole layout would."""
    S = len(layout.names) if segs is None else int(segs.size)
    paths = _paths(src, layout, request, masks, owned, segs)
    work = layout.scratch if owned and segs is None else Scratch()
    # What the Decision keeps is allocated here, fresh; work arrays never reach it.
    feasible = np.ones(S, np.bool_)
    plans: list[_ContainerPlan] = []
    remaining = request.device_count
    sign = request.gpu_policy.sign
    ok_c = work.get("ok_c", (S,), np.bool_)
    desir_c = work.get("desir_c", (S,), np.float64)
    winner = work.get("winner", (S,), np.int64)  # the path each node's devices come from
    for c in request.containers:
        remaining -= c.count
        rows = np.full((S, c.count), -1, np.int64)
        rank = np.full((S, c.count), -1, np.int64)
        start = np.full((S, c.count), -1, np.int64)
        gscore = np.zeros((S, c.count))
        ok_c.fill(False)
        desir_c.fill(-np.inf)
        winner.fill(-1)
        outs: list[_PathResult] = []
        for i, path in enumerate(paths):
            res = path.mig_path(c, sign) if path.mig else path.core_path(c, sign)
            outs.append(res)
            nodes = path.table.nodes
            oc = ok_c[nodes]
            better = res.ok & (~oc | (res.desir > desir_c[nodes]))
            ok_c[nodes] = oc | res.ok
            bn = nodes[better]
            desir_c[bn] = res.desir[better]
            rows[bn] = res.rows[better]
            gscore[bn] = res.scores[better]
            if res.rank is not None and res.start is not None:
                rank[bn] = res.rank[better]
                start[bn] = res.start[better]
            else:
                rank[bn] = -1
                start[bn] = -1
            winner[bn] = i
        feasible &= ok_c
        plans.append(_ContainerPlan(c, rows, rank, start, gscore))
        if remaining > 0:  # count this container's devices (on its chosen path) for the next
            for i, (path, res) in enumerate(zip(paths, outs, strict=True)):
                path.commit(c, np.flatnonzero(winner[path.table.nodes] == i), res)
    if not request.containers:
        feasible[:] = True
    return feasible, plans


def _score(
    slots: F64,
    mem: F64,
    cores: F64,
    u_slots: F64,
    u_mem: F64,
    u_cores: F64,
    req_mem: F64 | float,
    req_cores: F64 | float,
    work: tuple[F64, F64, B] | None = None,
) -> F64:
    """The GPU score, as ``_gpu_score`` computes it (same operations, same order). With
    ``work`` (result, temporary, finite flags: arrays of the inputs' shape), nothing is
    allocated and the result is ``work[0]``."""
    if work is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            s = (
                (1 + u_slots) / slots + (req_cores + u_cores) / cores + (req_mem + u_mem) / mem
            ) * 10
        return s if np.isfinite(s).all() else np.nan_to_num(s)
    s, t, finite = work
    with np.errstate(divide="ignore", invalid="ignore"):
        np.add(u_slots, 1, out=s)
        np.divide(s, slots, out=s)
        np.add(u_cores, req_cores, out=t)
        np.divide(t, cores, out=t)
        np.add(s, t, out=s)
        np.add(u_mem, req_mem, out=t)
        np.divide(t, mem, out=t)
        np.add(s, t, out=s)
        np.multiply(s, 10, out=s)
    if not np.isfinite(s, out=finite).all():  # inf/nan: zero capacity
        np.nan_to_num(s, copy=False)
    return s


# Tables up to this many positions (a few nodes' rows) are evaluated with plain expressions:
# for them, what a numpy call costs is its call, and work arrays only add calls.
_SMALL = 256


def _pick(desir: F64, avail: B, work: Scratch) -> tuple[I64, B]:
    """Per table row: the first column with the maximum ``desir`` among ``avail`` columns
    (``desir`` finite). Column-wise maxima: numpy's axis-1 reductions over 8 columns are slow."""
    shape = desir.shape
    if desir.size <= _SMALL:  # the same maxima and comparisons, in fewer calls
        v0 = desir + _OK_OFFSET[avail.view(np.uint8)]
        top0 = v0.max(axis=1)
        return (v0 >= (top0 - 1e-9)[:, None]).argmax(axis=1), top0 > -np.inf
    v = work.get("pick_v", shape, np.float64)  # desir, -inf where not available
    np.take(_OK_OFFSET, avail.view(np.uint8), out=v, mode="clip")
    np.add(desir, v, out=v)
    top = work.get("pick_top", shape[:1], np.float64)
    np.copyto(top, v[:, 0])
    for j in range(1, v.shape[1]):
        np.maximum(top, v[:, j], out=top)
    found = top > -np.inf
    top -= 1e-9
    at_top = work.get("pick_at_top", shape, np.bool_)
    np.greater_equal(v, top[:, None], out=at_top)
    first = at_top.argmax(axis=1)
    return first, found


# Each row's W booleans read as one unsigned word: times 0x0101...01, the top byte is their sum.
_BYTE_SUM: dict[int, tuple[type[np.unsignedinteger[Any]], int, int]] = {
    1: (np.uint8, 0x01, 0),
    2: (np.uint16, 0x0101, 8),
    4: (np.uint32, 0x01010101, 24),
    8: (np.uint64, 0x0101010101010101, 56),
}


def _row_counts(fit: B) -> npt.NDArray[Any]:
    """Per row of ``fit`` [P, W], how many are True (axis-1 sums of 8 columns are slow)."""
    spec = _BYTE_SUM.get(fit.shape[1])
    if spec is None or not fit.flags.c_contiguous:
        counts: npt.NDArray[Any] = fit.sum(axis=1)
        return counts
    dtype, mul, shift = spec
    words = fit.view(np.uint8).view(dtype).reshape(fit.shape[0])
    sums: npt.NDArray[Any] = words * dtype(mul)  # a new array: ``fit`` stays as it is
    sums >>= dtype(shift)
    return sums


class _Table(Protocol):
    """What a path evaluation reads of a table: a ``PathTable`` or some of its rows."""

    @property
    def nodes(self) -> I64: ...
    @property
    def idx(self) -> I64: ...
    @property
    def ok(self) -> B: ...
    @property
    def slots(self) -> F64: ...
    @property
    def mem(self) -> F64: ...
    @property
    def cores(self) -> F64: ...
    @property
    def type_id(self) -> npt.NDArray[np.int32]: ...
    @property
    def min_cores(self) -> float: ...
    @property
    def lut_off(self) -> I64 | None: ...
    @property
    def lut_stride(self) -> I64 | None: ...
    @property
    def lut_full(self) -> I64 | None: ...
    @property
    def lut(self) -> tuple[I64, I64, F64, F64] | None: ...


@dataclass(frozen=True)
class _TableRows:
    """The rows of a ``PathTable`` that belong to some segments. ``nodes`` are positions in
    those segments (not segments); ``flat`` selects their positions in the full table."""

    nodes: I64
    idx: I64
    ok: B
    slots: F64
    mem: F64
    cores: F64
    type_id: npt.NDArray[np.int32]
    min_cores: float
    lut_off: I64 | None
    lut_stride: I64 | None
    lut_full: I64 | None
    lut: tuple[I64, I64, F64, F64] | None
    flat: I64 | slice

    @staticmethod
    def of(table: PathTable, segs: I64) -> _TableRows | None:
        """The rows of ``segs`` (ascending segments), or None if the table has none of them."""
        at = np.minimum(np.searchsorted(table.nodes, segs), table.nodes.size - 1)
        local = np.flatnonzero(table.nodes[at] == segs)
        if not local.size:
            return None
        rows = at[local]
        w = table.idx.shape[1]
        first, end = int(rows[0]), int(rows[-1]) + 1
        sel: I64 | slice
        flat: I64 | slice
        if end - first == rows.size:  # consecutive rows (a single node, say): views suffice
            sel, flat = slice(first, end), slice(first * w, end * w)
        else:
            sel, flat = rows, (rows[:, None] * w + np.arange(w)).ravel()

        def part(a: I64 | None) -> I64 | None:
            return None if a is None else a[flat]

        return _TableRows(
            nodes=local,
            idx=table.idx[sel],
            ok=table.ok[sel],
            slots=table.slots[sel],
            mem=table.mem[sel],
            cores=table.cores[sel],
            type_id=table.type_id[sel],
            min_cores=table.min_cores,
            lut_off=part(table.lut_off),
            lut_stride=part(table.lut_stride),
            lut_full=part(table.lut_full),
            lut=table.lut,
            flat=flat,
        )


def _rows_of(table: PathTable, segs: I64, memo: dict[Any, Any] | None) -> _TableRows | None:
    """``_TableRows.of``, kept in the table's ``memo`` for single nodes (plans are asked for
    one node at a time, often the same few)."""
    if memo is None or segs.size != 1:
        return _TableRows.of(table, segs)
    kept: dict[int, _TableRows | None] = memo.setdefault("rows_of_node", {})
    s = int(segs[0])
    if s not in kept:
        if len(kept) >= 256:
            kept.clear()
        kept[s] = _TableRows.of(table, segs)
    return kept[s]


@dataclass
class _PathResult:
    """One container on one path, per table row (work arrays: read before the next call)."""

    ok: B  # [P] every device found
    desir: F64  # [P] sum of the devices' desirability
    rows: I64  # [P, count] GPU rows
    scores: F64  # [P, count] GPU scores
    pos: I64  # [P, count] flat positions in the path's table
    rank: I64 | None = None  # [P, count] MIG profile rank
    start: I64 | None = None  # [P, count] MIG placement start


class _Path:
    """One path's (hami-core or MIG) GPUs for one decision: usage gathered into the path's
    dense per-node table (or some of its rows) once; containers' planned devices are counted in
    it (never the state's). The last evaluation (fit and GPU scores per position) is kept with
    the positions changed since, so a container asking the same as the previous one is
    re-evaluated only where the previous container's devices went.

    Everything per position or per table row lives in ``scratch`` (the table's work arrays,
    reused by the next decision): what ``core_path``/``mig_path`` return must be copied
    before the next call. ``memo`` keeps what depends on the full table and a request only."""

    def __init__(
        self,
        src: _StateLike,
        table: _Table,
        masks: _Masks,
        *,
        mig: bool,
        scratch: Scratch,
        memo: dict[Any, Any] | None,
        full: PathTable | None = None,
        usage: tuple[F64, F64, F64, I64] | None = None,
    ) -> None:
        g = src.gpus
        self.src = src
        self.table = table
        self.full = full  # the table ``table`` is some rows of; None: ``table`` is full
        self.memo = memo
        self.mig = mig
        self.scratch = sc = scratch
        idx = table.idx
        self.shape: tuple[int, int] = (idx.shape[0], idx.shape[1])
        ok = table.ok
        ok_types, uuid_ok = masks.ok_types, masks.uuid_ok
        if ok_types is not None or uuid_ok is not None or masks.conflict:
            ok = sc.get("ok", self.shape, np.bool_)
            tmp = sc.get("b0", self.shape, np.bool_)
            np.copyto(ok, table.ok)
            if ok_types is not None:
                ok &= np.take(ok_types, table.type_id, out=tmp, mode="clip")
            if uuid_ok is not None:
                ok &= np.take(uuid_ok, idx, out=tmp, mode="clip")
            if masks.conflict:
                gc = np.take(g.conflict, idx, out=sc.get("i32", self.shape, np.int32), mode="clip")
                ok &= np.equal(gc, 0, out=tmp)
        self.ok = ok
        if usage is not None:  # read-only: ``commit`` must not be called
            self.slots, self.mem, self.cores, self.mask = usage
        else:
            self.slots = self._gather(g.used_slots, "us")
            self.mem = self._gather(g.used_mem, "um")
            self.cores = self._gather(g.used_cores, "uc")
            self.mask = self._gather(g.mig_mask, "mask") if mig else np.zeros(0, np.int64)
        self.w = idx.shape[1]
        ar = sc.memo.get("ar")
        if ar is None:
            ar = sc.memo["ar"] = np.arange(table.nodes.size) * self.w
            ar.setflags(write=False)
        self.ar: I64 = ar
        self._cache: tuple[tuple[Any, ...], list[npt.NDArray[Any]]] | None = None
        self._dirty: list[I64] = []

    def _gather(self, column: npt.NDArray[Any], name: str) -> npt.NDArray[Any]:
        out = self.scratch.get(name, self.shape, column.dtype.type)
        return np.take(column, self.table.idx, out=out, mode="clip")

    def _copy(self, a: npt.NDArray[Any], name: str) -> npt.NDArray[Any]:
        out = self.scratch.get(name, a.shape, a.dtype.type)
        np.copyto(out, a)
        return out

    def _outputs(
        self, count: int, names: tuple[str, ...], fill: tuple[Any, ...]
    ) -> list[npt.NDArray[Any]]:
        """Per table row (and device) result arrays, filled; work arrays too."""
        P = self.shape[0]
        out: list[npt.NDArray[Any]] = []
        for name, value in zip(names, fill, strict=True):
            dtype = np.bool_ if isinstance(value, bool) else type(value)
            shape = (P,) if name in ("total", "found_all") else (P, count)
            a = self.scratch.get(name, shape, dtype)
            a.fill(value)
            out.append(a)
        return out

    def _reuse(self, key: tuple[Any, ...]) -> tuple[list[npt.NDArray[Any]], I64] | None:
        cache, dirty = self._cache, self._dirty
        self._dirty = []
        if cache is None or cache[0] != key:
            return None
        return cache[1], (np.concatenate(dirty) if dirty else np.zeros(0, np.int64))

    def fit_counts(self, c: ContainerRequest) -> npt.NDArray[Any] | None:
        """Per table row, how many GPUs could each take one device of ``c`` now; None if
        none of this path's GPUs can."""
        if not self.mig:
            return _row_counts(self._core_fit_all(c)[0])
        minr = self._min_rank(c)
        if minr is None:
            return None
        return _row_counts(self._mig_fit_all(self._mig_profile_all(minr, self.mask.ravel())[1]))

    def commit(self, c: ContainerRequest, chosen: I64, res: _PathResult) -> None:
        """Count ``c``'s planned devices on table rows ``chosen`` before the next container."""
        t = self.table
        for k in range(c.count):
            fp = res.pos[chosen, k]
            if not fp.size:
                continue
            if self.mig:
                assert res.rank is not None and res.start is not None
                bits, mem, cores = _mig_devices(
                    self.src, res.rows[chosen, k], res.rank[chosen, k], res.start[chosen, k]
                )
                self.mask.ravel()[fp] |= bits
                self.slots.ravel()[fp] += 1
                self.mem.ravel()[fp] += mem
                self.cores.ravel()[fp] += cores
            else:
                self.slots.ravel()[fp] += 1
                self.mem.ravel()[fp] += (
                    c.mem_mib if c.mem_mib else t.mem.ravel()[fp] * c.mem_percent // 100
                )
                self.cores.ravel()[fp] += c.cores
            self._dirty.append(fp)

    # --- hami-core ---

    def _core_eval(self, c: ContainerRequest, sign: float, pos: I64 | None) -> tuple[B, F64]:
        t = self.table
        slots, mem, cores = t.slots, t.mem, t.cores
        ok, us, um, uc = self.ok, self.slots, self.mem, self.cores
        if pos is not None:
            slots, mem, cores = slots.ravel()[pos], mem.ravel()[pos], cores.ravel()[pos]
            ok, us, um, uc = ok.ravel()[pos], us.ravel()[pos], um.ravel()[pos], uc.ravel()[pos]
        elif ok.size > _SMALL:
            return self._core_eval_all(c, sign)
        req_mem: F64 | float = (
            float(c.mem_mib) if c.mem_mib else np.floor(mem * c.mem_percent / 100)
        )
        fit = ok & (us < slots)
        fit &= mem - um >= req_mem
        fit &= cores - uc >= c.cores
        fit &= uc < cores
        if c.cores >= t.min_cores:  # else every card has more cores than asked: no exclusivity
            fit &= (c.cores < cores) | (us == 0)
        desir = _score(slots, mem, cores, us, um, uc, req_mem, float(c.cores))
        desir *= sign
        return fit, desir

    def _core_fit_all(self, c: ContainerRequest) -> tuple[B, F64 | float]:
        """Where every position can take one device of ``c`` (work arrays), and the memory
        it asks of each."""
        t, sc, shape = self.table, self.scratch, self.shape
        slots, mem, cores = t.slots, t.mem, t.cores
        ok, us, um, uc = self.ok, self.slots, self.mem, self.cores
        f = sc.get("f0", shape, np.float64)
        b = sc.get("b0", shape, np.bool_)
        req_mem: F64 | float
        if c.mem_mib:
            req_mem = float(c.mem_mib)
        else:
            pct: F64 = np.multiply(mem, c.mem_percent, out=sc.get("req_mem", shape, np.float64))
            req_mem = np.floor(np.divide(pct, 100, out=pct), out=pct)
        fit = np.less(us, slots, out=sc.get("fit", shape, np.bool_))
        fit &= ok
        fit &= np.greater_equal(np.subtract(mem, um, out=f), req_mem, out=b)
        fit &= np.greater_equal(np.subtract(cores, uc, out=f), c.cores, out=b)
        fit &= np.less(uc, cores, out=b)
        if c.cores >= t.min_cores:  # else every card has more cores than asked: no exclusivity
            excl = np.less(c.cores, cores, out=b)
            excl |= np.equal(us, 0, out=sc.get("b1", shape, np.bool_))
            fit &= excl
        return fit, req_mem

    def _core_eval_all(self, c: ContainerRequest, sign: float) -> tuple[B, F64]:
        """``_core_eval`` of every position, in work arrays (same operations, same results)."""
        t, sc, shape = self.table, self.scratch, self.shape
        fit, req_mem = self._core_fit_all(c)
        work = (
            sc.get("desir", shape, np.float64),
            sc.get("f0", shape, np.float64),
            sc.get("b0", shape, np.bool_),
        )
        us, um, uc = self.slots, self.mem, self.cores
        desir = _score(t.slots, t.mem, t.cores, us, um, uc, req_mem, float(c.cores), work)
        desir *= sign
        return fit, desir

    def core_path(self, c: ContainerRequest, sign: float) -> _PathResult:
        key = (c.mem_mib, c.mem_percent, c.cores, sign)
        reuse = self._reuse(key)
        if reuse is None:
            fit, desir = self._core_eval(c, sign, None)
        else:
            (fit, desir), dpos = reuse
            if dpos.size:
                f2, d2 = self._core_eval(c, sign, dpos)
                fit.ravel()[dpos] = f2
                desir.ravel()[dpos] = d2
        self._cache = (key, [fit, desir])
        t = self.table
        rows, scores, pos, total, found_all = self._outputs(
            c.count,
            ("rows", "scores", "pos", "total", "found_all"),
            (np.int64(-1), 0.0, np.int64(-1), 0.0, True),
        )
        avail = fit
        flat_d = desir.ravel()
        for k in range(c.count):
            first, found = _pick(desir, avail, self.scratch)
            found_all &= found
            at = self.ar + first
            pos[:, k] = at
            fpos = at[found]
            rows[found, k] = t.idx.ravel()[fpos]
            d = flat_d[fpos]
            total[found] += d
            scores[found, k] = d * sign
            if k + 1 < c.count:
                if avail is fit:
                    avail = self._copy(fit, "avail")
                avail.ravel()[fpos] = False
        return _PathResult(found_all, total, rows, scores, pos)

    # --- MIG ---

    def _min_rank(self, c: ContainerRequest) -> I64 | None:
        """Per position, the smallest profile rank the request accepts (R: none); None if
        no geometry has a profile large enough."""
        if self.full is None:
            assert isinstance(self.table, PathTable)
            return _min_rank(self.src, self.table, c, self.memo)
        minr = _min_rank(self.src, self.full, c, self.memo)
        assert isinstance(self.table, _TableRows)
        return None if minr is None else minr[self.table.flat]

    def _mig_profile_all(self, minr: I64, m: I64) -> tuple[I64, I64]:
        """Every position's choice-table index (flat) and chosen profile rank ([P, W], -1:
        none), in work arrays."""
        t, sc = self.table, self.scratch
        assert t.lut is not None and t.lut_off is not None
        assert t.lut_full is not None and t.lut_stride is not None
        flat = (t.idx.size,)
        li = np.bitwise_and(m, t.lut_full, out=sc.get("li", flat, np.int64))
        li *= t.lut_stride
        li += t.lut_off
        li += minr
        prof = np.take(t.lut[0], li, out=sc.get("prof", flat, np.int64), mode="clip")
        return li, prof.reshape(self.shape)

    def _mig_fit_all(self, prof: I64) -> B:
        t, sc, shape = self.table, self.scratch, self.shape
        fit: B = np.greater_equal(prof, 0, out=sc.get("fit", shape, np.bool_))
        fit &= np.less(self.slots, t.slots, out=sc.get("b0", shape, np.bool_))
        fit &= self.ok
        return fit

    def _mig_eval(
        self, minr: I64, sign: float, us: F64, um: F64, uc: F64, mask: I64, pos: I64 | None
    ) -> list[npt.NDArray[Any]]:
        t = self.table
        assert t.lut is not None and t.lut_off is not None
        assert t.lut_full is not None and t.lut_stride is not None
        off, full, stride = t.lut_off, t.lut_full, t.lut_stride
        slots, mem, cores, ok = t.slots, t.mem, t.cores, self.ok
        m = mask.ravel()
        shape: tuple[int, ...]
        if pos is not None:
            off, full, stride, minr, m = off[pos], full[pos], stride[pos], minr[pos], m[pos]
            slots, mem, cores = slots.ravel()[pos], mem.ravel()[pos], cores.ravel()[pos]
            ok, us, um, uc = ok.ravel()[pos], us.ravel()[pos], um.ravel()[pos], uc.ravel()[pos]
            shape = pos.shape
        elif ok.size > _SMALL:
            return self._mig_eval_all(minr, sign, us, um, uc, m)
        else:
            shape = ok.shape
        li = m & full
        li *= stride
        li += off
        li += minr
        prof = t.lut[0].take(li).reshape(shape)
        start = t.lut[1].take(li).reshape(shape)
        pmem = t.lut[2].take(li).reshape(shape)
        pcore = t.lut[3].take(li).reshape(shape)
        fit = prof >= 0
        fit &= us < slots
        fit &= ok
        desir = _score(slots, mem, cores, us, um, uc, pmem, pcore)
        desir *= sign
        return [prof, start, pmem, pcore, fit, desir]

    def _mig_eval_all(
        self, minr: I64, sign: float, us: F64, um: F64, uc: F64, m: I64
    ) -> list[npt.NDArray[Any]]:
        """``_mig_eval`` of every position, in work arrays (same operations, same results)."""
        t, sc, shape = self.table, self.scratch, self.shape
        assert t.lut is not None
        li, prof = self._mig_profile_all(minr, m)
        flat = (t.idx.size,)
        start, pmem, pcore = (
            np.take(lut, li, out=sc.get(name, flat, lut.dtype.type), mode="clip").reshape(shape)
            for name, lut in zip(("start", "pmem", "pcore"), t.lut[1:], strict=True)
        )
        fit = self._mig_fit_all(prof)
        work = (
            sc.get("desir", shape, np.float64),
            sc.get("f0", shape, np.float64),
            sc.get("b0", shape, np.bool_),
        )
        desir = _score(t.slots, t.mem, t.cores, us, um, uc, pmem, pcore, work)
        desir *= sign
        return [prof, start, pmem, pcore, fit, desir]

    def mig_path(self, c: ContainerRequest, sign: float) -> _PathResult:
        t = self.table
        rows, rank_out, start_out, scores, pos, total, found_all = self._outputs(
            c.count,
            ("rows", "rank_out", "start_out", "scores", "pos", "total", "found_all"),
            (np.int64(-1), np.int64(-1), np.int64(-1), 0.0, np.int64(-1), 0.0, True),
        )
        result = _PathResult(found_all, total, rows, scores, pos, rank_out, start_out)
        key = (c.mem_mib, c.mem_percent, c.cores, sign)
        reuse = self._reuse(key)
        if reuse is None:
            minr = self._min_rank(c)
            if minr is None:  # no profile large enough anywhere
                self._cache = None
                found_all[:] = False
                return result
            ev = self._mig_eval(minr, sign, self.slots, self.mem, self.cores, self.mask, None)
        else:
            cached, dpos = reuse
            minr, ev = cached[0], cached[1:]
            if dpos.size:
                part = self._mig_eval(minr, sign, self.slots, self.mem, self.cores, self.mask, dpos)
                for a, b in zip(ev, part, strict=True):
                    a.ravel()[dpos] = b
        self._cache = (key, [minr, *ev])
        us, um, uc, mask = self.slots, self.mem, self.cores, self.mask
        if c.count > 1:  # this path's earlier devices count for its later ones only
            us, um = self._copy(us, "us_c"), self._copy(um, "um_c")
            uc, mask = self._copy(uc, "uc_c"), self._copy(mask, "mask_c")
        for k in range(c.count):
            prof, start, pmem, pcore, fit, desir = ev
            first, found = _pick(desir, fit, self.scratch)
            found_all &= found
            at = self.ar + first
            pos[:, k] = at
            fpos = at[found]
            picked = t.idx.ravel()[fpos]
            rows[found, k] = picked
            p_prof = prof.ravel()[fpos]
            p_start = start.ravel()[fpos]
            rank_out[found, k] = p_prof
            start_out[found, k] = p_start
            d = desir.ravel()[fpos]
            total[found] += d
            scores[found, k] = d * sign
            if k + 1 < c.count and picked.size:
                bits, _, _ = _mig_devices(self.src, picked, p_prof, p_start)
                mask.ravel()[fpos] |= bits
                us.ravel()[fpos] += 1
                um.ravel()[fpos] += pmem.ravel()[fpos]
                uc.ravel()[fpos] += pcore.ravel()[fpos]
                part = self._mig_eval(minr, sign, us, um, uc, mask, fpos)
                if k == 0:  # the cached evaluation stays as it was
                    ev = [self._copy(a, f"ev_{i}") for i, a in enumerate(ev)]
                for a, b in zip(ev, part, strict=True):
                    a.ravel()[fpos] = b
        return result


def _min_rank(
    src: _StateLike, table: PathTable, c: ContainerRequest, memo: dict[Any, Any] | None
) -> I64 | None:
    """Per position of ``table``, the smallest profile rank ``c`` accepts (R: none); None if no
    geometry has a profile large enough. Depends on the table and the request only: kept in
    ``memo`` (the table's, read-only) for the next decisions."""
    key = ("min_rank", c.mem_mib, c.mem_percent, c.cores)
    if memo is not None and key in memo:
        cached: I64 | None = memo[key]
        return cached
    minr = np.zeros(table.idx.size, np.int64)
    any_fit = False
    for gid, gpos in table.geoms:
        geom = src.geometries[gid]
        n_ranks = len(geom.profiles)
        if c.mem_mib:
            fits1 = (geom.memory >= c.mem_mib) & (geom.cores >= c.cores)
            if fits1.any():
                any_fit = True
                minr[gpos] = int(fits1.argmax())
            else:
                minr[gpos] = n_ranks
            continue
        req_mem = table.mem.ravel()[gpos] * c.mem_percent // 100
        fits = (geom.memory[None, :] >= req_mem[:, None]) & (geom.cores[None, :] >= c.cores)
        fit_any = fits.any(axis=1)
        any_fit = any_fit or bool(fit_any.any())
        minr[gpos] = np.where(fit_any, fits.argmax(axis=1), n_ranks)
    minr.setflags(write=False)
    result = minr if any_fit else None
    if memo is not None:
        if sum(1 for k in memo if k[0] == "min_rank") >= 16:  # a few request shapes recur
            for k in [k for k in memo if k[0] == "min_rank"]:
                del memo[k]
        memo[key] = result
    return result


def _reference(
    state: _StateLike, layout: Layout, request: PodRequest, uuid_ok_all: B | None
) -> tuple[B, I64, list[_ContainerPlan]]:
    """The straightforward evaluation over all rows, with failure reasons: (feasible, reasons,
    plans). What ``decide`` computes faster (without reasons); reasons come from here."""
    n = layout.n_rows
    S = len(layout.names)
    if S == 0:  # no node registers a GPU
        return np.zeros(0, np.bool_), np.zeros(0, np.int64), []
    g = state.gpus
    reasons_rows, base = _static_reasons(state, n, request, uuid_ok_all)
    is_mig = g.is_mig[:n]
    allow_core = request.mode in (None, "hami-core")
    allow_mig = request.mode in (None, "mig")

    usage = _Usage(state, n)
    feasible = np.ones(S, np.bool_)
    node_reasons = np.zeros(S, np.int64)
    plans: list[_ContainerPlan] = []
    remaining = request.device_count
    for c in request.containers:
        remaining -= c.count
        rows = np.full((S, c.count), -1, np.int64)
        rank = np.full((S, c.count), -1, np.int64)
        start = np.full((S, c.count), -1, np.int64)
        ok_c = np.zeros(S, np.bool_)
        desir_c = np.full(S, -np.inf)
        gscore = np.zeros((S, c.count))
        paths: list[tuple[B, F64, I64, I64, I64, F64]] = []
        if allow_core:
            paths.append(
                _hami_core(
                    state, layout, c, request.gpu_policy, usage, base & ~is_mig, reasons_rows
                )
            )
        if allow_mig:
            paths.append(
                _mig(
                    state,
                    layout,
                    c,
                    request.gpu_policy,
                    usage,
                    base & is_mig,
                    reasons_rows,
                    multi=c.count > 1 or remaining > 0,
                )
            )
        for p_ok, p_desir, p_rows, p_rank, p_start, p_score in paths:
            better = p_ok & (~ok_c | (p_desir > desir_c))
            ok_c |= p_ok
            desir_c = np.where(better, p_desir, desir_c)
            rows[better], rank[better], start[better] = (
                p_rows[better],
                p_rank[better],
                p_start[better],
            )
            gscore[better] = p_score[better]
        feasible &= ok_c
        plans.append(_ContainerPlan(c, rows, rank, start, gscore))
        if remaining > 0:
            _commit(state, usage, c, rows, rank, start, ok_c)

    # Only the node's own rows: dead ones (left by a node that re-registered) don't count.
    seg_reasons = np.bitwise_or.reduce(_per_gpu(reasons_rows, layout, 0), axis=0)
    node_reasons = np.where(feasible, 0, seg_reasons | node_reasons)
    too_few = _too_few_gpus(layout, request)
    node_reasons |= np.where(too_few & ~feasible, int(Reason.TOO_FEW_GPUS), 0)
    if not request.containers:
        feasible[:] = True
    return feasible, node_reasons, plans


def _static_reasons(
    state: _StateLike, n: int, request: PodRequest, uuid_ok_all: B | None
) -> tuple[I64, B]:
    """Per GPU row: the reasons that don't depend on usage (health, selectors, mode), and
    ``base``: the live healthy rows the selectors allow (of either mode)."""
    g = state.gpus
    live = g.node[:n] >= 0
    reasons_rows = np.zeros(n, np.int64)
    base = live.copy()
    unhealthy = ~g.healthy[:n] | (g.conflict[:n] > 0)
    reasons_rows |= _bits(~g.healthy[:n], Reason.UNHEALTHY)
    reasons_rows |= _bits(g.healthy[:n] & (g.conflict[:n] > 0), Reason.MIG_CONFLICT)
    base &= ~unhealthy
    if request.use_types or request.nouse_types:
        ok_types = np.array([_type_ok(t, request) for t in state.types] or [True], np.bool_)
        type_ok = ok_types[g.type_id[:n]]
        reasons_rows |= _bits(~type_ok, Reason.TYPE)
        base &= type_ok
    if request.use_uuids or request.nouse_uuids:
        assert uuid_ok_all is not None
        uuid_ok = uuid_ok_all[:n]
        reasons_rows |= _bits(~uuid_ok, Reason.UUID)
        base &= uuid_ok
    is_mig = g.is_mig[:n]
    allow_core = request.mode in (None, "hami-core")
    allow_mig = request.mode in (None, "mig")
    mode_bad = (is_mig & ~np.bool_(allow_mig)) | (~is_mig & ~np.bool_(allow_core))
    reasons_rows |= _bits(mode_bad, Reason.MODE)
    return reasons_rows, base


def _reasons(
    src: _StateLike, layout: Layout, request: PodRequest, uuid_ok: B | None, feasible: B
) -> I64:
    """[S] Reason bits of every node that is not feasible: what ``_reference`` says, computed
    only where needed. A node with no GPU any path of the request would consider (wrong mode,
    excluded, unhealthy) has only the static reasons of its GPUs; ``_reference`` runs on the
    other infeasible nodes alone (every step of it is per node)."""
    S = len(layout.names)
    out = np.zeros(S, np.int64)
    infeasible = ~feasible
    if not infeasible.any():
        return out
    n = layout.n_rows
    rows_bits, base = _static_reasons(src, n, request, uuid_ok)
    is_mig = src.gpus.is_mig[:n]
    considered = np.zeros(n, np.bool_)
    if request.mode in (None, "hami-core"):
        considered |= base & ~is_mig
    if request.mode in (None, "mig"):
        considered |= base & is_mig
    dynamic = _per_gpu(considered, layout, False).any(axis=0)
    static = infeasible & ~dynamic
    if static.any():
        seg_bits = np.bitwise_or.reduce(_per_gpu(rows_bits, layout, 0), axis=0)
        seg_bits |= np.where(_too_few_gpus(layout, request), int(Reason.TOO_FEW_GPUS), 0)
        out[static] = seg_bits[static]
    segs = np.flatnonzero(infeasible & dynamic)
    if segs.size * 2 > S:  # most nodes: the whole layout is cheaper than a copy of most of it
        out[segs] = _reference(src, layout, request, uuid_ok)[1][segs]
    elif segs.size:
        sub, sub_layout, sub_uuid_ok = _restrict(src, layout, segs, uuid_ok)
        out[segs] = _reference(sub, sub_layout, request, sub_uuid_ok)[1]
    return out


def _restrict(
    src: _StateLike, layout: Layout, segs: I64, uuid_ok: B | None
) -> tuple[_View, Layout, B | None]:
    """The GPU columns and layout of segments ``segs`` alone, their rows renumbered from 0 (in
    segment order); with ``uuid_ok`` of those rows."""
    counts = layout.gpu_count[segs]
    in_seg = layout.gpu_rows_ok
    rows_t = layout.gpu_rows[:, segs].T
    rows = rows_t.ravel() if in_seg is None else rows_t[in_seg[:, segs].T]
    g = src.gpus
    sub = GpuArrays(**{name: getattr(g, name)[rows] for name in _COLUMNS})
    starts = np.cumsum(counts) - counts
    j = np.arange(int(counts.max()), dtype=np.int64)[:, None]
    ok = j < counts[None, :]
    mig_live = (sub.node >= 0) & sub.is_mig & (sub.geom >= 0)
    layout_ = Layout(
        version=layout.version,
        n_rows=int(rows.size),
        starts=starts,
        node_idx=layout.node_idx[segs],
        names=tuple(layout.names[s] for s in segs.tolist()),
        seg_of_row=np.repeat(np.arange(segs.size, dtype=np.int64), counts),
        gpu_less=(),
        geom_rows=tuple(
            (int(gid), np.flatnonzero(mig_live & (sub.geom == gid)))
            for gid in np.unique(sub.geom[mig_live])
        ),
        seg_index={},
        gpu_rows=np.where(ok, starts[None, :] + j, 0),
        gpu_rows_ok=None if ok.all() else ok,
        gpu_count=counts,
    )
    view = _View(sub, src.geometries, src.types)
    return view, layout_, None if uuid_ok is None else uuid_ok[rows]


def _type_ok(gpu_type: str, request: PodRequest) -> bool:
    upper = gpu_type.upper()
    if request.use_types and not any(t.upper() in upper for t in request.use_types):
        return False
    return not any(t.upper() in upper for t in request.nouse_types)


def _uuid_mask(state: ClusterState, layout: Layout, request: PodRequest, owned: bool) -> B:
    """Per GPU row: allowed by use-gpuuuid / nouse-gpuuuid (nouse wins)."""
    rows_of: dict[str, list[int]] | None = layout.scratch.memo.get("uuid_rows") if owned else None
    if rows_of is None:  # rows are fixed until the layout changes; UUIDs may repeat across nodes
        rows_of = {}
        for entry in state.nodes.values():
            for uuid, r in entry.rows.items():
                rows_of.setdefault(uuid, []).append(r)
        if owned:
            layout.scratch.memo["uuid_rows"] = rows_of
    ok = np.full(layout.n_rows, not request.use_uuids, np.bool_)
    for uuids, value in ((request.use_uuids, True), (request.nouse_uuids, False)):
        for uuid in uuids:
            ok[rows_of.get(uuid, [])] = value
    return ok


def _gpu_score(
    g_slots: F64,
    g_mem: F64,
    g_cores: F64,
    used: _Usage,
    req_mem: F64 | float,
    req_cores: F64 | float,
) -> F64:
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (
            (1 + used.slots) / g_slots
            + (req_cores + used.cores) / g_cores
            + (req_mem + used.mem) / g_mem
        ) * 10
    return s if np.isfinite(s).all() else np.nan_to_num(s)  # inf/nan: zero capacity


def _hami_core(
    state: _StateLike,
    layout: Layout,
    c: ContainerRequest,
    policy: Policy,
    usage: _Usage,
    ok_base: B,
    reasons_rows: I64,
) -> tuple[B, F64, I64, I64, I64, F64]:
    n = layout.n_rows
    g = state.gpus
    slots, mem, cores = g.slots[:n], g.mem[:n], g.cores[:n]
    req_mem = float(c.mem_mib) if c.mem_mib else np.floor(mem * c.mem_percent / 100)
    slots_ok = usage.slots < slots
    mem_ok = mem - usage.mem >= req_mem
    cores_ok = (cores - usage.cores >= c.cores) & (usage.cores < cores)
    excl_ok = (c.cores < cores) | (usage.slots == 0)
    bits = (
        _bits(~slots_ok, Reason.SLOTS)
        | _bits(~mem_ok, Reason.MEMORY)
        | _bits(~cores_ok, Reason.CORES)
        | _bits(~excl_ok, Reason.EXCLUSIVE)
    )
    reasons_rows |= bits * ok_base
    fit = ok_base & slots_ok & mem_ok & cores_ok & excl_ok
    desir = _gpu_score(slots, mem, cores, usage, req_mem, float(c.cores)) * policy.sign
    S = len(layout.names)
    rows = np.full((S, c.count), -1, np.int64)
    scores = np.zeros((S, c.count))
    total = np.zeros(S)
    found_all = np.ones(S, np.bool_)
    avail = fit.copy()
    for k in range(c.count):
        best, found = _seg_max_first(desir, avail, layout)
        found_all &= found
        rows[:, k] = best
        picked = best[found]
        total[found] += desir[picked]
        scores[found, k] = desir[picked] * policy.sign
        avail[picked] = False
    if c.count > 1 and n:
        fit_count = _per_gpu(fit, layout, False).sum(axis=0)
        partial = (fit_count > 0) & (fit_count < c.count)
        _mark_segments(reasons_rows, layout, partial, Reason.TOO_FEW_FITTING)
    return found_all, total, rows, np.full_like(rows, -1), np.full_like(rows, -1), scores


def _mark_segments(reasons_rows: I64, layout: Layout, segs: B, reason: Reason) -> None:
    idx = layout.starts[segs]
    reasons_rows[idx] |= int(reason)


def _mig(
    state: _StateLike,
    layout: Layout,
    c: ContainerRequest,
    policy: Policy,
    usage: _Usage,
    ok_base: B,
    reasons_rows: I64,
    *,
    multi: bool,
) -> tuple[B, F64, I64, I64, I64, F64]:
    n = layout.n_rows
    S = len(layout.names)
    g = state.gpus
    rows = np.full((S, c.count), -1, np.int64)
    rank_out = np.full((S, c.count), -1, np.int64)
    start_out = np.full((S, c.count), -1, np.int64)
    scores = np.zeros((S, c.count))
    total = np.zeros(S)
    found_all = np.ones(S, np.bool_)
    no_geom = ok_base & (g.geom[:n] < 0)
    reasons_rows |= _bits(no_geom, Reason.MIG_NO_PROFILE)
    if multi:
        # The container's earlier devices count for its later ones only: ``_commit`` counts
        # the chosen path's devices for the next container, and another path may be chosen.
        usage = usage.scratch()
    # Per geometry, what doesn't change from one device to the next: the candidate rows and
    # the smallest profile rank the request accepts (one for all rows with an absolute size).
    groups: list[tuple[Geometry, I64, B | np.bool_, I64 | int]] = []
    for gid, grow in layout.geom_rows:
        r = grow[ok_base[grow]]
        if r.size == 0:
            continue
        geom = state.geometries[gid]
        if c.mem_mib:
            fits1 = (geom.memory >= c.mem_mib) & (geom.cores >= c.cores)
            groups.append((geom, r, fits1.any(), int(fits1.argmax()) if fits1.any() else 0))
            continue
        req_mem = g.mem[r] * c.mem_percent // 100
        fits = (geom.memory[None, :] >= req_mem[:, None]) & (geom.cores[None, :] >= c.cores)
        any_fit = fits.any(axis=1)
        groups.append((geom, r, any_fit, np.where(any_fit, fits.argmax(axis=1), 0)))
    for k in range(c.count):
        # Each MIG device takes one of the GPU's vGPU slots, as kubelet counts them.
        slots_ok = usage.slots < g.slots[:n]
        if k == 0:
            reasons_rows |= _bits(ok_base & ~slots_ok, Reason.SLOTS)
        prof = np.full(n, -1, np.int64)
        start = np.full(n, -1, np.int64)
        pmem = np.zeros(n)
        pcore = np.zeros(n)
        for geom, r, any_fit, min_rank in groups:
            masks = usage.mask[r] & geom.table.full_mask
            ch_p = geom.table.profile[masks, min_rank].astype(np.int64)
            ch_s = geom.table.start[masks, min_rank].astype(np.int64)
            frag = geom.table.fragmented[masks, min_rank]
            ch_p = np.where(any_fit, ch_p, -1)
            if k == 0:
                bits = np.where(
                    ~any_fit,
                    int(Reason.MIG_NO_PROFILE),
                    np.where(
                        ch_p >= 0,
                        0,
                        np.where(frag, int(Reason.MIG_FRAGMENTATION), int(Reason.MIG_CAPACITY)),
                    ),
                )
                reasons_rows[r] |= bits
            got = ch_p >= 0
            prof[r] = ch_p
            start[r] = np.where(got, ch_s, -1)
            pmem[r] = np.where(got, geom.memory[np.maximum(ch_p, 0)], 0)
            pcore[r] = np.where(got, geom.cores[np.maximum(ch_p, 0)], 0)
        fit = (prof >= 0) & slots_ok
        desir = _gpu_score(g.slots[:n], g.mem[:n], g.cores[:n], usage, pmem, pcore) * policy.sign
        best, found = _seg_max_first(desir, fit, layout)
        found_all &= found
        picked = best[found]
        rows[:, k] = best
        rank_out[found, k] = prof[picked]
        start_out[found, k] = start[picked]
        total[found] += desir[picked]
        scores[found, k] = desir[picked] * policy.sign
        if k + 1 < c.count and picked.size:
            _add_mig(state, usage, picked, prof[picked], start[picked], pmem[picked], pcore[picked])
    return found_all, total, rows, rank_out, start_out, scores


def _add_mig(
    state: _StateLike, usage: _Usage, rows: I64, prof: I64, start: I64, pmem: F64, pcore: F64
) -> None:
    bits, _, _ = _mig_devices(state, rows, prof, start)
    usage.mask[rows] |= bits  # rows are distinct: one per node
    usage.slots[rows] += 1
    usage.mem[rows] += pmem
    usage.cores[rows] += pcore


def _commit(
    state: _StateLike, usage: _Usage, c: ContainerRequest, rows: I64, rank: I64, start: I64, ok: B
) -> None:
    """Count a container's planned devices before planning the next container."""
    u = usage.writable()
    g = state.gpus
    segs = np.flatnonzero(ok)
    # Device k of every node at once: its rows are distinct (one per node), so fancy-index
    # updates don't collide; devices of one node are counted in order k = 0, 1, ...
    for k in range(c.count):
        r, p = rows[segs, k], rank[segs, k]
        mig = p >= 0
        rm = r[mig]
        if rm.size:
            bits, mem, cores = _mig_devices(state, rm, p[mig], start[segs, k][mig])
            u.mask[rm] |= bits
            u.slots[rm] += 1
            u.mem[rm] += mem
            u.cores[rm] += cores
        rc = r[~mig]
        if rc.size:
            u.slots[rc] += 1
            u.mem[rc] += c.mem_mib if c.mem_mib else g.mem[rc] * c.mem_percent // 100
            u.cores[rc] += c.cores


def _mig_devices(state: _StateLike, rows: I64, prof: I64, start: I64) -> tuple[I64, F64, F64]:
    """Occupancy bits, memory and cores of MIG devices (profile rank ``prof`` at ``start``)."""
    gids = state.gpus.geom[rows]
    size = np.zeros(rows.size, np.int64)
    mem = np.zeros(rows.size)
    cores = np.zeros(rows.size)
    for gid in np.unique(gids).tolist():
        sel = gids == gid
        geom = state.geometries[gid]
        size[sel] = geom.sizes[prof[sel], start[sel]]
        mem[sel] = geom.memory[prof[sel]]
        cores[sel] = geom.cores[prof[sel]]
    return ((np.int64(1) << size) - 1) << start, mem, cores


def _too_few_gpus(layout: Layout, request: PodRequest) -> B:
    need = max((c.count for c in request.containers), default=0)
    if not layout.n_rows or need <= 1:
        return np.zeros(len(layout.names), np.bool_)
    return np.asarray(layout.gpu_count < need, np.bool_)


def _node_scores(state: ClusterState, layout: Layout) -> F64:
    if not layout.n_rows:
        return np.zeros(0)
    # Per node idx (the state keeps the sums over each node's live GPUs), then the layout's
    # nodes: one gather instead of one per column.
    with np.errstate(divide="ignore", invalid="ignore"):
        score = (
            state.node_used_slots / state.node_slots
            + state.node_used_cores / state.node_cores
            + state.node_used_mem / state.node_mem
        ) * 10
        if state.config.node_score_cpu_memory:
            score += (
                state.node_cpu_req / state.node_cpu_alloc
                + state.node_mem_req / state.node_mem_alloc
            ) * 10
    score = score[layout.node_idx]
    if not np.isfinite(score).all():  # a node without capacity: nan or inf, counted as 0
        score = np.nan_to_num(score, posinf=0.0, neginf=0.0)
    return score


def mode_of_plan(plan: PodPlan) -> GpuMode:
    return "mig" if any(d.mig_profile for c in plan.containers for d in c) else "hami-core"


__all__ = ["MAX_SLICES", "Decision", "PlannedDevice", "PodPlan", "Reason", "decide"]
