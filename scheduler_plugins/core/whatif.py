"""What-ifs of kube-scheduler's preemption: would a pod fit a node if some pods there were gone
(and others placed), and on which nodes would it fit once every pod of a lower priority is
gone.

Computed on a copy of those nodes' rows only (``NodeView``): the columns pods change are copied,
the others are read through (a view when the rows are one node's, consecutive); the view has a
``Layout`` of its own (rows numbered from 0) on which decide's engine runs unchanged
(``decide.feasible_on``/``plan_on``): the same rules, the same failure reasons. The state is
never copied and never changed.

- ``what_if``: one node, as kube-scheduler's Filter sees it during a preemption dry run: without
  the pods it removed, with the pods it added (a removed pod added back holds what it held; a
  pod nominated to the node but not placed yet is placed first, as ``decide`` would place it,
  and takes nothing if it does not fit).
- ``preemptible_nodes``: the nodes where a pod does not fit now but would with every pod of a
  strictly lower priority on them gone, for all of them at once (their devices come from the
  state's ``DeviceLedger``, not from a loop over pods). A victim's MIG placement goes with it,
  so a larger profile may fit where small instances blocked every legal placement.
- ``select_victims``/``pick_node``: kube-scheduler's ``SelectVictimsOnNode`` and
  ``pickOneNodeForPreemption`` (DefaultPreemption, Kubernetes 1.36) over these what-ifs, for
  ``tessera simulate``: a pod fits once its victims are gone where the what-if finds room on
  the GPUs and NodeResourcesFit on the node's CPU and memory (``rules.host_reasons``, the
  victims' requests gone), as in kube-scheduler's dry run. PodDisruptionBudgets are not
  modelled (kube-scheduler tries to reprieve the victims that would violate one first, and
  prefers nodes with fewer such victims), nor is the node's pod count.

The what-ifs themselves (``what_if``, ``preemptible_nodes``) look at GPUs only: in the live
scheduler's dry runs kube-scheduler's NodeResourcesFit weighs CPU and memory itself.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from api.errors import TesseraError
from api.hami.register import GpuDevice
from scheduler_plugins.core.decide import feasible_on, plan_on
from scheduler_plugins.core.explain import node_explanation
from scheduler_plugins.core.requests import PodAllocation, PodRequest
from scheduler_plugins.core.rules import HostAmounts, Reason, host_reasons
from scheduler_plugins.core.state import (
    GPU_COLUMNS,
    USAGE_COLUMNS,
    ClusterState,
    Geometry,
    GpuArrays,
    Layout,
    count_devices,
    count_usage,
    device_usage,
)

I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]

_MAX_KEPT_VIEWS: Final = 256  # one node's view layout kept per node, for the shim's dry runs


class UnknownNode(TesseraError):
    """The node is not in the cluster state (not registered yet, or gone): there is nothing to
    evaluate the pod on."""


@dataclass(frozen=True)
class WhatIf:
    """A pod on one node in a what-if: whether it fits and, where not, why (``Reason`` bits,
    and the node's clause as ``explain`` words it)."""

    fits: bool
    reasons: int = 0
    message: str = ""


class NodeView:
    """Some nodes' GPU rows, copied where pods change them: a ``GpuSource`` of its own, rows
    numbered from 0 in the nodes' order, with its own ``Layout``. Pods are counted in it or
    taken out of it (``count``); the state is never touched."""

    def __init__(self, state: ClusterState, layout: Layout, gpus: GpuArrays) -> None:
        self.state = state
        self.layout = layout
        self.gpus = gpus

    @property
    def geometries(self) -> list[Geometry]:
        return self.state.geometries

    @property
    def types(self) -> list[str]:
        return self.state.types

    @staticmethod
    def of(state: ClusterState, segs: I64) -> NodeView:
        """The view of segments ``segs`` (ascending) of the state's layout."""
        full = state.layout()
        counts = full.gpu_count[segs]
        starts = full.starts[segs]
        first = np.cumsum(counts) - counts
        names = tuple(full.names[s] for s in segs.tolist())
        g = state.gpus
        if segs.size == 1:  # one node's rows are consecutive: view what pods never change
            at = slice(int(starts[0]), int(starts[0] + counts[0]))
            columns = {
                name: getattr(g, name)[at].copy() if name in USAGE_COLUMNS else getattr(g, name)[at]
                for name in GPU_COLUMNS
            }
        else:
            rows = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))
            columns = {name: getattr(g, name)[rows] for name in GPU_COLUMNS}
        rows_of = _Rows(GpuArrays(**columns), state.geometries, state.types)
        if segs.size == 1:
            layout = _kept_layout(full, int(segs[0]), rows_of, first, counts)
        else:
            layout = _layout(rows_of, full, segs, names, first, counts)
        return NodeView(state, layout, rows_of.gpus)

    def rows_of(self, node: str) -> dict[str, int]:
        """``node``'s GPU UUIDs -> rows of the view."""
        first = int(self.layout.starts[self.layout.seg_index[node]])
        return {d.id: first + i for i, d in enumerate(self._devices(node))}

    def _devices(self, node: str) -> tuple[GpuDevice, ...]:
        return self.state.nodes[node].devices

    def uuid_rows(self) -> dict[str, list[int]]:
        """Every GPU UUID's rows in the view (for the pods' UUID selectors)."""
        out: dict[str, list[int]] = {}
        for node in self.layout.names:
            for uuid, r in self.rows_of(node).items():
                out.setdefault(uuid, []).append(r)
        return out

    def mig_masks(self, node: str) -> list[int]:
        """``node``'s GPUs' MIG occupancy in the view, in device order."""
        first = int(self.layout.starts[self.layout.seg_index[node]])
        n = len(self._devices(node))
        return [int(m) for m in self.gpus.mig_mask[first : first + n]]

    def count(self, alloc: PodAllocation, sign: int) -> None:
        """Count (``sign`` +1) or take out (-1) what ``alloc`` holds on its node."""
        count_devices(self.gpus, device_usage(self, self.rows_of(alloc.node), alloc), sign)

    def place(self, request: PodRequest, node: str) -> PodAllocation | None:
        """Place ``request`` on ``node`` as ``decide`` would and count it; None (nothing
        counted) where it does not fit."""
        plan = plan_on(self, self.state, self.layout, request, node, uuid_rows=self.uuid_rows)
        if plan is None:
            return None
        alloc = plan.allocation(
            request.cpu_milli, request.memory_bytes, uid=request.uid, priority=request.priority
        )
        self.count(alloc, +1)
        return alloc

    def verdict(self, request: PodRequest, node: str) -> WhatIf:
        """``request`` on ``node`` as the view stands."""
        feasible, why = feasible_on(
            self, self.state, self.layout, request, uuid_rows=self.uuid_rows, reasons=True
        )
        s = self.layout.seg_index[node]
        if feasible[s]:
            return WhatIf(True)
        assert why is not None
        bits = int(why[s])
        message = node_explanation(self.state, node, bits, self.mig_masks(node))
        return WhatIf(False, bits, message)


