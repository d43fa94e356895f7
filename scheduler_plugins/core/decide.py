"""The engine: one scheduling decision per pod, every node's verdict, score and planned devices.

This is what the plugin server answers in one round trip. It applies the rules (``rules``: which
GPUs a pod considers, when a GPU fits a device, the scores; ``mig_policy``: the MIG profile and
placement) with vectorized numpy to per-path tables of the GPU rows of ``ClusterState``. Every
node's verdict comes mostly from how many GPUs of a node can take a device of each container
(``_feasible``), with the full evaluation (``_evaluate``: devices picked and counted container
by container) only for the nodes those counts can't decide. A node's planned devices are
evaluated when asked for (``plan_for``; a scheduling cycle reserves one node), and failure
reasons when an explanation needs them: the same evaluation of the rejected nodes, reporting
which checks failed (``Decision.reasons``). A Decision is valid until the next change of the
state it was computed from.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.keys import GpuMode
from api.hami.policy import Policy
from api.hami.register import GpuDevice, Placement
from scheduler_plugins.core import fragmentation as frag
from scheduler_plugins.core import ranking, rules
from scheduler_plugins.core.mig_policy import smallest_rank
from scheduler_plugins.core.requests import ContainerRequest, PodAllocation, PodRequest
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import (
    ChoiceLuts,
    ClusterState,
    Geometry,
    GpuArrays,
    GpuSource,
    Layout,
    PathTable,
    Scratch,
)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]


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

    def allocation(
        self, cpu_milli: int = 0, memory_bytes: int = 0, *, uid: str = "", priority: int = 0
    ) -> PodAllocation:
        shared: list[DeviceAlloc] = []
        mig: list[MigAllocation] = []
        for ci, devices in enumerate(self.containers):
            for di, d in enumerate(devices):
                if d.mig_profile is not None and d.placement is not None:
                    mig.append(MigAllocation(ci, di, d.uuid, d.mig_profile, d.placement))
                else:
                    shared.append(DeviceAlloc(d.uuid, d.mem, d.cores))
        return PodAllocation(
            self.pod,
            self.node,
            tuple(shared),
            tuple(mig),
            cpu_milli,
            memory_bytes,
            uid=uid,
            priority=priority,
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
    mig_rank: I64  # [S, count], -1 for shared (hami-core, MPS) devices
    mig_start: I64  # [S, count]
    gpu_score: F64  # [S, count] GPU score (usage including this request)


class Decision:
    """Verdicts for every node (segments of the layout, plus GPU-less nodes).

    ``feasible`` is exact for every node. What only some callers need is computed on first
    use: ``reasons`` (Reason bits per node, meaningful where not feasible; only explanations
    need them) and a node's planned devices (``plan_for``; a scheduling cycle reserves one
    node). Both come from the GPU columns as they were at the decision: until they are
    computed the decision reads the state's live columns; the state tells it before they
    change, and it keeps a copy of them. Where the pod requests CPU or memory, a feasible node
    has them too (``rules.host_reasons``: kube-scheduler's NodeResourcesFit).
    """

    def __init__(
        self,
        request: PodRequest,
        layout: Layout,
        feasible: B,
        score: F64,
        preference: ranking.Preference,
        state: ClusterState,
        masks: _Masks,
        reasons: I64 | None = None,
        evaluated: _Evaluated | None = None,
        host: tuple[B, I64] | None = None,
        delta: F64 | None = None,
    ) -> None:
        self.request = request
        self.layout = layout
        self.feasible = feasible  # [S]
        self.score = score  # [S] node usage score before this pod
        # [S] under the fragmentation policy: what the pod does to each node's fragmentation
        # (``_fragmentation_scores``); else None
        self.delta = delta
        self.preference = preference  # how this pod ranks nodes (``ranking``)
        self._state = state
        self._masks = masks
        self._reasons = reasons
        # [S] the GPUs' verdicts and the CPU/memory reasons (``rules.host_reasons``), when
        # the pod requests CPU or memory
        self._host = host
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
                self._view, self.layout, self.request, self._masks, self.gpus_fit
            )
            if self._host is not None:
                self._reasons |= self._host[1]
            if not self.feasible.any():  # no plan will ever be asked for
                self._view = None
        return self._reasons

    @property
    def gpus_fit(self) -> B:
        """[S] where the GPUs fit the pod, whatever the node's CPU and memory."""
        return self.feasible if self._host is None else self._host[0]

    @property
    def desirability(self) -> F64:
        """[S] Higher is better: the node score signed by the pod's node policy."""
        return self.preference.desirability(self.score)

    def state_changing(self) -> None:
        """The state is about to change: keep the columns the lazy results need."""
        if self._view is not None:
            self._view = self._view.frozen(self.layout.n_rows)

    # --- queries ---

    def feasible_count(self) -> int:
        return int(np.count_nonzero(self.feasible))

    def best_node(self) -> str | None:
        """The best feasible node by ``ranking`` (without PreBind waits); None if none fits."""
        s = ranking.best(self.feasible, self.score, self.preference, self.layout.name_rank)
        return None if s < 0 else str(self.layout.names[s])

    def node_index(self, node: str) -> int:
        return self.layout.seg_index.get(node, -1)

    def plan_for(self, node: str) -> PodPlan | None:
        self._check_fresh()
        s = self.node_index(node)
        if s < 0 or not self.feasible[s]:
            return None
        plans, row = self._plans_of(s)
        entry = self._state.nodes[node]
        return _plan_of(self._state, self.request, node, entry.devices, plans, row, entry.start)

    def verdicts(self) -> list[tuple[str, bool, float, list[str]]]:
        """(node, feasible, score, reasons) for every node, sorted by name (for people)."""
        out = [
            (
                name,
                bool(self.feasible[i]),
                float(self.score[i]),
                [] if self.feasible[i] else rules.reason_names(int(self.reasons[i])),
            )
            for i, name in enumerate(self.layout.names)
        ]
        out += [
            (name, False, 0.0, [rules.REASON_TEXT[Reason.NO_GPU]]) for name in self.layout.gpu_less
        ]
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


def _plan_of(
    src: GpuSource,
    request: PodRequest,
    node: str,
    devices_of: tuple[GpuDevice, ...],
    plans: list[_ContainerPlan],
    row: int,
    first_row: int,
) -> PodPlan:
    """The devices ``plans`` (row ``row`` of an evaluation) give ``request`` on ``node``, whose
    GPUs (``devices_of``, in index order) are ``src``'s rows from ``first_row`` on."""
    g = src.gpus
    per_container: dict[int, tuple[PlannedDevice, ...]] = {}
    for cp in plans:
        devices: list[PlannedDevice] = []
        for k in range(cp.request.count):
            r = int(cp.rows[row, k])
            uuid = devices_of[r - first_row].id
            rank = int(cp.mig_rank[row, k])
            if rank >= 0:
                geom = src.geometries[int(g.geom[r])]
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
        request.key,
        node,
        tuple(per_container.get(i, ()) for i in range(request.container_count)),
    )


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


def _per_gpu(values: npt.NDArray[Any], layout: Layout, fill: float) -> npt.NDArray[Any]:
    """``values`` of each segment's GPUs as a [GPU, segment] table; ``fill`` where none."""
    table = values[layout.gpu_rows]
    if layout.gpu_rows_ok is not None:
        table = np.where(layout.gpu_rows_ok, table, fill)
    return table


_OK_OFFSET = np.array([-np.inf, 0.0])  # indexed by a bool: -inf where not ok
_OK_OFFSET.setflags(write=False)


