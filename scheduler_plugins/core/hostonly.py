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
from scheduler_plugins.core.requests import PodAllocation, PodRequest
from scheduler_plugins.core.state import ClusterState

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class HostOnlyPlacement:
    """The nodes where the pod fits, best first (``names``), with Tessera's 0..100 score of
    each (``scores``); ``fitting``: how many nodes fit in all (more than ``names`` when the
    GPU nodes were not ranked: a node without GPUs had room and only the best was asked
    for). ``gpu_less``: how many of the first names have no GPU. ``decision``: the GPU
    nodes' verdicts when they were ranked (why a GPU node scored as it did); ``bare``:
    kube-scheduler's view of the nodes without GPUs (why none of them fits)."""

    names: tuple[str, ...]
    scores: tuple[int, ...]
    fitting: int
    gpu_less: int
    decision: Decision | None
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


def allocation(req: PodRequest, node: str) -> PodAllocation:
    """What a pod without a GPU request holds on ``node``: its CPU and memory."""
    return PodAllocation(
        req.key, node, (), (), req.cpu_milli, req.memory_bytes, uid=req.uid, priority=req.priority
    )


def place_host_only(
    state: ClusterState, req: PodRequest, *, every: bool = True
) -> HostOnlyPlacement:
    """``HostOnlyPlacement`` of ``req`` (a pod without a GPU request) on ``state``. Without
    ``every`` (only the best node is wanted), the GPU nodes are ranked only when no node
    without GPUs has room: ranking them is a whole fragmentation decision."""
    if req.wants_gpu:
        raise ValueError(f"pod {req.key} asks for a GPU: decide() places it")
    layout = state.layout()
    bare = hostfit.place(state, req.cpu_milli, req.memory_bytes, layout.gpu_less)
    fits = np.flatnonzero(bare.fits)
    total = bare.least[fits] + bare.balanced[fits]
    bare_names = [bare.names[i] for i in fits.tolist()]
    # Highest score first, then the name (kube-scheduler breaks exact ties at random).
    names = tuple(
        bare_names[j]
        for j in sorted(range(len(bare_names)), key=lambda j: (-int(total[j]), bare_names[j]))
    )
    scores = (ranking.MAX_SCORE,) * len(names)
    if bare_names and not every:
        # asked without a decision: count it as ``decide`` would (the policy's ties follow
        # who places the pods without GPUs)
        state.kinds.host_only_asks()
        on_gpu_nodes = hostfit.place(state, req.cpu_milli, req.memory_bytes, layout.names)
        fitting = len(names) + int(np.count_nonzero(on_gpu_nodes.fits))
        return HostOnlyPlacement(names, scores, fitting, len(names), None, bare)
    decision = decide(state, req)
    segs = ranking.order(
        np.flatnonzero(decision.feasible),
        decision.score,
        decision.preference,
        decision.layout.name_rank,
    )
    gpu_scores: I64 = decision.preference.kube_scores(decision.score[segs])
    names += tuple(str(decision.layout.names[s]) for s in segs.tolist())
    scores += tuple(int(s) for s in gpu_scores.tolist())
    return HostOnlyPlacement(names, scores, len(names), len(bare_names), decision, bare)


__all__ = ["HostOnlyPlacement", "allocation", "place_host_only", "wants_placing"]
