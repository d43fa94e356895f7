"""Where kube-scheduler's default profile puts a pod Tessera does not place (no GPU request):
the nodes that have its CPU and memory (``rules.host_reasons``, NodeResourcesFit's filter),
scored by its two resource score plugins, weight 1 each, as Kubernetes 1.36 has them:

- NodeResourcesFit, strategy ``LeastAllocated`` (``least_allocated``): per resource,
  ``(allocatable − requested) × 100 / allocatable`` with the pod counted, rounded down; their
  mean, rounded down.
- NodeResourcesBalancedAllocation (``balanced_allocation``): how evenly the node's CPU and
  memory are requested, ``balance = (1 − |cpu share − memory share| / 2) × 100`` (shares
  capped at 1, rounded down), and how the pod changes it: ``50 + (50 + balance with the pod −
  balance without it) / 2``, rounded down. A pod that requests neither is not scored by it
  (0 everywhere).

A resource a node shows no allocatable of (0: unknown) is left out of both, as kube-scheduler
leaves it out. The node is the highest sum (``kube_scores``), ties to the first by name:
kube-scheduler breaks them at random.

Not modelled: kube-scheduler's other filters and scores (taints, node and pod affinity,
topology spread, image locality, the node's pod count, ephemeral storage, extended
resources), and LeastAllocated's defaults for containers that state no request (100m CPU,
200 MiB): here such a container requests nothing, on the node and in the pod.

Pure: numpy arrays in, numpy arrays out, over every node at once (the benchmarks reuse it);
``place`` reads them from the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_plugins.core.ranking import MAX_SCORE
from scheduler_plugins.core.rules import HostAmounts, host_reasons
from scheduler_plugins.core.state import ClusterState

I64 = npt.NDArray[np.int64]


def least_allocated(
    allocatable: HostAmounts, requested: HostAmounts, cpu_milli: int, memory_bytes: int
) -> I64:
    """NodeResourcesFit's ``LeastAllocated`` score of each node for a pod requesting
    ``cpu_milli`` and ``memory_bytes``, beside what the pods there request (``requested``):
    0..100, in integers as kube-scheduler computes it."""
    total = np.zeros(allocatable.cpu.shape, np.int64)
    weights = np.zeros(allocatable.cpu.shape, np.int64)
    for have, used, asked in (
        (allocatable.cpu, requested.cpu, cpu_milli),
        (allocatable.memory, requested.memory, memory_bytes),
    ):
        cap = have.astype(np.int64)
        after = used.astype(np.int64) + asked
        known = cap > 0
        free = np.where(known & (after <= cap), cap - after, 0)
        total += np.where(known, free * MAX_SCORE // np.maximum(cap, 1), 0)
        weights += known
    return np.where(weights > 0, total // np.maximum(weights, 1), 0)


def balanced_allocation(
    allocatable: HostAmounts, requested: HostAmounts, cpu_milli: int, memory_bytes: int
) -> I64:
    """NodeResourcesBalancedAllocation's score of each node for a pod requesting ``cpu_milli``
    and ``memory_bytes`` (0 everywhere for a pod that requests neither: kube-scheduler skips
    it), in kube-scheduler's arithmetic (float64 shares, integers out)."""
    n = allocatable.cpu.shape
    if cpu_milli <= 0 and memory_bytes <= 0:
        return np.zeros(n, np.int64)
    with_pod = _balance(allocatable, requested, cpu_milli, memory_bytes)
    without = _balance(allocatable, requested, 0, 0)
    return MAX_SCORE // 2 + (MAX_SCORE // 2 + with_pod - without) // 2


def _balance(allocatable: HostAmounts, requested: HostAmounts, cpu: int, memory: int) -> I64:
    """``(1 − std of the requested shares) × 100`` per node, rounded down; the std of two
    shares is half their difference, of one share 0."""
    cpu_known = allocatable.cpu > 0
    mem_known = allocatable.memory > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        cpu_share = np.minimum((requested.cpu + cpu) / allocatable.cpu, 1.0)
        mem_share = np.minimum((requested.memory + memory) / allocatable.memory, 1.0)
    std = np.where(cpu_known & mem_known, np.abs((cpu_share - mem_share) / 2), 0.0)
    return ((1 - std) * MAX_SCORE).astype(np.int64)  # Go's int64(): toward zero


def kube_scores(
    allocatable: HostAmounts, requested: HostAmounts, cpu_milli: int, memory_bytes: int
) -> I64:
    """The sum of both scores per node (kube-scheduler's default weights: 1 and 1)."""
    return least_allocated(allocatable, requested, cpu_milli, memory_bytes) + balanced_allocation(
        allocatable, requested, cpu_milli, memory_bytes
    )


@dataclass(frozen=True)
class HostPlacement:
    """kube-scheduler's verdict on every node of the state (``names``, in the state's node
    order) for a pod Tessera does not place: ``reasons`` (``Reason`` bits; 0 where it fits),
    ``least``/``balanced`` its scores there."""

    names: tuple[str, ...]
    reasons: I64
    least: I64
    balanced: I64

    @property
    def fits(self) -> npt.NDArray[np.bool_]:
        fits: npt.NDArray[np.bool_] = self.reasons == 0
        return fits

    def best(self) -> int:
        """The index of the node kube-scheduler would take; -1 if none fits. Ties: the first
        name (kube-scheduler: at random)."""
        score = np.where(self.fits, self.least + self.balanced, -1)
        if not self.fits.any():
            return -1
        top = np.flatnonzero(score == score.max())
        return min(top.tolist(), key=self.names.__getitem__)


def place(
    state: ClusterState,
    cpu_milli: int,
    memory_bytes: int,
    names: Sequence[str] | None = None,
) -> HostPlacement:
    """``HostPlacement`` of a pod requesting ``cpu_milli`` and ``memory_bytes`` on the nodes
    ``names`` of ``state`` (None: every node, GPU nodes and GPU-less ones), counting what the
    pods there request."""
    if names is None:
        names = tuple(state.nodes)
    idx = np.array([state.nodes[n].idx for n in names], np.int64)
    allocatable = HostAmounts(state.node_cpu_alloc[idx], state.node_mem_alloc[idx])
    requested = HostAmounts(state.node_cpu_req[idx], state.node_mem_req[idx])
    return HostPlacement(
        names=tuple(names),
        reasons=host_reasons(allocatable, requested, cpu_milli, memory_bytes),
        least=least_allocated(allocatable, requested, cpu_milli, memory_bytes),
        balanced=balanced_allocation(allocatable, requested, cpu_milli, memory_bytes),
    )


__all__ = [
    "HostPlacement",
    "balanced_allocation",
    "kube_scores",
    "least_allocated",
    "place",
]