def decide(state: ClusterState, request: PodRequest) -> Decision:
    _asking(state, request)
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
    every GPU refused as a whole (inconsistent MIG reservations, legacy MIG devices, cordoned)
    when there is any (``blocked``)."""

    ok_types: B | None  # by type id
    uuid_ok: B | None  # by GPU row
    blocked: bool
    # topology-aware: GPU pair scores [P, W, W] of each shared path's table, by its mode
    pairs: Mapping[GpuMode, F64] = field(default_factory=dict)
    # the fragmentation rule's view, where it picks the pod's GPUs (``_fragmentation``)
    frag: _Frag | None = None


def _decide(state: ClusterState, request: PodRequest, layout: Layout, owned: bool) -> Decision:
    fragmentation = _fragmentation_applies(request)
    policy = request.node_policy
    if policy is Policy.FRAGMENTATION and not fragmentation:
        policy = Policy.BINPACK
    fuller = state.kinds.fuller_ties
    preference = ranking.Preference(
        policy,
        frag.node_score_max(fuller)
        if fragmentation
        else rules.node_score_max(state.config.node_score_cpu_memory),
    )
    masks = _request_masks(
        state,
        layout,
        request,
        uuid_rows=lambda: _uuid_rows(state, layout, owned),
        pair_scores=lambda: _pair_scores(state, layout, owned),
    )
    reasons: I64 | None = None
    evaluated: _Evaluated | None = None
    host: tuple[B, I64] | None = None
    delta: F64 | None = None
    if not layout.names:  # no node registers a GPU
        feasible, score, reasons = np.zeros(0, np.bool_), np.zeros(0), np.zeros(0, np.int64)
    else:
        score = _node_scores(state, layout)
        feasible, evaluated = _feasible(
            state, layout, request, masks, owned, score, preference, kept_usage=owned
        )
        if request.cpu_milli > 0 or request.memory_bytes > 0:  # kube-scheduler's own fit
            bits = rules.host_reasons(
                rules.HostAmounts(state.node_cpu_alloc, state.node_mem_alloc),
                rules.HostAmounts(state.node_cpu_req, state.node_mem_req),
                request.cpu_milli,
                request.memory_bytes,
                at=layout.node_idx,
            )
            host = (feasible, bits)
            feasible = feasible & (bits == 0)
        if fragmentation and layout.n_rows:
            ctx = _Frag.of(state, layout, request, fuller)
            if not request.gpu_policy_named:  # its devices by the rule too
                masks = replace(masks, frag=ctx)
            score, delta = _fragmentation_scores(
                state, layout, request, masks, ctx, feasible, owned
            )
    return Decision(
        request, layout, feasible, score, preference, state, masks, reasons, evaluated, host, delta
    )


def feasible_on(
    src: GpuSource,
    state: ClusterState,
    layout: Layout,
    request: PodRequest,
    *,
    uuid_rows: Callable[[], Mapping[str, Sequence[int]]],
    reasons: bool = False,
) -> tuple[B, I64 | None]:
    """What ``decide`` finds feasible on every node of ``layout``, a layout of ``src``'s rows
    other than the state's own (a what-if's copy of some nodes), and with ``reasons`` the
    ``Reason`` bits of the nodes that do not fit, as ``Decision.reasons`` has them. On the
    GPUs alone: in a preemption's dry run kube-scheduler's NodeResourcesFit weighs CPU and
    memory itself, with its victims gone.
    ``state``: the state those nodes are of (their GPU pair scores); ``uuid_rows``: the rows
    of each GPU UUID in ``src``."""
    masks = _copy_masks(src, state, layout, request, uuid_rows)
    preference = ranking.Preference(request.node_policy, 1.0)
    owned = layout.scratch.acquire()
    try:
        feasible, _ = _feasible(
            src,
            layout,
            request,
            masks,
            owned,
            np.zeros(len(layout.names)),
            preference,
            kept_usage=False,
        )
    finally:
        if owned:
            layout.scratch.release()
    why = _reasons(src, layout, request, masks, feasible) if reasons else None
    return feasible, why


def plan_on(
    src: GpuSource,
    state: ClusterState,
    layout: Layout,
    request: PodRequest,
    node: str,
    *,
    uuid_rows: Callable[[], Mapping[str, Sequence[int]]],
) -> PodPlan | None:
    """The devices ``decide`` would plan for ``request`` on ``node`` of ``layout`` (as
    ``feasible_on``), or None where it does not fit."""
    s = layout.seg_index[node]
    masks = _copy_masks(src, state, layout, request, uuid_rows)
    owned = layout.scratch.acquire()
    try:
        ok, plans = _evaluate(src, layout, request, masks, np.array([s], np.int64), owned)
    finally:
        if owned:
            layout.scratch.release()
    if not ok[0]:
        return None
    first = int(layout.starts[s])
    return _plan_of(src, request, node, state.nodes[node].devices, plans, 0, first)


def _copy_masks(
    src: GpuSource,
    state: ClusterState,
    layout: Layout,
    request: PodRequest,
    uuid_rows: Callable[[], Mapping[str, Sequence[int]]],
) -> _Masks:
    """``_request_masks`` on a what-if's copy: its pair scores are the state's own."""
    return _request_masks(
        src,
        layout,
        request,
        uuid_rows=uuid_rows,
        pair_scores=lambda: _pair_scores(state, layout, owned=False),
    )


def _request_masks(
    src: GpuSource,
    layout: Layout,
    request: PodRequest,
    *,
    uuid_rows: Callable[[], Mapping[str, Sequence[int]]],
    pair_scores: Callable[[], dict[GpuMode, F64]],
) -> _Masks:
    """What ``request`` excludes on the rows of ``layout`` (of ``src``) regardless of usage.
    ``uuid_rows`` (UUID -> rows) and ``pair_scores`` are asked for only when the request
    needs them."""
    n = layout.n_rows
    uuid_ok = (
        rules.uuid_allowed(n, uuid_rows(), request.use_uuids, request.nouse_uuids)
        if request.use_uuids or request.nouse_uuids
        else None
    )
    if not layout.names:
        return _Masks(None, uuid_ok, False)
    ok_types: B | None = None
    if request.use_types or request.nouse_types:
        ok_types = np.array(
            [rules.type_allowed(t, request.use_types, request.nouse_types) for t in src.types]
            or [True],
            np.bool_,
        )
    pairs = pair_scores() if request.gpu_policy.topology_aware else {}
    return _Masks(ok_types, uuid_ok, bool(src.gpus.blocked[:n].any()), pairs)


# Feasibility without planning devices. A container fits a path of a node when enough of the
# node's GPUs on that path can each take one of its devices, counted on the usage before the
# pod: usage only grows while a pod is planned, so a GPU that can't take a device then never
# can, and a GPU no earlier container of the pod touched is as it was. Hence, with D devices
# planned before container c (at most D GPUs touched):
#   sure:     some path has >= count(c) + D fitting GPUs          (untouched ones suffice)
#   possible: some path has >= count(c) fitting GPUs (hami-core, MPS: distinct cards) or >= 1
#             (MIG: one card can take several instances)
# A node is feasible if every container is sure, infeasible if one is not possible; only the
# nodes in between get the full evaluation. Single-container pods (apart from MIG with several
# devices) have none in between.


def _feasible(
    state: GpuSource,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    owned: bool,
    score: F64,
    preference: ranking.Preference,
    *,
    kept_usage: bool,
) -> tuple[B, _Evaluated | None]:
    """Every node's verdict, and the plans of the nodes evaluated in full for it: those the
    counts can't decide and, with them, the best node the counts find feasible (so the plan of
    the best node, whichever it turns out to be, is among them). ``kept_usage``: as
    ``_paths``'s (``state`` is the state and the tables' scratch is owned)."""
    S = len(layout.names)
    if not request.containers:
        return np.ones(S, np.bool_), None
    if request.numa_bind:  # counts over a node's GPUs can't tell where one NUMA node fits
        ok, plans = _evaluate(state, layout, request, masks, None, owned)
        return ok, _Evaluated(None, plans)
    paths = _paths(state, layout, request, masks, owned, None, kept_usage=kept_usage)
    sure = np.ones(S, np.bool_)
    possible = sure.copy()
    counts: dict[tuple[int, int, int], list[npt.NDArray[Any] | None]] = {}
    before = 0  # devices of the containers planned before this one
    for c in request.containers:
        key = (c.mem_mib, c.mem_percent, c.cores)
        per_path = counts.get(key)
        if per_path is None:
            per_path = counts[key] = [p.fit_counts(c) for p in paths]
        # The first container's count is exact on hami-core and MPS, and on MIG for one device.
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
    best = ranking.best(sure, score, preference, layout.name_rank)
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
    src: GpuSource,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    owned: bool,
    segs: I64 | None,
    *,
    kept_usage: bool = False,
    why: bool = False,
) -> list[_Path]:
    """The request's paths (hami-core, MIG, MPS: those of the modes offered to it, with GPUs;
    in this order, which breaks ties between them), over the whole tables or only the rows of
    segments ``segs``. ``kept_usage``: the paths read the usage each table keeps
    (``_kept_usage``; ``src`` is the state, the tables' scratch is owned) and must not count
    devices in it."""
    offered = rules.modes(request.modes)
    paths: list[_Path] = []
    for mode, table in layout.tables():
        if mode not in offered or table is None or not table.nodes.size:
            continue
        mig = mode == "mig"
        memo = table.scratch.memo if owned else None
        if segs is None:
            scratch = table.scratch if owned else Scratch()
            usage = None
            if kept_usage:
                assert isinstance(src, ClusterState) and owned
                usage = _kept_usage(src, table, mig)
            paths.append(
                _Path(
                    src,
                    table,
                    masks,
                    request,
                    mode=mode,
                    scratch=scratch,
                    memo=memo,
                    usage=usage,
                    why=why,
                )
            )
            continue
        sub = _rows_of(table, segs, memo)
        if sub is not None:
            paths.append(
                _Path(
                    src,
                    sub,
                    masks,
                    request,
                    mode=mode,
                    scratch=Scratch(),
                    memo=memo,
                    full=table,
                    why=why,
                    segs=segs,
                )
            )
    return paths


def _kept_usage(state: ClusterState, table: PathTable, mig: bool) -> tuple[F64, F64, F64, I64]:
    """The state's usage columns gathered into ``table`` [P, W] (used slots, memory, cores, MIG
    mask; an empty mask for shared GPUs), kept with the table and refreshed where pods changed
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
    src: GpuSource,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    segs: I64 | None,
    owned: bool,
    why: I64 | None = None,
) -> tuple[B, list[_ContainerPlan]]:
    """Every container on every allowed path, each container's planned devices counted before
    the next: (feasible, plans) of the segments ``segs`` (all when None), indexed like them.
    Every step is per node, so a subset of segments gets what the whole layout would. With
    ``why`` (indexed like the result), OR into it the reasons of every check that failed on a
    GPU the pod considers, container by container (what ``Decision.reasons`` reports)."""
    S = len(layout.names) if segs is None else int(segs.size)
    paths = _paths(src, layout, request, masks, owned, segs, why=why is not None)
    work = layout.scratch if owned and segs is None else Scratch()
    # What the Decision keeps is allocated here, fresh; work arrays never reach it.
    feasible = np.ones(S, np.bool_)
    plans: list[_ContainerPlan] = []
    remaining = request.device_count
    sign = request.gpu_policy.score_sign
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
            if request.numa_bind:
                res = path.numa_bound(c, sign)
            else:
                res = path.mig_path(c, sign) if path.mig else path.core_path(c, sign)
            outs.append(res)
            nodes = path.table.nodes
            if why is not None and res.why is not None:
                why[nodes] |= res.why
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


