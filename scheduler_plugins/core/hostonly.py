"""Where the fragmentation policy puts a pod that asks for no GPU.

Such a pod strands GPU capacity only by the CPU and memory it takes from a GPU node: on a node
without GPUs it strands none. So, best first:

1. nodes without GPUs where its CPU and memory fit, in kube-scheduler's default order among
   them (``hostfit``: least allocated plus balanced allocation, then the name);
2. GPU nodes where they fit, by the fragmentation rule (``decide``: what the pod does to the
   GPU capacity the workload could not use there, ``ranking``'s order).

Tessera's score (what kube-scheduler adds to its own plugins' scores) is ``MAX_SCORE`` on a
node without GPUs, the fragmentation score (``ranking.Preference.kube_scores``) on a GPU node.
A pod that leaves the node to Tessera is offered the best node alone, as a GPU pod under this
policy is (``ranking.candidates``). Under binpack or spread, Tessera leaves such a pod to
kube-scheduler: HAMi places only GPU pods.

The plugin server answers with it (``reservations.Reservations.offer``), ``tessera simulate``
places with it, and the trace-replay benchmark scores CPU-only pods with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_plugins.core import hostfit, ranking
from scheduler_plugins.core.decide import Decision, decide
from scheduler_plugins.core.requests import PodRequest
from scheduler_plugins.core.state import ClusterState

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class HostOnlyPlacement:
    """Every node where the pod fits, best first (``names``), with Tessera's 0..100 score of
    each (``scores``). ``gpu_less``: how many of the first names have no GPU. ``decision``:
    the GPU nodes' verdicts (why a GPU node scored as it did); ``bare``: kube-scheduler's view
    of the nodes without GPUs (why none of them fits)."""

    names: tuple[str, ...]
    scores: tuple[int, ...]
    gpu_less: int
    decision: Decision
    bare: hostfit.HostPlacement

    def best(self) -> str | None:
        return self.names[0] if self.names else None

    def offered(self, limit: int) -> tuple[list[str], list[int]]:
        """The nodes to offer kube-scheduler and their scores: the best alone when the pod
        leaves the node to Tessera (``limit`` > 0), else every node that fits."""
        n = min(1, len(self.names)) if limit else len(self.names)
        return list(self.names[:n]), list(self.scores[:n])


def wants_placing(req: PodRequest) -> bool:
    """Whether Tessera places ``req``: a GPU request always, a pod without one under the
    fragmentation policy only."""
    return req.wants_gpu or req.fragmentation


def place_host_only(state: ClusterState, req: PodRequest) -> HostOnlyPlacement:
    """``HostOnlyPlacement`` of ``req`` (a pod without a GPU request) on ``state``."""
    if req.wants_gpu:
        raise ValueError(f"pod {req.key} asks for a GPU: decide() places it")
    decision = decide(state, req)
    bare = hostfit.place(state, req.cpu_milli, req.memory_bytes, decision.layout.gpu_less)
    fits = np.flatnonzero(bare.fits)
    total = bare.least[fits] + bare.balanced[fits]
    bare_names = [bare.names[i] for i in fits.tolist()]
    # Highest score first, then the name (kube-scheduler breaks exact ties at random).
    bare_order = sorted(range(len(bare_names)), key=lambda j: (-int(total[j]), bare_names[j]))
    segs = ranking.order(
        np.flatnonzero(decision.feasible),
        decision.score,
        decision.preference,
        decision.layout.name_rank,
    )
    gpu_scores: I64 = decision.preference.kube_scores(decision.score[segs])
    names = tuple(bare_names[j] for j in bare_order) + tuple(
        str(decision.layout.names[s]) for s in segs.tolist()
    )
    scores = (ranking.MAX_SCORE,) * len(bare_names) + tuple(int(s) for s in gpu_scores.tolist())
    return HostOnlyPlacement(names, scores, len(bare_names), decision, bare)


__all__ = ["HostOnlyPlacement", "place_host_only", "wants_placing"]
