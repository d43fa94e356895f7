"""How nodes rank for a pod: the one order the live scheduler, ``tessera simulate`` and the
benchmarks share.

- *Desirability*: the node score (``rules.node_score``, usage before the pod) signed by the
  pod's node policy: binpack prefers the fullest node, spread the emptiest.
- *Tessera's score* (what kube-scheduler adds to its own plugins' scores): the same preference
  on an absolute 0..100 scale, binpack ``100 × score / max`` and spread
  ``100 × (1 − score / max)``, rounded. Never stretched per cycle: a node's score depends on
  that node alone, so it sums honestly with kube-scheduler's other score plugins (the profile
  weighs Tessera ``SCORE_WEIGHT``).
- Under the fragmentation policy the node score is that policy's own
  (``fragmentation.node_score``: what placing the pod does to the node's fragmentation, and
  how full the node is), higher is better: the desirability is the score, Tessera's score
  ``100 × score / max``, rounded down.
- *Order*: Tessera's score, then the desirability (finer than the rounded score), then the
  node name. ``best`` is the first; kube-scheduler, given the same scores, takes a node of the
  top score (exact ties at random) unless its other plugins prefer another.
- *Candidates*: the nodes handed to kube-scheduler. A pod that leaves the choice to Tessera
  (the shim's candidate limit: no node selector, affinity or topology spread of its own) is
  offered the best nodes where it would wait at PreBind behind the fewest pods its node agent
  could not tell apart from it (none, wherever such a node fits), so a burst spreads over node
  agents instead of queueing behind one; if kube-scheduler's other plugins reject them all,
  the shim asks again for every feasible node. Any other pod is offered every feasible node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from api.hami.policy import Policy

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]

MAX_SCORE: Final = 100
"""kube-scheduler's ``MaxNodeScore``: every score plugin answers 0..100."""

SCORE_WEIGHT: Final = 5
"""Tessera's weight in the scheduler profile (``examples/scheduler-config.yaml``, the chart).
kube-scheduler's own score plugins weigh 1 to 3, and a pod's preferred node affinity or
topology spread gives the preferred node up to 2 × 100 more: with 5, those win between nodes
whose Tessera scores differ by less than 40, and Tessera's preference wins beyond."""

# Sums of the same usage in another order differ in their last bits: closer than this, two
# desirabilities are the same and the node name decides.
_RESOLUTION: Final = 9  # decimals


@dataclass(frozen=True)
class Preference:
    """How one pod ranks nodes: its node policy, over node scores of 0..``score_max``."""

    policy: Policy
    score_max: float

    def desirability(self, score: F64) -> F64:
        """Higher is better."""
        return score * self.policy.sign

    def kube_scores(self, score: F64) -> I64:
        """Tessera's 0..100 score of each node."""
        share = np.clip(score / self.score_max, 0.0, 1.0)
        if self.policy is Policy.FRAGMENTATION:  # higher is better already
            return np.floor(share * MAX_SCORE).astype(np.int64)
        if self.policy is Policy.SPREAD:
            share = 1.0 - share
        return np.rint(share * MAX_SCORE).astype(np.int64)


def order(segments: I64, score: F64, pref: Preference, name_rank: I64) -> I64:
    """``segments`` best first: by Tessera's score, the desirability, the node name."""
    s = score[segments]
    keys = (name_rank[segments], -_fine(pref.desirability(s)), -pref.kube_scores(s))
    return segments[np.lexsort(keys)]


def best(feasible: B, score: F64, pref: Preference, name_rank: I64) -> int:
    """The best feasible node (``order``'s first, without sorting them all); -1 if none.

    Tessera's score rises with the desirability, so the best node is among those of the
    highest desirability; only ties need the full key."""
    segs = np.flatnonzero(feasible)
    if not segs.size:
        return -1
    des = pref.desirability(score[segs])
    near = segs[des >= des.max() - 2 * 10.0**-_RESOLUTION]
    if near.size == 1:
        return int(near[0])
    return int(order(near, score, pref, name_rank)[0])


def candidates(
    segments: I64,
    score: F64,
    pref: Preference,
    name_rank: I64,
    waits: I64 | None,
    limit: int,
) -> I64:
    """The nodes of ``segments`` to offer, best first: all of them when ``limit`` is 0, else at
    most ``limit`` among those with the fewest ``waits`` (per segment: the pods the pod would
    wait behind at PreBind; None: none anywhere). Under the fragmentation policy a limit
    offers the best node alone: kube-scheduler's own scores (LeastAllocated spreads) would
    otherwise choose among nodes of equal Tessera score, which that policy orders by the
    fraction rounding takes away."""
    ranked = order(segments, score, pref, name_rank)
    if not limit:
        return ranked
    if pref.policy is Policy.FRAGMENTATION:
        limit = 1
    if waits is not None and ranked.size:
        w = waits[ranked]
        ranked = ranked[w == w.min()]
    return ranked[:limit]


def _fine(desirability: F64) -> F64:
    return np.round(desirability, _RESOLUTION)


__all__ = ["MAX_SCORE", "SCORE_WEIGHT", "Preference", "best", "candidates", "order"]