# topology-aware weighs every set of GPUs a container could take on a node up to this many
# sets (8 GPUs choose 4: 70); beyond, the devices go the GPU policy's order.
_MAX_COMBINATIONS = 5000

# Tables up to this many positions (a few nodes' rows) are evaluated with plain expressions:
# for them, what a numpy call costs is its call, and work arrays only add calls.
_SMALL = 256


def _pick(
    desir: F64,
    avail: B,
    work: Scratch,
    numa: npt.NDArray[np.int16] | None = None,
    numa_rank: int = -1,
    tie_key: npt.NDArray[np.int32] | None = None,
) -> tuple[I64, B]:
    """Per table row: the column with the maximum ``desir`` among ``avail`` columns (``desir``
    finite), ties to the last column (columns are in GPU index order: HAMi tries the highest
    index first). With ``numa`` (per column) and ``numa_rank`` 0, only the columns of the
    row's highest NUMA node among ``avail`` compete; with ``numa_rank`` 1, the highest NUMA
    node breaks ties of ``desir`` first (the table's ``tie_key``). Column-wise maxima: numpy's
    axis-1 reductions over 8 columns are slow."""
    if numa is not None and numa_rank == 0:
        best_numa = np.where(avail, numa, -1).max(axis=1)
        avail = avail & (numa == best_numa[:, None])
    key = tie_key if numa_rank == 1 else None
    shape = desir.shape
    if desir.size <= _SMALL:  # the same maxima and comparisons, in fewer calls
        v0 = desir + _OK_OFFSET[avail.view(np.uint8)]
        top0 = v0.max(axis=1)
        at_top0 = v0 >= (top0 - 1e-9)[:, None]
        return _last(at_top0, key, work), top0 > -np.inf
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
    return _last(at_top, key, work), found


def _last(at_top: B, tie_key: npt.NDArray[np.int32] | None, work: Scratch) -> I64:
    """Per row, the ``at_top`` column with the largest ``tie_key``, or without one the last."""
    if tie_key is not None:
        keys = work.get("pick_key", at_top.shape, np.int32)
        np.multiply(at_top, tie_key, out=keys)
        best: I64 = keys.argmax(axis=1)
        return best
    last: I64 = at_top.shape[1] - 1 - at_top[:, ::-1].argmax(axis=1)
    return last


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
    numa: npt.NDArray[np.int16]
    tie_key: npt.NDArray[np.int32]
    min_cores: float
    lut_off: I64 | None
    lut_stride: I64 | None
    lut_full: I64 | None
    lut: ChoiceLuts | None
    flat: I64 | slice
    sel: I64 | slice  # its rows in the full table

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
            numa=table.numa[sel],
            tie_key=table.tie_key[sel],
            min_cores=table.min_cores,
            lut_off=part(table.lut_off),
            lut_stride=part(table.lut_stride),
            lut_full=part(table.lut_full),
            lut=table.lut,
            flat=flat,
            sel=sel,
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


class _Columns(NamedTuple):
    cap: rules.Amounts
    ok: B
    used: rules.Amounts


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
    why: I64 | None = None  # [P] reasons of the checks that failed (only when asked)


def _merged(kept: _PathResult | None, res: _PathResult) -> _PathResult:
    """``kept`` with the rows where ``res`` found the devices and ``kept`` did not (a copy of
    ``res`` at first: results are work arrays)."""
    if kept is None:
        return _PathResult(
            res.ok.copy(),
            res.desir.copy(),
            res.rows.copy(),
            res.scores.copy(),
            res.pos.copy(),
            None if res.rank is None else res.rank.copy(),
            None if res.start is None else res.start.copy(),
        )
    take = res.ok & ~kept.ok
    kept.ok |= take
    kept.desir[take] = res.desir[take]
    kept.rows[take] = res.rows[take]
    kept.scores[take] = res.scores[take]
    kept.pos[take] = res.pos[take]
    if kept.rank is not None and res.rank is not None:
        kept.rank[take] = res.rank[take]
    if kept.start is not None and res.start is not None:
        kept.start[take] = res.start[take]
    return kept


def _usable(
    src: GpuSource,
    ok: B,
    type_id: npt.NDArray[np.int32],
    idx: I64,
    masks: _Masks,
    sc: Scratch | None,
) -> B:
    """``ok`` (GPUs of a path's table) less what the request excludes regardless of usage: GPU
    types, UUIDs, blocked GPUs (``ok`` itself when it excludes nothing). ``sc``: in its work
    arrays."""
    ok_types, uuid_ok = masks.ok_types, masks.uuid_ok
    if ok_types is None and uuid_ok is None and not masks.blocked:
        return ok
    shape = ok.shape
    out = ok.copy() if sc is None else sc.get("ok", shape, np.bool_)
    tmp = np.empty(shape, np.bool_) if sc is None else sc.get("b0", shape, np.bool_)
    if sc is not None:
        np.copyto(out, ok)
    if ok_types is not None:
        out &= np.take(ok_types, type_id, out=tmp, mode="clip")
    if uuid_ok is not None:
        out &= np.take(uuid_ok, idx, out=tmp, mode="clip")
    if masks.blocked:
        out &= ~np.take(src.gpus.blocked, idx, out=tmp, mode="clip")
    return out


def _shared_fit(
    c: ContainerRequest,
    cols: _Columns,
    *,
    min_cores: float,
    mutex: bool,
    why: bool = False,
    scratch: Scratch | None = None,
) -> tuple[B, F64 | float, I64 | None]:
    """Where each shared GPU (hami-core, MPS) of ``cols`` can take one device of ``c``
    (``rules.core_checks``; ``min_cores``: the fewest cores of a GPU of the table, ``mutex``:
    the GPU policy's), the memory it asks of each, and with ``why`` the failed checks'
    reasons. ``scratch``: in its work arrays."""
    cap, ok, used = cols
    sc, shape = scratch, ok.shape
    req_mem = rules.request_memory(
        c.mem_mib, c.mem_percent, cap.mem, sc.get("req_mem", shape, np.float64) if sc else None
    )
    checks = rules.core_checks(
        cap,
        used,
        req_mem,
        c.cores,
        # else every card has more cores than asked: no exclusivity
        exclusive_possible=c.cores >= min_cores,
        mutex=mutex,
        out=(
            (
                sc.get("b0", shape, np.bool_),
                sc.get("b1", shape, np.bool_),
                sc.get("f0", shape, np.float64),
            )
            if sc
            else None
        ),
    )
    reasons = np.zeros(shape, np.int64) if why else None
    fit = rules.fold(checks, ok, fit=sc.get("fit", shape, np.bool_) if sc else None, why=reasons)
    return fit, req_mem, reasons