@dataclass(frozen=True)
class _Rows:
    """A view's rows before it has a layout (what ``Layout.build`` reads)."""

    gpus: GpuArrays
    geometries: list[Geometry]
    types: list[str]


def _layout(
    rows: _Rows, full: Layout, segs: I64, names: tuple[str, ...], first: I64, counts: I64
) -> Layout:
    return Layout.build(
        -1,  # never the state's version: nothing keeps work of the state's layout in it
        rows,
        int(counts.sum()),
        names=names,
        node_idx=full.node_idx[segs],
        starts=first,
        counts=counts,
        gpu_less=(),
    )


def _kept_layout(full: Layout, s: int, rows: _Rows, first: I64, counts: I64) -> Layout:
    """The view layout of segment ``s`` alone: it depends on the state's layout only (which
    GPUs, their capacities, modes and geometries), so it is kept with it for the next dry run
    on that node."""
    owned = full.scratch.acquire()
    try:
        kept: dict[int, Layout] | None = full.scratch.memo.get("whatif_layouts") if owned else None
        layout = kept.get(s) if kept is not None else None
        if layout is None:
            layout = _layout(rows, full, np.array([s], np.int64), (full.names[s],), first, counts)
            if owned:
                if kept is None or len(kept) >= _MAX_KEPT_VIEWS:
                    kept = full.scratch.memo["whatif_layouts"] = {}
                kept[s] = layout
        return layout
    finally:
        if owned:
            full.scratch.release()


