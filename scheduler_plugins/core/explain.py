"""Why a pod cannot be placed: one message grouping nodes by class and reason (for a pod Tessera
does not place, kube-scheduler's reasons: ``explain_host``).

A node class is the node's GPU inventory (count × type, mode). For MIG fragmentation the
message lists the free slice intervals of the affected GPUs, so an operator can see that
capacity exists but not contiguously.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from scheduler_plugins.core.decide import Decision
from scheduler_plugins.core.hostfit import HostPlacement
from scheduler_plugins.core.rules import Reason, reason_names
from scheduler_plugins.core.state import ClusterState, Layout

_MAX_NODES_LISTED = 3
_MAX_GPUS_LISTED = 4
# A (class, reasons) group as one integer: class << this | reasons. The highest bit, not the
# count of reasons: a retired reason leaves its bit unused.
_REASON_BITS = max(int(r) for r in Reason).bit_length()


def node_class(state: ClusterState, node: str) -> str:
    entry = state.nodes.get(node)
    if entry is None or not entry.devices:
        return "no GPUs"
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for d in entry.devices:
        counts[(d.type or "unknown", d.mode)] += 1
    return ", ".join(f"{n}× {t} ({m})" for (t, m), n in sorted(counts.items()))


def explain(decision: Decision, state: ClusterState) -> str:
    """'0/N nodes are available: …' with one clause per (class, reasons) group."""
    layout = decision.layout
    total = len(layout.names) + len(layout.gpu_less)
    groups: list[tuple[str, int, int, list[str]]] = []  # class, reasons, nodes, first names
    infeasible = np.flatnonzero(~decision.feasible)
    if infeasible.size:
        classes, class_of = _classes(state, layout)
        key = (class_of[infeasible] << _REASON_BITS) | decision.reasons[infeasible]
        # Nodes by group, each group's by name: the first few names of a group are its first.
        rank = layout.name_rank[infeasible]
        order = np.lexsort((rank, key))
        keys, starts, counts = np.unique(key[order], return_index=True, return_counts=True)
        for k, first, count in zip(keys.tolist(), starts.tolist(), counts.tolist(), strict=True):
            listed = order[first : first + min(count, _MAX_NODES_LISTED)]
            names = [layout.names[int(i)] for i in infeasible[listed]]
            groups.append((classes[k >> _REASON_BITS], k & ((1 << _REASON_BITS) - 1), count, names))
    if layout.gpu_less:
        names = sorted(layout.gpu_less)
        groups.append(("no GPUs", int(Reason.NO_GPU), len(names), names[:_MAX_NODES_LISTED]))
    clauses = [
        _clause(state, cls, bits, count, names)
        for cls, bits, count, names in sorted(groups, key=lambda g: (-g[2], g[0], g[1]))
    ]
    feasible = decision.feasible_count()
    head = f"{feasible}/{total} nodes are available"
    return head + (": " + "; ".join(clauses) if clauses else "")


def explain_host(placement: HostPlacement, state: ClusterState) -> str:
    """``explain``'s message for a pod Tessera does not place, from kube-scheduler's verdicts
    on its CPU and memory (``hostfit.place``): '0/N nodes are available: …'."""
    names: dict[tuple[str, int], list[str]] = defaultdict(list)
    for i in np.flatnonzero(~placement.fits).tolist():
        node = placement.names[i]
        names[(node_class(state, node), int(placement.reasons[i]))].append(node)
    groups = sorted(names.items(), key=lambda g: (-len(g[1]), g[0][0], g[0][1]))
    clauses = [
        _clause(state, cls, bits, len(nodes), sorted(nodes)[:_MAX_NODES_LISTED])
        for (cls, bits), nodes in groups
    ]
    head = f"{int(np.count_nonzero(placement.fits))}/{len(placement.names)} nodes are available"
    return head + (": " + "; ".join(clauses) if clauses else "")


def node_explanation(
    state: ClusterState, node: str, bits: int, mig_masks: Sequence[int] | None = None
) -> str:
    """Why ``node`` does not take a pod (``bits``: its ``Reason``s), worded as ``explain``
    words its clause and prefixed as ``node_reasons`` (what a rejected node's Filter status
    says); ``mig_masks``: its GPUs' MIG occupancy in device order, when it is not the state's
    (a what-if's)."""
    masks = {node: mig_masks} if mig_masks is not None else None
    return "Tessera: " + _clause(state, node_class(state, node), bits, 1, [node], masks)


def _clause(
    state: ClusterState,
    cls: str,
    bits: int,
    count: int,
    names: list[str],
    mig_masks: Mapping[str, Sequence[int]] | None = None,
) -> str:
    """One (class, reasons) group of ``count`` nodes, ``names`` the first of them."""
    what = "; ".join(reason_names(bits)) or "does not fit"
    clause = f"{count} node{'s' if count != 1 else ''} [{cls}]: {what}"
    if bits & Reason.MIG_FRAGMENTATION:
        clause += " — " + _free_intervals(state, names, mig_masks)
    elif count <= _MAX_NODES_LISTED:
        clause += f" ({', '.join(names)})"
    return clause


def rejection_reasons(decision: Decision) -> int:
    """``Reason`` bits of every kind that rejected at least one node (GPU-less nodes too)."""
    rejected = decision.reasons[~decision.feasible]
    bits = int(np.bitwise_or.reduce(rejected, initial=0))
    if decision.layout.gpu_less:
        bits |= Reason.NO_GPU
    return bits


def node_reasons(explanation: str) -> str:
    """An ``explain`` text without its count header: what a rejected node's Filter status
    says (kube-scheduler prefixes its own "0/N nodes are available" and node counts)."""
    _, _, clauses = explanation.partition(": ")
    return f"Tessera: {clauses}" if clauses else "Tessera: does not fit"


def _classes(state: ClusterState, layout: Layout) -> tuple[list[str], npt.NDArray[np.int64]]:
    """The node classes of the layout and each segment's (index into them). A node's devices
    change only with a new layout: kept with the current layout (when its scratch is free)."""
    owned = layout.version == state.layout_version and layout.scratch.acquire()
    try:
        kept: tuple[list[str], npt.NDArray[np.int64]] | None = (
            layout.scratch.memo.get("node_classes") if owned else None
        )
        if kept is None:
            ids: dict[str, int] = {}
            class_of = np.array(
                [ids.setdefault(node_class(state, name), len(ids)) for name in layout.names],
                np.int64,
            )
            kept = (list(ids), class_of)
            if owned:
                layout.scratch.memo["node_classes"] = kept
        return kept
    finally:
        if owned:
            layout.scratch.release()


def _free_intervals(
    state: ClusterState, nodes: list[str], mig_masks: Mapping[str, Sequence[int]] | None = None
) -> str:
    """The free MIG slices of the nodes' first GPUs (``mig_masks``: their occupancy in device
    order, where it is not the state's)."""
    parts: list[str] = []
    g = state.gpus
    for node in nodes:
        entry = state.nodes[node]
        gpus: list[str] = []
        masks = mig_masks.get(node) if mig_masks is not None else None
        for i, d in enumerate(entry.devices[:_MAX_GPUS_LISTED]):
            r = entry.rows[d.id]
            gid = int(g.geom[r])
            if not g.is_mig[r] or gid < 0:
                continue
            table = state.geometries[gid].table
            free = table.free_intervals(int(g.mig_mask[r] if masks is None else masks[i]))
            text = " ".join(f"[{a},{b})" for a, b in free) or "none"
            gpus.append(f"GPU {d.index} free slices {text}")
        parts.append(f"{node}: {', '.join(gpus)}")
    return "; ".join(parts)