class _Path:
    """One path's (hami-core, MPS or MIG) GPUs for one decision: usage gathered into the path's
    dense per-node table (or some of its rows) once; containers' planned devices are counted in
    it (never the state's). The last evaluation (fit and GPU scores per position) is kept with
    the positions changed since, so a container asking the same as the previous one is
    re-evaluated only where the previous container's devices went. With ``why``, each
    evaluation also reports which checks failed where (for explanations).

    Everything per position or per table row lives in ``scratch`` (the table's work arrays,
    reused by the next decision): what ``core_path``/``mig_path`` return must be copied
    before the next call. ``memo`` keeps what depends on the full table and a request only."""

    def __init__(
        self,
        src: GpuSource,
        table: PathTable | _TableRows,
        masks: _Masks,
        request: PodRequest,
        *,
        mode: GpuMode,
        scratch: Scratch,
        memo: dict[Any, Any] | None,
        full: PathTable | None = None,
        usage: tuple[F64, F64, F64, I64] | None = None,
        why: bool = False,
        segs: I64 | None = None,
    ) -> None:
        g = src.gpus
        # the segment of each table row (a sub-table's rows are positions in ``segs``)
        self.segments = table.nodes if segs is None else segs[table.nodes]
        self.why = why
        policy = request.gpu_policy
        self.weights = None if request.weights.default else request.weights
        self.mutex = policy.mutex
        self.numa_rank = policy.numa_rank
        self.numa_ascending = policy.numa_groups_ascending
        mig = mode == "mig"
        # topology-aware shared devices: the rows' GPU pair scores [P, W, W]
        self.pairs: F64 | None = None
        pairs = masks.pairs.get(mode) if policy.topology_aware and not mig else None
        if pairs is not None:
            self.pairs = pairs if isinstance(table, PathTable) else pairs[table.sel]
        self.frag = None if mig else masks.frag
        self.src = src
        self.table = table
        self.full = full  # the table ``table`` is some rows of; None: ``table`` is full
        self.memo = memo
        self.mig = mig
        self.scratch = sc = scratch
        idx = table.idx
        self.shape: tuple[int, int] = (idx.shape[0], idx.shape[1])
        self.ok = _usable(src, table.ok, table.type_id, idx, masks, sc)
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

    def _score_out(self, shape: tuple[int, ...]) -> tuple[F64, F64, B]:
        """Work arrays for ``rules.gpu_score``: the desirability, a temporary, finite flags."""
        sc = self.scratch
        return (
            sc.get("desir", shape, np.float64),
            sc.get("f0", shape, np.float64),
            sc.get("b0", shape, np.bool_),
        )

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
            return _row_counts(self._core_fit(c, self._core_columns(None), work=True)[0])
        minr = self._min_rank(c)
        if minr is None:
            return None
        prof = self._mig_profile_all(minr, self.mask.ravel())[1]
        return _row_counts(
            self._mig_fit(prof, self.table.slots, self.slots, self.ok, None, work=True)[0]
        )

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

    # --- shared GPUs (hami-core, MPS) ---

    def _core_columns(self, pos: I64 | None) -> _Columns:
        """Capacities, ok and usage (slots, memory, cores) of every position or of ``pos``."""
        t = self.table
        cap = rules.Amounts(t.slots, t.mem, t.cores)
        used = rules.Amounts(self.slots, self.mem, self.cores)
        if pos is None:
            return _Columns(cap, self.ok, used)
        return _Columns(
            rules.Amounts(*(a.ravel()[pos] for a in cap)),
            self.ok.ravel()[pos],
            rules.Amounts(*(a.ravel()[pos] for a in used)),
        )

    def _core_fit(
        self, c: ContainerRequest, cols: _Columns, *, work: bool
    ) -> tuple[B, F64 | float, I64 | None]:
        """``_shared_fit`` of ``c`` on ``cols``, with ``self.why`` the failed checks' reasons.
        ``work``: in work arrays, read before the next evaluation."""
        return _shared_fit(
            c,
            cols,
            min_cores=self.table.min_cores,
            mutex=self.mutex,
            why=self.why,
            scratch=self.scratch if work else None,
        )

    def _core_eval(
        self, c: ContainerRequest, sign: float, pos: I64 | None
    ) -> tuple[B, F64, I64 | None]:
        """Fit, desirability (``rules.gpu_score`` signed by the GPU policy) and failed checks
        of every position, or of ``pos``. Large tables are evaluated in work arrays; for small
        ones (a few nodes' rows) what a numpy call costs is its call."""
        cols = self._core_columns(pos)
        work = pos is None and self.ok.size > _SMALL
        fit, req_mem, why = self._core_fit(c, cols, work=work)
        if self.frag is not None:  # one container, evaluated whole: no earlier devices
            assert pos is None
            desir = self.frag.desirability(self.segments, self.table.ok, cols, fit, req_mem, c)
            return fit, desir, why
        out = self._score_out(fit.shape) if work else None
        desir = rules.gpu_score(
            cols.cap, cols.used, req_mem, float(c.cores), out, weights=self.weights
        )
        desir *= sign
        return fit, desir, why

    def core_path(self, c: ContainerRequest, sign: float) -> _PathResult:
        key = (c.mem_mib, c.mem_percent, c.cores, sign)
        reuse = self._reuse(key)
        if reuse is None:
            fit, desir, why = self._core_eval(c, sign, None)
        else:
            (fit, desir, *kept), dpos = reuse
            why = kept[0] if kept else None
            if dpos.size:
                f2, d2, w2 = self._core_eval(c, sign, dpos)
                fit.ravel()[dpos] = f2
                desir.ravel()[dpos] = d2
                if why is not None and w2 is not None:
                    why.ravel()[dpos] = w2
        self._cache = (key, [fit, desir] if why is None else [fit, desir, why])
        t = self.table
        rows, scores, pos, total, found_all = self._outputs(
            c.count,
            ("rows", "scores", "pos", "total", "found_all"),
            (np.int64(-1), 0.0, np.int64(-1), 0.0, True),
        )
        if self.pairs is not None:
            self._topology(c, sign, fit, desir, rows, scores, pos, total, found_all)
            return _PathResult(found_all, total, rows, scores, pos, why=self._core_why(c, fit, why))
        avail = fit
        flat_d = desir.ravel()
        for k in range(c.count):
            first, found = _pick(
                desir, avail, self.scratch, self.table.numa, self.numa_rank, self.table.tie_key
            )
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
        return _PathResult(found_all, total, rows, scores, pos, why=self._core_why(c, fit, why))

    @staticmethod
    def _core_why(c: ContainerRequest, fit: B, why: I64 | None) -> I64 | None:
        """Per table row, the failed checks' reasons (None: not asked), with too few fitting
        GPUs for a multi-GPU container."""
        if why is None:
            return None
        row_why: I64 = np.bitwise_or.reduce(why, axis=1)
        if c.count > 1:
            fitting = _row_counts(fit)
            row_why |= ((fitting > 0) & (fitting < c.count)) * np.int64(Reason.TOO_FEW_FITTING)
        return row_why

    def _topology(
        self,
        c: ContainerRequest,
        sign: float,
        fit: B,
        desir: F64,
        rows: I64,
        scores: F64,
        pos: I64,
        total: F64,
        found_all: B,
    ) -> None:
        """``topology-aware`` (HAMi v2.10): of the GPUs that fit, one device takes the least
        connected GPU, several take the set with the highest sum of pair scores
        (``hami.io/node-nvidia-score``); ties go the GPU policy's order. Written into the
        result arrays."""
        assert self.pairs is not None
        W = self.shape[1]
        n = c.count
        if n > W:  # no row has that many GPUs
            found_all[:] = False
            return
        order = self._preference(desir, fit)  # [P, W] columns, best first
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(W)[None, :], axis=1)
        pairs = self.pairs
        fits = fit.sum(axis=1)
        if n == 1:
            links = np.einsum("pde,pe->pd", pairs, fit.astype(np.float64))
            key = np.where(fit, links * (W + 1) + rank, np.inf)
            chosen = key.argmin(axis=1)[:, None]
        elif math.comb(W, n) <= _MAX_COMBINATIONS:
            combos = np.array(list(itertools.combinations(range(W), n)), np.int64)  # [C, n]
            a, b = (
                np.array(x, np.int64)
                for x in zip(*itertools.combinations(range(n), 2), strict=True)
            )
            ca, cb = combos[:, a], combos[:, b]  # [C, pairs]
            ahead = rank[:, ca] < rank[:, cb]  # [P, C, pairs]: score the pair in rank order
            linked = np.where(ahead, pairs[:, ca, cb], pairs[:, cb, ca]).sum(axis=2)  # [P, C]
            valid = fit[:, combos].all(axis=2)
            ranks = np.sort(rank[:, combos], axis=2)  # earliest in the policy's order wins ties
            tie = ranks @ (W ** np.arange(n - 1, -1, -1))
            key = np.where(valid, -linked * float(W**n + 1) + tie, np.inf)
            chosen = combos[key.argmin(axis=1)]
        else:  # too many sets to weigh: the policy's order
            chosen = order[:, :n]
        chosen = np.take_along_axis(chosen, np.argsort(np.take_along_axis(rank, chosen, 1), 1), 1)
        found = fits >= n
        found_all &= found
        at = self.ar[:, None] + chosen  # [P, n]
        pos[:] = at
        flat_d = desir.ravel()
        idx = self.table.idx.ravel()
        for k in range(n):
            fpos = at[found, k]
            rows[found, k] = idx[fpos]
            d = flat_d[fpos]
            total[found] += d
            scores[found, k] = d * sign

    def _preference(self, desir: F64, fit: B) -> I64:
        """Per table row, the columns in the order the GPU policy takes them: by its sort keys
        (NUMA node where it counts), then the higher column (the higher GPU index)."""
        W = self.shape[1]
        cols = np.broadcast_to(np.arange(W - 1, -1, -1), self.shape)
        fine = -np.round(np.where(fit, desir, -np.inf), 9)
        numa = self.table.numa.astype(np.int64)
        keys: list[npt.NDArray[Any]] = [cols]
        if self.numa_rank == 1:
            keys.append(-numa)
        keys.append(fine)
        if self.numa_rank == 0:
            keys.append(-numa)
        order: I64 = np.lexsort(keys, axis=-1)
        return order

    def numa_bound(self, c: ContainerRequest, sign: float) -> _PathResult:
        """``c`` with all its devices on one NUMA node (``nvidia.com/numa-bind``): per table row,
        the highest-numbered NUMA node where it fits (the lowest for the single name binpack).
        With ``why``, what failed everywhere, and NUMA where enough GPUs fit across NUMA nodes
        but not on one."""
        base = self.ok
        evaluate = self.mig_path if self.mig else self.core_path
        anywhere: tuple[B, I64 | None] | None = None
        if self.why:
            res = evaluate(c, sign)
            anywhere = (res.ok.copy(), None if res.why is None else res.why.copy())
        merged: _PathResult | None = None
        try:
            groups = np.unique(self.table.numa[base])
            if not self.numa_ascending:
                groups = groups[::-1]
            for u in groups.tolist():
                self.ok = base & (self.table.numa == u)
                self._cache, self._dirty = None, []
                merged = _merged(merged, evaluate(c, sign))
        finally:
            self.ok = base
            self._cache, self._dirty = None, []
        if merged is None:  # no GPU of this path to consider
            merged = _merged(None, evaluate(c, sign))
        if anywhere is not None:
            fits_anywhere, why = anywhere
            merged.why = (why if why is not None else 0) | (
                (fits_anywhere & ~merged.ok) * np.int64(Reason.NUMA)
            )
        return merged

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
        prof = np.take(t.lut.profile, li, out=sc.get("prof", flat, np.int64), mode="clip")
        return li, prof.reshape(self.shape)

    def _mig_fit(
        self, prof: I64, slots: F64, used_slots: F64, ok: B, reasons: I64 | None, *, work: bool
    ) -> tuple[B, I64 | None]:
        """Where each position can take one device with the profiles chosen (``prof``), by
        ``rules.mig_checks``; with ``reasons`` (why no profile was chosen, per position) also
        the failed checks' reasons. ``work``: in work arrays."""
        sc, shape = self.scratch, prof.shape
        checks = rules.mig_checks(
            slots,
            used_slots,
            prof,
            Reason(0) if reasons is None else reasons,
            mutex=self.mutex,
            out=sc.get("b0", shape, np.bool_) if work else None,
        )
        why = None if reasons is None else np.zeros(shape, np.int64)
        fit = rules.fold(checks, ok, fit=sc.get("fit", shape, np.bool_) if work else None, why=why)
        return fit, why

    def _mig_eval(
        self,
        minr: I64,
        sign: float,
        us: F64,
        um: F64,
        uc: F64,
        mask: I64,
        pos: I64 | None,
        *,
        explain: bool = False,
    ) -> tuple[list[npt.NDArray[Any]], I64 | None]:
        """Per position (every one, or ``pos``): the profile and start the choice table gives
        (``mig_policy``), that profile's memory and cores, fit and desirability; with
        ``explain`` (and ``self.why``) the failed checks' reasons. Large tables are evaluated
        in work arrays."""
        t, sc = self.table, self.scratch
        lut = t.lut
        assert lut is not None and t.lut_off is not None
        assert t.lut_full is not None and t.lut_stride is not None
        slots, mem, cores, ok = t.slots, t.mem, t.cores, self.ok
        m = mask.ravel()
        work = pos is None and ok.size > _SMALL
        shape: tuple[int, ...]
        if work:
            shape = self.shape
            li, prof = self._mig_profile_all(minr, m)
            flat = (t.idx.size,)
            start, pmem, pcore = (
                np.take(a, li, out=sc.get(name, flat, a.dtype.type), mode="clip").reshape(shape)
                for name, a in (("start", lut.start), ("pmem", lut.mem), ("pcore", lut.cores))
            )
        else:
            off, full, stride = t.lut_off, t.lut_full, t.lut_stride
            if pos is not None:
                off, full, stride, minr, m = off[pos], full[pos], stride[pos], minr[pos], m[pos]
                slots, mem, cores = slots.ravel()[pos], mem.ravel()[pos], cores.ravel()[pos]
                ok, us, um, uc = ok.ravel()[pos], us.ravel()[pos], um.ravel()[pos], uc.ravel()[pos]
                shape = pos.shape
            else:
                shape = ok.shape
            li = m & full
            li *= stride
            li += off
            li += minr
            prof = lut.profile.take(li).reshape(shape)
            start = lut.start.take(li).reshape(shape)
            pmem = lut.mem.take(li).reshape(shape)
            pcore = lut.cores.take(li).reshape(shape)
        reasons = lut.why.take(li).reshape(shape) if explain and self.why else None
        fit, why = self._mig_fit(prof, slots, us, ok, reasons, work=work)
        out = self._score_out(shape) if work else None
        desir = rules.gpu_score(
            rules.Amounts(slots, mem, cores),
            rules.Amounts(us, um, uc),
            pmem,
            pcore,
            out,
            weights=self.weights,
        )
        desir *= sign
        return [prof, start, pmem, pcore, fit, desir], why

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
                if self.why:
                    none = np.full(self.shape, -1, np.int64)
                    reasons = np.full(self.shape, int(Reason.MIG_NO_PROFILE), np.int64)
                    why = self._mig_fit(none, t.slots, self.slots, self.ok, reasons, work=False)[1]
                    assert why is not None
                    result.why = np.bitwise_or.reduce(why, axis=1)
                return result
            ev, why = self._mig_eval(
                minr, sign, self.slots, self.mem, self.cores, self.mask, None, explain=True
            )
        else:
            (minr, *ev), dpos = reuse
            why = ev.pop() if self.why else None
            if dpos.size:
                part, part_why = self._mig_eval(
                    minr, sign, self.slots, self.mem, self.cores, self.mask, dpos, explain=True
                )
                for a, b in zip(ev, part, strict=True):
                    a.ravel()[dpos] = b
                if why is not None and part_why is not None:
                    why.ravel()[dpos] = part_why
        self._cache = (key, [minr, *ev] if why is None else [minr, *ev, why])
        if why is not None:  # the first device's checks: what stops the container
            result.why = np.bitwise_or.reduce(why, axis=1)
        us, um, uc, mask = self.slots, self.mem, self.cores, self.mask
        if c.count > 1:  # this path's earlier devices count for its later ones only
            us, um = self._copy(us, "us_c"), self._copy(um, "um_c")
            uc, mask = self._copy(uc, "uc_c"), self._copy(mask, "mask_c")
        for k in range(c.count):
            prof, start, pmem, pcore, fit, desir = ev
            first, found = _pick(
                desir, fit, self.scratch, self.table.numa, self.numa_rank, self.table.tie_key
            )
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
                part, _ = self._mig_eval(minr, sign, us, um, uc, mask, fpos)
                if k == 0:  # the cached evaluation stays as it was
                    ev = [self._copy(a, f"ev_{i}") for i, a in enumerate(ev)]
                for a, b in zip(ev, part, strict=True):
                    a.ravel()[fpos] = b
        return result