def what_if(
    state: ClusterState,
    request: PodRequest,
    node: str,
    *,
    removed: Collection[str] = (),
    added: Sequence[PodAllocation | PodRequest] = (),
) -> WhatIf:
    """``request`` on ``node`` with the pods ``removed`` (pod keys) gone and ``added`` placed
    besides the ones there, in order: an allocation is counted as it is (a removed pod added
    back holds what it held), a request is placed as ``decide`` would place it (a pod
    nominated to the node, not placed yet) and takes nothing where it does not fit. Pods
    being preempted already belong in ``removed`` (the caller's ``leaving``): they are going
    whatever the dry run does."""
    entry = state.nodes.get(node)
    if entry is None:
        raise UnknownNode(
            f"node {node!r} is not in the cluster state (not registered yet, or gone)"
        )
    if not request.containers:
        return WhatIf(True)
    if not entry.devices:
        bits = int(Reason.NO_GPU)
        return WhatIf(False, bits, node_explanation(state, node, bits))
    layout = state.layout()
    view = NodeView.of(state, np.array([layout.seg_index[node]], np.int64))
    if removed:
        for alloc in state.pods_on(node):
            if alloc.key in removed:
                view.count(alloc, -1)
    for pod in added:
        if isinstance(pod, PodAllocation):
            view.count(pod, +1)
        else:
            view.place(pod, node)
    return view.verdict(request, node)


def preemptible_nodes(
    state: ClusterState, request: PodRequest, feasible: B, leaving: Collection[str] = ()
) -> list[str]:
    """The nodes of the state's layout that do not fit ``request`` now (``feasible``: its
    verdicts on that layout) but would if every pod of a priority below the request's on them
    were gone, and the pods ``leaving`` (being preempted already) too; only nodes holding such
    a pod (with devices: a pod without any frees nothing) are looked at. In layout order."""
    ledger = state.ledger
    lowest = ledger.lowest_priority()
    gone = state.ledger_entries(leaving)
    if not request.containers or lowest is None or (lowest >= request.priority and not gone):
        return []
    layout = state.layout()
    if not layout.names:
        return []
    slots = ledger.below(request.priority)
    if gone:
        slots = np.union1d(slots, np.array(gone, np.int64))
    node_idx = ledger.node[slots].astype(np.int64)
    seg_of_idx = np.full(int(max(layout.node_idx.max(), node_idx.max())) + 1, -1, np.int64)
    seg_of_idx[layout.node_idx] = np.arange(len(layout.names))
    seg = seg_of_idx[node_idx]
    keep = seg >= 0
    keep[keep] = ~feasible[seg[keep]]
    seg = seg[keep]
    looked_at = np.bincount(seg, minlength=len(layout.names)) > 0
    segs = np.flatnonzero(looked_at)
    if not segs.size:
        return []
    view = NodeView.of(state, segs)
    # Each victim device's row in the view: its node's first row there plus its position.
    pos = (np.cumsum(looked_at) - 1)[seg]
    taken = slots[keep]
    rows = view.layout.starts[pos] + ledger.col[taken]
    count_usage(view.gpus, ledger.usage(taken, rows), -1)
    fits, _ = feasible_on(view, state, view.layout, request, uuid_rows=view.uuid_rows)
    return [view.layout.names[int(i)] for i in np.flatnonzero(fits)]


def host_preemptible(
    state: ClusterState, request: PodRequest, gpus_fit: B, feasible: B
) -> list[str]:
    """The nodes of the state's layout whose GPUs fit ``request`` (``gpus_fit``) but whose CPU
    or memory do not (``feasible``), holding a pod of a priority below the request's: whether
    preempting some makes room is kube-scheduler's dry run's to tell (its NodeResourcesFit
    weighs CPU and memory there). In layout order."""
    layout = state.layout()
    out = []
    for s in np.flatnonzero(gpus_fit & ~feasible).tolist():
        name = layout.names[s]
        if any(a.priority < request.priority for a in state.pods_on(name)):
            out.append(name)
    return out


