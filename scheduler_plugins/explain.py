"""Why a pod cannot be placed: one message grouping nodes by class and reason.

A node class is the node's GPU inventory (count × type, mode). For MIG fragmentation the
message lists the free slice intervals of the affected GPUs, so an operator can see that
capacity exists but not contiguously.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from scheduler_plugins.decide import Decision, Reason, reason_names
from scheduler_plugins.state import ClusterState

_MAX_NODES_LISTED = 3
_MAX_GPUS_LISTED = 4


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
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    for i in np.flatnonzero(~decision.feasible).tolist():
        name = layout.names[i]
        groups[(node_class(state, name), int(decision.reasons[i]))].append(name)
    for name in layout.gpu_less:
        groups[("no GPUs", int(Reason.NO_GPU))].append(name)
    clauses: list[str] = []
    for (cls, bits), names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names.sort()
        what = "; ".join(reason_names(bits)) or "does not fit"
        clause = f"{len(names)} node{'s' if len(names) != 1 else ''} [{cls}]: {what}"
        if bits & Reason.MIG_FRAGMENTATION:
            clause += " — " + _free_intervals(state, names[:_MAX_NODES_LISTED])
        elif len(names) <= _MAX_NODES_LISTED:
            clause += f" ({', '.join(names)})"
        clauses.append(clause)
    feasible = decision.feasible_count()
    head = f"{feasible}/{total} nodes are available"
    return head + (": " + "; ".join(clauses) if clauses else "")


def node_reasons(explanation: str) -> str:
    """An ``explain`` text without its count header: what a rejected node's Filter status
    says (kube-scheduler prefixes its own "0/N nodes are available" and node counts)."""
    _, _, clauses = explanation.partition(": ")
    return f"Tessera: {clauses}" if clauses else "Tessera: does not fit"


def _free_intervals(state: ClusterState, nodes: list[str]) -> str:
    parts: list[str] = []
    g = state.gpus
    for node in nodes:
        entry = state.nodes[node]
        gpus: list[str] = []
        for d in entry.devices[:_MAX_GPUS_LISTED]:
            r = entry.rows[d.id]
            gid = int(g.geom[r])
            if not g.is_mig[r] or gid < 0:
                continue
            table = state.geometries[gid].table
            free = table.free_intervals(int(g.mig_mask[r]))
            text = " ".join(f"[{a},{b})" for a, b in free) or "none"
            gpus.append(f"GPU {d.index} free slices {text}")
        parts.append(f"{node}: {', '.join(gpus)}")
    return "; ".join(parts)