def _min_rank(
    src: GpuSource, table: PathTable, c: ContainerRequest, memo: dict[Any, Any] | None
) -> I64 | None:
    """Per position of ``table``, the smallest profile rank ``c`` accepts
    (``mig_policy.smallest_rank``; R: none); None if no geometry has a profile large enough.
    Depends on the table and the request only: kept in ``memo`` (the table's, read-only) for
    the next decisions."""
    key = ("min_rank", c.mem_mib, c.mem_percent, c.cores)
    if memo is not None and key in memo:
        cached: I64 | None = memo[key]
        return cached
    minr = np.zeros(table.idx.size, np.int64)
    any_fit = False
    for gid, gpos in table.geoms:
        geom = src.geometries[gid]
        req_mem = rules.request_memory(c.mem_mib, c.mem_percent, table.mem.ravel()[gpos])
        ranks = smallest_rank(geom.memory, geom.cores, req_mem, c.cores)
        minr[gpos] = ranks
        any_fit = any_fit or bool((ranks < len(geom.profiles)).any())
    minr.setflags(write=False)
    result = minr if any_fit else None
    if memo is not None:
        if sum(1 for k in memo if k[0] == "min_rank") >= 16:  # a few request shapes recur
            for k in [k for k in memo if k[0] == "min_rank"]:
                del memo[k]
        memo[key] = result
    return result


def _reasons(
    src: GpuSource, layout: Layout, request: PodRequest, masks: _Masks, feasible: B
) -> I64:
    """[S] Reason bits of every node that is not feasible: the static reasons of its GPUs
    (``rules.static_reasons``), too few GPUs, and the checks that failed when those nodes are
    evaluated alone (``_evaluate`` with ``why``: the decision's own evaluation), for the nodes
    with a GPU the pod considers at all."""
    S = len(layout.names)
    out = np.zeros(S, np.int64)
    infeasible = ~feasible
    if not infeasible.any():
        return out
    n = layout.n_rows
    g = src.gpus
    everywhere = np.ones(n, np.bool_)
    rows_bits = rules.static_reasons(
        g.healthy[:n],
        g.conflict[:n],
        everywhere if masks.ok_types is None else masks.ok_types[g.type_id[:n]],
        everywhere if masks.uuid_ok is None else masks.uuid_ok[:n],
        g.mode[:n],
        g.geom[:n] >= 0,
        request.modes,
        cordoned=g.cordoned[:n],
        legacy=g.legacy[:n],
    )
    seg_bits = np.bitwise_or.reduce(_per_gpu(rows_bits, layout, 0), axis=0)
    seg_bits |= _too_few_gpus(layout, request) * np.int64(Reason.TOO_FEW_GPUS)
    out[infeasible] = seg_bits[infeasible]
    considered = _per_gpu(rows_bits == 0, layout, False).any(axis=0)
    segs = np.flatnonzero(infeasible & considered)
    if not segs.size:
        return out
    # Which checks fail never depends on the fragmentation rule's order of GPUs (it orders
    # those of one-container pods, found wherever enough GPUs fit): evaluate without it.
    masks = replace(masks, frag=None)
    # The layout's work arrays when no decision holds them now (explanations come after).
    owned = layout.scratch.acquire()
    try:
        if segs.size * 3 > S:  # most nodes: the full tables beat gathering their rows
            why = np.zeros(S, np.int64)
            _evaluate(src, layout, request, masks, None, owned, why)
            out[segs] |= why[segs]
        else:
            why = np.zeros(segs.size, np.int64)
            _evaluate(src, layout, request, masks, segs, owned, why)
            out[segs] |= why
    finally:
        if owned:
            layout.scratch.release()
    return out