# ----- kube-scheduler's choice of victims (DefaultPreemption), for ``tessera simulate`` -----------


@dataclass(frozen=True)
class Candidate:
    """A pod on a node as kube-scheduler's preemption weighs it: its priority and when it
    started (seconds; ``math.inf`` when it has not: kube-scheduler takes "now" for those)."""

    key: str
    priority: int
    start: float = math.inf


@dataclass(frozen=True)
class Victims:
    """The pods kube-scheduler would preempt on ``node`` for a pod, most important first."""

    node: str
    pods: tuple[Candidate, ...]


def _more_important_first(c: Candidate) -> tuple[int, float]:
    """kube-scheduler's ``MoreImportantPod`` as a sort key: higher priority, then earlier
    start."""
    return (-c.priority, c.start)


def select_victims(
    state: ClusterState, request: PodRequest, node: str, pods: Sequence[Candidate]
) -> Victims | None:
    """kube-scheduler's ``SelectVictimsOnNode`` for ``request`` on ``node`` (``pods``: the pods
    there): remove every pod of a lower priority; if the pod fits then, add them back one by
    one, the most important first, keeping back those without which it would not fit. None
    where removing them all is not enough (or there is none)."""
    potential = [c for c in pods if c.priority < request.priority]
    if not potential:
        return None
    gone = {c.key for c in potential}
    if not _fits_without(state, request, node, gone):
        return None
    victims: list[Candidate] = []
    for c in sorted(potential, key=_more_important_first):
        gone.discard(c.key)
        if not _fits_without(state, request, node, gone):
            gone.add(c.key)
            victims.append(c)
    return Victims(node, tuple(victims)) if victims else None


def _fits_without(state: ClusterState, request: PodRequest, node: str, gone: set[str]) -> bool:
    """Whether ``request`` fits ``node`` with the pods ``gone`` gone, as kube-scheduler's dry
    run filters it: on the GPUs (``what_if``) and on the node's CPU and memory."""
    if not what_if(state, request, node, removed=gone).fits:
        return False
    if request.cpu_milli <= 0 and request.memory_bytes <= 0:
        return True
    entry = state.nodes[node]
    freed = [a for a in state.pods_on(node) if a.key in gone]
    cpu = state.node_cpu_req[entry.idx] - sum(a.cpu_milli for a in freed)
    memory = state.node_mem_req[entry.idx] - sum(a.memory_bytes for a in freed)
    bits = host_reasons(
        HostAmounts(
            np.array([entry.cpu_milli], np.float64), np.array([entry.memory_bytes], np.float64)
        ),
        HostAmounts(np.array([cpu], np.float64), np.array([memory], np.float64)),
        request.cpu_milli,
        request.memory_bytes,
    )
    return not bits[0]


def pick_node(candidates: Sequence[Victims]) -> Victims | None:
    """kube-scheduler's ``pickOneNodeForPreemption``: the node whose victims' highest
    priority is lowest, then the smallest sum of priorities, then the fewest victims, then
    the latest start among the victims of the highest priority; ties beyond go to the first
    (kube-scheduler's order of candidates is its own; here the caller's). No PDBs: the
    first key (fewest PodDisruptionBudget violations) ties everywhere."""
    best: Victims | None = None
    best_key: tuple[float, ...] | None = None
    for c in candidates:
        if not c.pods:
            continue
        top = max(v.priority for v in c.pods)
        key = (
            top,
            sum(v.priority + 2**31 for v in c.pods),  # kube-scheduler's offset keeps them >= 0
            len(c.pods),
            -min(v.start for v in c.pods if v.priority == top),
        )
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


__all__ = [
    "Candidate",
    "NodeView",
    "UnknownNode",
    "Victims",
    "WhatIf",
    "host_preemptible",
    "pick_node",
    "preemptible_nodes",
    "select_victims",
    "what_if",
]