def _pair_scores(state: ClusterState, layout: Layout, owned: bool) -> dict[GpuMode, F64]:
    """Each shared path's table's GPU pair scores [P, W, W], by its mode."""
    return {
        mode: _table_pair_scores(state, layout, table, owned)
        for mode, table in layout.tables()
        if mode in rules.SHARED_MODES and table is not None and table.nodes.size
    }


def _table_pair_scores(state: ClusterState, layout: Layout, table: PathTable, owned: bool) -> F64:
    """``table``'s GPU pair scores [P, W, W] (``hami.io/node-nvidia-score``; 0 where a node has
    none), kept with the table until any node's scores change."""
    memo = table.scratch.memo if owned else {}
    kept = memo.get("pairs")
    if kept is not None and kept[0] == state.pair_scores_version:
        cached: F64 = kept[1]
        return cached
    P, W = table.idx.shape
    pairs = np.zeros((P, W, W))
    for i, s in enumerate(table.nodes.tolist()):
        entry = state.nodes[layout.names[s]]
        if not entry.pair_scores:
            continue
        uuids = [d.id for d in entry.devices]
        for a, ua in enumerate(uuids[:W]):
            row = entry.pair_scores.get(ua, {})
            for b, ub in enumerate(uuids[:W]):
                if a != b:
                    pairs[i, a, b] = row.get(ub, 0)
    pairs.setflags(write=False)
    memo["pairs"] = (state.pair_scores_version, pairs)
    return pairs


def _uuid_rows(state: ClusterState, layout: Layout, owned: bool) -> dict[str, list[int]]:
    """Every GPU UUID's rows (UUIDs may repeat across nodes), kept with the layout."""
    rows_of: dict[str, list[int]] | None = layout.scratch.memo.get("uuid_rows") if owned else None
    if rows_of is None:  # rows are fixed until the layout changes
        rows_of = {}
        for entry in state.nodes.values():
            for uuid, r in entry.rows.items():
                rows_of.setdefault(uuid, []).append(r)
        if owned:
            layout.scratch.memo["uuid_rows"] = rows_of
    return rows_of


def _mig_devices(state: GpuSource, rows: I64, prof: I64, start: I64) -> tuple[I64, F64, F64]:
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


# ----- the fragmentation policy --------------------------------------------------------------


def _fragmentation_applies(request: PodRequest) -> bool:
    """Whether the fragmentation rule ranks nodes for ``request``: it asks for it (its node
    policy) and is a CPU-only pod or one container of shared (hami-core, MPS) devices without
    NUMA binding or topology awareness. Any other pod (MIG, several containers) goes by
    binpack under that policy."""
    if not request.fragmentation or len(request.containers) > 1:
        return False
    if not request.containers:
        return True
    offered = rules.modes(request.modes)
    return (
        any(m in offered for m in rules.SHARED_MODES)
        and not request.numa_bind
        and not request.gpu_policy.topology_aware
    )


def _shape(request: PodRequest) -> frag.Shape:
    """The fragmentation rule's kind of pod for ``request`` (its first container's devices:
    the rule ranks pods of one container): each device the larger of its cores and memory
    percentages of a GPU."""
    c = request.containers[0] if request.containers else None
    return frag.pod_shape(
        request.cpu_milli,
        request.memory_bytes,
        c.count if c is not None else 0,
        max(c.cores / 100, c.mem_percent / 100) if c is not None else 0.0,
    )


def _asking(state: ClusterState, request: PodRequest) -> None:
    """Count ``request`` in the workload the fragmentation policy weighs (``state.kinds``,
    each pod once): a pod of one container of devices a shared (hami-core, MPS) GPU may
    take, whatever its own node policy; a pod without GPUs tells that Tessera places such
    pods. ``decide`` calls it for every pod it is asked about, those no node has room for
    too."""
    if not request.wants_gpu:
        state.kinds.host_only_asks()
        return
    if len(request.containers) != 1 or not request.containers[0].count:
        return
    offered = rules.modes(request.modes)
    if any(m in offered for m in rules.SHARED_MODES):
        state.kinds.arrive(request.uid or request.key, _shape(request))


def _host_left(state: ClusterState, nodes: I64) -> tuple[F64, F64]:
    """CPU and memory left on ``nodes`` (the state's node indices; inf where the node's
    allocatable is unknown)."""
    cpu_alloc, mem_alloc = state.node_cpu_alloc[nodes], state.node_mem_alloc[nodes]
    cpu = np.where(cpu_alloc > 0, cpu_alloc - state.node_cpu_req[nodes], np.inf)
    mem = np.where(mem_alloc > 0, mem_alloc - state.node_mem_req[nodes], np.inf)
    return cpu, mem


@dataclass(frozen=True)
class _Frag:
    """The fragmentation rule's view of one decision (``core.fragmentation``): the workload
    the cluster holds, the pod's shape, and where to read segments' CPU and memory left
    (``left``; the rows kept between decisions keep their own)."""

    mix: frag.TaskMix
    shape: frag.Shape
    state: ClusterState
    node_idx: I64  # [S] the state's node index of each segment
    fuller: bool  # ties to the fuller node (``fragmentation.node_score``)

    @staticmethod
    def of(state: ClusterState, layout: Layout, request: PodRequest, fuller: bool) -> _Frag:
        return _Frag(state.task_mix(), _shape(request), state, layout.node_idx, fuller)

    def left(self, segments: I64) -> tuple[F64, F64]:
        """CPU and memory left on ``segments`` (``_host_left``)."""
        return _host_left(self.state, self.node_idx[segments])

    @staticmethod
    def free(ok: B, cols: _Columns) -> F64:
        """Each GPU's free share (``fragmentation.free_share``), NaN where ``ok`` is not."""
        cap, _, used = cols
        share = frag.free_share(cap.slots, used.slots, cap.cores, used.cores, cap.mem, used.mem)
        return np.where(ok, share, np.nan)

    @staticmethod
    def take(cols: _Columns, req_mem: F64 | float, c: ContainerRequest) -> F64:
        """The share of each GPU one device of ``c`` takes: the larger of its cores and memory
        shares; all of it when it asks every core."""
        cap = cols.cap
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.maximum(c.cores / cap.cores, np.asarray(req_mem) / cap.mem)
        out: F64 = np.where(c.cores >= cap.cores, 1.0, np.minimum(np.fmax(share, 0.0), 1.0))
        return out

    def desirability(
        self,
        segments: I64,
        ok: B,
        cols: _Columns,
        fit: B,
        req_mem: F64 | float,
        c: ContainerRequest,
    ) -> F64:
        """Per table position, how good a GPU is for one device of ``c`` (higher is better):
        minus what it does to the node's fragmentation for one device; the least free share
        first for several (``fragmentation.placement_delta``'s choice). ``ok``: the table's
        GPUs (all of them count for the workload); ``fit``: those that can take the device."""
        free = self.free(ok, cols)
        if c.count == 1:
            cpu, mem = self.left(segments)
            d = frag.device_deltas(
                free,
                cpu,
                mem,
                self.mix,
                self.shape,
                fit,
                self.take(cols, req_mem, c),
            )
            return -d
        out: F64 = np.where(fit, -np.fmax(free, 0.0), -np.inf)
        return out


def _fragmentation_scores(
    state: ClusterState,
    layout: Layout,
    request: PodRequest,
    masks: _Masks,
    ctx: _Frag,
    feasible: B,
    owned: bool,
) -> tuple[F64, F64]:
    """[S] the fragmentation policy's node score (``fragmentation.node_score`` of what the
    pod does to the node's fragmentation; 0 where not feasible), and that delta (GPU shares;
    0 on nodes without shared GPUs, inf where not feasible). A node's fragmentation counts
    its healthy GPUs of each shared path (hami-core, MPS) apart, the pod's delta is the best
    path's: a one-device pod's on its best GPU (``fragmentation.node_deltas``), several
    devices' on the tightest GPUs with room (``fragmentation.placement_delta``, the GPUs the
    plan takes). What each table row gives is kept with the table between decisions
    (``_FragRows``) and recomputed where pods changed a node since."""
    S = len(layout.names)
    score = np.zeros(S)
    if not feasible.any():
        return score, np.full(S, np.inf)
    shared = [
        (mode, table)
        for mode, table in layout.tables()
        if mode in rules.SHARED_MODES and table is not None and table.nodes.size
    ]
    if len(shared) == 1:  # the common case: each kind keeps its rows' scores too
        mode, table = shared[0]
        kept = _FragRows.of(state, layout, table, ctx.mix, owned)
        d, s = kept.deltas(state, table, masks, request, mode, ctx)
        delta = np.zeros(S)
        delta[table.nodes] = d
        delta[~np.isfinite(delta)] = 0.0
        score.fill(_NO_SHARED_SCORE[ctx.fuller])
        score[table.nodes] = s
        score[~feasible] = 0.0
        return score, delta
    delta = np.full(S, np.inf)
    free_share = np.zeros(S)  # of the node's GPUs (of the shared paths)
    for mode, table in shared:
        kept = _FragRows.of(state, layout, table, ctx.mix, owned)
        free_share[table.nodes] = np.maximum(free_share[table.nodes], kept.free_share)
        d, _ = kept.deltas(state, table, masks, request, mode, ctx)
        delta[table.nodes] = np.minimum(delta[table.nodes], d)
    delta = np.where(np.isfinite(delta), delta, 0.0)  # a node without shared GPUs: nothing
    segs = np.flatnonzero(feasible)
    score[segs] = frag.node_score(delta[segs], free_share[segs], ctx.fuller)
    return score, delta


_NO_SHARED_SCORE = {
    fuller: float(frag.node_score(np.zeros(1), np.zeros(1), fuller)[0]) for fuller in (True, False)
}
"""The fragmentation score of a node without shared GPUs the pod fits (delta 0, no free
share), by the tie's direction."""


class _FragRows:
    """What the fragmentation policy reads of every row of one table, kept with the table
    between decisions and recomputed only in the rows of nodes pods changed since
    (``ClusterState.usage_changes_since``: their GPUs, CPU or memory): each GPU's free share,
    ``fragmentation.parts``, and per kind of request (its devices, CPU, memory and GPU
    selectors) the delta of its best placement on each row.

    A new workload mix reaches the rows gradually: the rows pods change move to it at once,
    and ``ROLL_DECISIONS`` decisions move the rest, so no decision recomputes every row
    because the mix moved. Until a row moves, its parts and deltas are those of the mix
    before (a node's delta is a difference of fragmentations under one mix; nodes under two
    mixes a few percent apart compare as under either). A mix newer still waits until every
    row has moved: two mixes at most."""

    _MAX_KINDS = 64
    ROLL_DECISIONS = 32

    def __init__(
        self,
        mix: frag.TaskMix,
        clock: int,
        free: F64,
        parts: frag.Parts,
        left: tuple[F64, F64],
    ) -> None:
        self.clock = clock
        self.changed_at = np.full(free.shape[0], clock, np.int64)  # [P] usage clock, last change
        self.free = free
        self.free_share = frag.pack_key(free)  # [P] the node's mean free share
        self.cpu_left, self.mem_left = left  # [P] ``_host_left`` of each row's node
        self.newest = 0  # generation of the newest mix
        self.mixes: dict[int, tuple[frag.TaskMix, frag.Parts]] = {0: (mix, parts)}
        self.row_gen = np.zeros(free.shape[0], np.int64)  # [P] the mix each row is under
        # per kind of request: the usage clock and row generations it was computed at, its
        # delta and node score on each row
        self._deltas: dict[tuple[Any, ...], tuple[int, I64, F64, F64]] = {}

    @property
    def mix(self) -> frag.TaskMix:
        """The newest mix (the one rows move to)."""
        return self.mixes[self.newest][0]

    @staticmethod
    def of(
        state: ClusterState,
        layout: Layout,
        table: PathTable,
        mix: frag.TaskMix,
        owned: bool,
    ) -> _FragRows:
        """The table's rows as they are now (kept in its memo when ``owned``), rows moved
        towards ``mix``."""
        memo: dict[Any, Any] = table.scratch.memo if owned else {}
        clock = state.usage_clock
        kept: _FragRows | None = memo.get("frag_rows")
        if kept is not None:
            rows = _changed_rows(state, layout, table, kept.clock)
            if rows is not None:
                kept._adopt(mix)
                if rows.size:
                    kept.changed_at[rows] = clock
                    nodes = layout.node_idx[table.nodes[rows]]
                    kept.cpu_left[rows], kept.mem_left[rows] = _host_left(state, nodes)
                    free = _free_rows(state, table, rows)
                    kept.free[rows] = free
                    kept.free_share[rows] = frag.pack_key(free)
                    kept._move(rows)
                kept._roll()
                kept.clock = clock
                return kept
        free = _free_rows(state, table, None)
        left = _host_left(state, layout.node_idx[table.nodes])
        kept = _FragRows(mix, clock, free, frag.parts(free, mix), left)
        memo["frag_rows"] = kept
        return kept

    def _adopt(self, mix: frag.TaskMix) -> None:
        """Start moving rows to ``mix`` (unless they are all on it, or still moving)."""
        if mix is self.mix or len(self.mixes) > 1:
            return
        p, k = self.row_gen.size, len(mix.weight)
        parts = self.mixes[self.newest][1]
        if not np.array_equal(mix.share, self.mix.share):  # parts depend on the shares alone
            parts = frag.Parts(np.zeros(p), np.zeros((p, k)), np.zeros((p, k)))
        self.newest += 1
        self.mixes[self.newest] = (mix, parts)

    def _move(self, rows: I64) -> None:
        """``rows``' parts under the newest mix (their ``free`` up to date)."""
        mix, parts = self.mixes[self.newest]
        fresh = frag.parts(self.free[rows], mix)
        parts.total[rows] = fresh.total
        parts.small[rows] = fresh.small
        parts.room[rows] = fresh.room
        self.row_gen[rows] = self.newest

    def _roll(self) -> None:
        """Move the next rows still under an older mix; forget that mix once none is."""
        if len(self.mixes) == 1:
            return
        behind = np.flatnonzero(self.row_gen != self.newest)
        step = self.step
        if behind.size and self._shared_parts():  # the same kinds reweighed
            self.row_gen[behind[:step]] = self.newest
        elif behind.size:
            self._move(behind[:step])
        if behind.size <= step:
            self.mixes = {self.newest: self.mixes[self.newest]}

    @property
    def step(self) -> int:
        """Rows a decision moves to the newest mix, and a kind's kept deltas follow."""
        return -(-self.row_gen.size // self.ROLL_DECISIONS)

    def _shared_parts(self) -> bool:
        return all(p is self.mixes[self.newest][1] for _, p in self.mixes.values())

    def groups(self, at: I64 | None) -> list[tuple[B | slice, frag.TaskMix, frag.Parts]]:
        """``at``'s rows (all when None) by the mix they are under: (which of them, the
        mix, its parts at those rows)."""
        if len(self.mixes) == 1:
            mix, p = self.mixes[self.newest]
            if at is None:
                return [(slice(None), mix, p)]
            return [(slice(None), mix, frag.Parts(p.total[at], p.small[at], p.room[at]))]
        gens = self.row_gen if at is None else self.row_gen[at]
        out: list[tuple[B | slice, frag.TaskMix, frag.Parts]] = []
        for g, (mix, p) in self.mixes.items():
            sel = gens == g
            if sel.any():
                rows = np.flatnonzero(sel) if at is None else at[sel]
                out.append((sel, mix, frag.Parts(p.total[rows], p.small[rows], p.room[rows])))
        return out

    def deltas(
        self,
        state: ClusterState,
        table: PathTable,
        masks: _Masks,
        request: PodRequest,
        mode: GpuMode,
        ctx: _Frag,
    ) -> tuple[F64, F64]:
        """[P] per row, the delta of the pod's placement there (inf where it has no room),
        and the node score of that delta (``_scores``).

        Kept per kind of request (its devices, CPU, memory and GPU selectors), recomputed
        where nodes changed or moved to a newer mix since. A pod's CPU and memory change its
        delta on a node only where what is left after it falls below what some kind of the
        mix asks (``_tight``); elsewhere the delta is that of the same GPU request without
        CPU or memory. So pods that differ only in CPU and memory share one kept row set,
        and each recomputes its tight rows; a pod tight on many nodes keeps its own."""
        pod = ctx.shape
        tight = self._tight(ctx) if pod.cpu_milli or pod.memory_bytes else None
        if tight is not None and tight.size * 8 > table.nodes.size:
            tight = None  # its own kept rows
        at = ctx if tight is None else replace(ctx, shape=replace(pod, cpu_milli=0, memory_bytes=0))
        c = request.containers[0] if request.containers else None
        key = (
            mode,
            None if c is None else (c.count, c.mem_mib, c.mem_percent, c.cores),
            at.shape.cpu_milli,
            at.shape.memory_bytes,
            request.use_types,
            request.nouse_types,
            request.use_uuids,
            request.nouse_uuids,
            request.gpu_policy.mutex,
            masks.blocked,
            ctx.fuller,
        )
        found = self._deltas.get(key)
        rows = None if found is None else self._stale(*found[:2])
        if found is None or rows is None:
            d = _row_deltas(state, table, masks, request, at, self, None)
            score = self._scores(d, None, ctx.fuller)
            if len(self._deltas) >= self._MAX_KINDS:
                self._deltas.clear()
            gens = self.row_gen.copy()
        else:
            _, gens, d, score = found
            if rows.size:
                d[rows] = _row_deltas(state, table, masks, request, at, self, rows)
                score[rows] = self._scores(d[rows], rows, ctx.fuller)
                gens[rows] = self.row_gen[rows]
        self._deltas[key] = (state.usage_clock, gens, d, score)
        if tight is None or not tight.size:
            return d, score
        d, score = d.copy(), score.copy()
        d[tight] = _row_deltas(state, table, masks, request, ctx, self, tight)
        score[tight] = self._scores(d[tight], tight, ctx.fuller)
        return d, score

    def _scores(self, d: F64, rows: I64 | None, fuller: bool) -> F64:
        """``fragmentation.node_score`` of deltas ``d`` on ``rows`` (all when None), ties to
        the ``fuller`` node or the emptier: a row without room scores as delta 0, as in
        ``_fragmentation_scores``."""
        share = self.free_share if rows is None else self.free_share[rows]
        return frag.node_score(np.where(np.isfinite(d), d, 0.0), share, fuller)

    def _stale(self, clock: int, gens: I64) -> I64 | None:
        """The rows of kept deltas computed at usage ``clock``, row generations ``gens``, to
        recompute: those pods changed since, and a step of those still under an older mix
        than their row; None when a quarter of the rows or more (recompute them all)."""
        stale = self.changed_at > clock
        lag = gens != self.row_gen
        if lag.any():
            stale[np.flatnonzero(lag & ~stale)[: self.step]] = True
        rows = np.flatnonzero(stale)
        return None if rows.size * 4 > stale.size else rows

    def _tight(self, ctx: _Frag) -> I64:
        """The rows where CPU or memory left after the pod is below the most some kind of a
        mix the rows are under asks."""
        cpu = max(float(m.cpu.max()) for m, _ in self.mixes.values())
        mem = max(float(m.memory.max()) for m, _ in self.mixes.values())
        short = self.cpu_left - ctx.shape.cpu_milli < cpu
        short |= self.mem_left - ctx.shape.memory_bytes < mem
        rows: I64 = np.flatnonzero(short)
        return rows


_FEW_CHANGES = 16


def _changed_rows(state: ClusterState, layout: Layout, table: PathTable, clock: int) -> I64 | None:
    """The rows of ``table`` whose node pods changed since ``clock``; None when too many (or
    too long ago) to refresh them one by one: a quarter of the rows (a refresh of a quarter
    costs about half a full one, its Python work being per call, not per row)."""
    changed = state.usage_changes_since(clock)
    if changed is None or len(changed) > 2 * table.nodes.size:
        return None
    if not changed:
        return np.zeros(0, np.int64)
    if len(changed) <= _FEW_CHANGES:  # a set beats numpy's unique on a few rows
        segs = np.array(sorted({int(s) for s in layout.seg_of_row[changed] if s >= 0}), np.int64)
    else:
        segs = np.unique(layout.seg_of_row[np.array(changed, np.int64)])
        segs = segs[segs >= 0]
    if not segs.size:
        return np.zeros(0, np.int64)
    at = np.minimum(np.searchsorted(table.nodes, segs), table.nodes.size - 1)
    rows: I64 = at[table.nodes[at] == segs]
    return None if rows.size * 4 > table.nodes.size else rows


def _row_columns(
    state: ClusterState, table: PathTable, masks: _Masks | None, rows: I64 | None
) -> tuple[_Columns, I64]:
    """Capacities, usable GPUs (``_usable``; the table's with no ``masks``) and usage of
    ``rows`` of ``table`` (all when None), and those rows: what the fragmentation rule reads,
    gathered directly (a ``_Path`` over a few rows costs several times more)."""
    sel: I64 | slice = slice(None) if rows is None else rows
    at = np.arange(table.nodes.size) if rows is None else rows
    idx = table.idx[sel]
    g = state.gpus
    cap = rules.Amounts(table.slots[sel], table.mem[sel], table.cores[sel])
    used = rules.Amounts(
        np.take(g.used_slots, idx, mode="clip"),
        np.take(g.used_mem, idx, mode="clip"),
        np.take(g.used_cores, idx, mode="clip"),
    )
    ok = table.ok[sel]
    if masks is not None:
        ok = _usable(state, ok, table.type_id[sel], idx, masks, None)
    return _Columns(cap, ok, used), at


def _free_rows(state: ClusterState, table: PathTable, rows: I64 | None) -> F64:
    """Each GPU's free share in ``rows`` of ``table`` (all when None), NaN where no GPU."""
    cols, _ = _row_columns(state, table, None, rows)
    return _Frag.free(cols.ok, cols)


def _row_deltas(
    state: ClusterState,
    table: PathTable,
    masks: _Masks,
    request: PodRequest,
    ctx: _Frag,
    kept: _FragRows,
    rows: I64 | None,
) -> F64:
    """The delta of the pod's placement on ``rows`` of ``table`` (all when None; inf where it
    has no room), each row under the mix its parts are (``_FragRows.groups``)."""
    cols, at = _row_columns(state, table, masks, rows)
    free = kept.free[at]
    cpu, mem = kept.cpu_left[at], kept.mem_left[at]
    c = request.containers[0] if request.containers else None
    pod = ctx.shape
    fit: B | None = None
    take: F64 | None = None
    alike: list[npt.NDArray[Any]] = [free, cpu, mem, kept.row_gen[at]]
    if c is not None:
        mutex = request.gpu_policy.mutex
        fit, req_mem, _ = _shared_fit(c, cols, min_cores=table.min_cores, mutex=mutex)
        take = _Frag.take(cols, req_mem, c)
        alike += [fit, take]
    # rows alike (a young cluster's empty nodes of one model, say) computed once
    distinct = _distinct_rows(alike) if at.size >= _DISTINCT_FROM else None
    if distinct is not None:
        first = distinct[0]
        at, free, cpu, mem = at[first], free[first], cpu[first], mem[first]
        if fit is not None and take is not None:
            fit, take = fit[first], take[first]
    if fit is None or take is None:  # only the CPU and memory change

        def one(sel: B | slice, mix: frag.TaskMix, here: frag.Parts) -> F64:
            f, cl, ml = free[sel], cpu[sel], mem[sel]
            before = frag.fragmentation(f, cl, ml, mix, here)
            after = frag.fragmentation(f, cl - pod.cpu_milli, ml - pod.memory_bytes, mix, here)
            out: F64 = after - before
            return out

    else:
        several = c is not None and c.count > 1
        room, share = fit, take

        def one(sel: B | slice, mix: frag.TaskMix, here: frag.Parts) -> F64:
            args = (free[sel], cpu[sel], mem[sel], mix, pod, room[sel], share[sel], here)
            return frag.placement_delta(*args).delta if several else frag.node_best(*args)

    groups = kept.groups(None if rows is None and distinct is None else at)
    if len(groups) == 1:
        out = one(*groups[0])
    else:
        out = np.empty(at.size)
        for sel, mix, here in groups:
            out[sel] = one(sel, mix, here)
    return out if distinct is None else out[distinct[1]]


_DISTINCT_FROM = 256
"""From this many rows on, ``_row_deltas`` computes rows alike once."""

_ROW_KEY = np.random.default_rng(20240601).uniform(0.5, 1.5, 64)


def _distinct_rows(columns: Sequence[npt.NDArray[Any]]) -> tuple[I64, I64] | None:
    """Where the rows of ``columns`` (each [n] or [n, w]) repeat: the first row of each
    distinct one and each row's index among those; None when more than half of them are
    distinct (not worth it). Rows are told apart by a random projection of their values,
    then checked equal to the row standing for them, so rows that only project alike are
    never merged (None then too)."""
    n = columns[0].shape[0]
    sig = np.concatenate([np.asarray(a, np.float64).reshape(n, -1) for a in columns], axis=1)
    if sig.shape[1] > _ROW_KEY.size:
        return None
    sig = np.nan_to_num(sig, nan=-1.0, posinf=1e300, neginf=-1e300)
    _, first, inverse = np.unique(sig @ _ROW_KEY[: sig.shape[1]], True, True)
    if first.size * 2 > n or not np.array_equal(sig, sig[first[inverse]]):
        return None
    return first.astype(np.int64), inverse.astype(np.int64).ravel()


def _node_scores(state: ClusterState, layout: Layout) -> F64:
    """Each segment's node score (``rules.node_score``) from the per-node sums the state keeps
    (instead of summing 40k GPU rows)."""
    if not layout.n_rows:
        return np.zeros(0)
    cpu = (
        (state.node_cpu_req, state.node_cpu_alloc, state.node_mem_req, state.node_mem_alloc)
        if state.config.node_score_cpu_memory
        else None
    )
    return rules.node_score(
        rules.Amounts(state.node_slots, state.node_mem, state.node_cores),
        rules.Amounts(state.node_used_slots, state.node_used_mem, state.node_used_cores),
        cpu,
        at=layout.node_idx,
    )


__all__ = [
    "Decision",
    "PlannedDevice",
    "PodPlan",
    "decide",
    "feasible_on",
    "plan_on",
]
