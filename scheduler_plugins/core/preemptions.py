"""Preemptions of GPU pods as the watch sees them: which pods kube-scheduler preempted for which
pod, on which node, and which of that pod's needs they were blocking.

kube-scheduler writes nothing that names both sides: it sets a ``DisruptionTarget`` condition
(reason ``PreemptionByScheduler``) on each victim, then deletes it, and sets the preemptor's
``status.nominatedNodeName`` — in either order (its preemption runs asynchronously), all
within moments. ``PreemptionTracker`` pairs them by node and time: a victim goes to the pod
most recently nominated on its node with a higher priority, within ``window_s``; a victim seen
before its preemptor waits that long for it. A preemption is due once no victim joined it for
``settle_s`` (kube-scheduler preempts one pod's victims together).

What the victims were blocking (``blocking_needs``): the preemptor's reasons on that node with
every victim still there (a what-if adds back those already gone, and leaves out the preemptor
itself if it is reserved there by then), short of the reasons no preemption changes (GPU type,
mode, health...). Nothing left: the victims made room for kube-scheduler's own resources (CPU,
memory), not for anything Tessera counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from scheduler_plugins.core.requests import PodAllocation, PodRequest
from scheduler_plugins.core.rules import Reason, reason_names
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.core.whatif import what_if

# Each need a victim can block, as the ``reason`` label of ``tessera_preemptions_total``.
NEEDS: Final[tuple[tuple[Reason, str], ...]] = (
    (Reason.SLOTS, "slots"),
    (Reason.MEMORY, "memory"),
    (Reason.CORES, "cores"),
    (Reason.EXCLUSIVE, "exclusive"),
    (Reason.MUTEX, "mutex"),
    (Reason.MIG_CAPACITY | Reason.MIG_FRAGMENTATION, "mig_placement"),
    (Reason.TOO_FEW_FITTING, "gpus"),
    (Reason.NUMA, "numa"),
    (Reason.MIG_CONFLICT | Reason.MIG_LEGACY, "blocked"),
)
OTHER: Final = "other"  # nothing Tessera counts: kube-scheduler's own resources
NEED_LABELS: Final = (*(label for _, label in NEEDS), OTHER)
_USAGE: Final = int(sum((int(r) for r, _ in NEEDS), 0))  # the reasons a pod's removal can change

DEFAULT_SETTLE_S: Final = 2.0
DEFAULT_WINDOW_S: Final = 120.0


@dataclass(frozen=True)
class Victim:
    """A pod kube-scheduler is preempting, and what it held when the watch saw it marked."""

    key: str
    priority: int
    alloc: PodAllocation
    at: float

    @property
    def node(self) -> str:
        return self.alloc.node


@dataclass(frozen=True)
class Nominee:
    """A pod kube-scheduler nominated to ``node`` (its preemption made room there)."""

    key: str
    uid: str
    node: str
    request: PodRequest
    at: float


@dataclass(frozen=True)
class Preemption:
    """One preemption: the preemptor, its victims in the order seen, and the ``Reason`` bits
    of its needs they were blocking (``blocking_needs``; 0 until known)."""

    preemptor: Nominee
    victims: tuple[Victim, ...]
    blocking: int = 0

    @property
    def node(self) -> str:
        return self.preemptor.node

    def needs(self) -> list[str]:
        """The ``reason`` labels of what the victims blocked (``OTHER`` when nothing Tessera
        counts)."""
        return [label for reason, label in NEEDS if self.blocking & reason] or [OTHER]

    def describe(self) -> str:
        """The event's message: the victims, their node and devices, and why."""
        victims = "; ".join(
            f"{v.key} (priority {v.priority}, held {_held(v.alloc)})" for v in self.victims
        )
        needs = (
            "; ".join(reason_names(self.blocking))
            if self.blocking
            else "nothing Tessera counts (kube-scheduler's own resources)"
        )
        n = len(self.victims)
        # Why first: an Event's message is cut at 1024 characters, and victims can be many.
        return (
            f"kube-scheduler preempted {n} pod{'s' if n != 1 else ''} on node {self.node} for "
            f"this pod (priority {self.preemptor.request.priority}), which did not fit there "
            f"with them: {needs}. Preempted: {victims}"
        )


def _held(alloc: PodAllocation) -> str:
    parts = [f"GPU {d.uuid} {d.mem}MiB {d.cores}% cores" for d in alloc.devices]
    parts += [
        f"GPU {m.gpu_uuid} MIG {m.profile} slices [{m.placement.start},{m.placement.end})"
        for m in alloc.mig
    ]
    return ", ".join(parts) or "no GPUs"


@dataclass
class _Pending:
    nominee: Nominee
    victims: list[Victim] = field(default_factory=list)
    last: float = 0.0  # when the last victim joined


class PreemptionTracker:
    """Victims and nominated pods from the watch, paired into preemptions (``due``). Not
    thread-safe: the caller serializes (the plugin server: under the cache's lock)."""

    def __init__(
        self, *, settle_s: float = DEFAULT_SETTLE_S, window_s: float = DEFAULT_WINDOW_S
    ) -> None:
        self._settle_s = settle_s
        self._window_s = window_s
        self._pending: dict[str, _Pending] = {}  # nominee key -> its preemption so far
        self._orphans: dict[str, list[Victim]] = {}  # node -> victims without a preemptor yet
        # Victims paired or waiting, when seen: each is reported once (a re-list shows it again).
        self._seen: dict[str, float] = {}

    def nominated(self, nominee: Nominee) -> None:
        """``nominee`` was nominated to its node; it takes the victims waiting there that it
        outranks."""
        held = self._pending.get(nominee.key)
        if held is not None and held.nominee.node == nominee.node:
            return
        pending = self._pending[nominee.key] = _Pending(nominee)
        waiting = self._orphans.pop(nominee.node, [])
        for v in waiting:
            if v.priority < nominee.request.priority and abs(nominee.at - v.at) <= self._window_s:
                pending.victims.append(v)
                pending.last = max(pending.last, v.at)
            else:
                self._orphans.setdefault(nominee.node, []).append(v)

    def withdrawn(self, key: str) -> None:
        """Pod ``key`` is no longer nominated (bound, or its nomination cleared): forget it
        unless victims joined it already (its preemption is still reported). kube-scheduler
        also nominates pods it is about to bind, waiting at PreBind: those never preempted."""
        pending = self._pending.get(key)
        if pending is not None and not pending.victims:
            del self._pending[key]

    def victim(self, victim: Victim) -> None:
        """``victim`` is being preempted: it joins the latest pod nominated on its node that
        outranks it, or waits for one."""
        if victim.key in self._seen:
            return
        self._seen[victim.key] = victim.at
        best: _Pending | None = None
        for p in self._pending.values():
            n = p.nominee
            if (
                n.node == victim.node
                and n.request.priority > victim.priority
                and abs(victim.at - n.at) <= self._window_s
                and (best is None or n.at > best.nominee.at)
            ):
                best = p
        if best is None:
            self._orphans.setdefault(victim.node, []).append(victim)
            return
        best.victims.append(victim)
        best.last = max(best.last, victim.at)

    def due(self, now: float) -> list[Preemption]:
        """The preemptions no victim joined for ``settle_s`` (each once; ``blocking`` not
        filled in), and forget what waited longer than ``window_s``."""
        out: list[Preemption] = []
        for key, p in list(self._pending.items()):
            if p.victims and now - p.last >= self._settle_s:
                out.append(Preemption(p.nominee, tuple(p.victims)))
                del self._pending[key]
            elif not p.victims and now - p.nominee.at > self._window_s:
                del self._pending[key]
        for node, waiting in list(self._orphans.items()):
            kept = [v for v in waiting if now - v.at <= self._window_s]
            if kept:
                self._orphans[node] = kept
            else:
                del self._orphans[node]
        for key in [k for k, at in self._seen.items() if now - at > 2 * self._window_s]:
            del self._seen[key]
        return out


def blocking_needs(state: ClusterState, preemption: Preemption) -> int:
    """The ``Reason`` bits of the preemptor's needs its victims were blocking: why it did not
    fit their node with all of them there, as far as removing pods can change it."""
    p = preemption.preemptor
    present = {v.key for v in preemption.victims if state.allocation(v.key) is not None}
    gone = [v.alloc for v in preemption.victims if v.key not in present]
    own = {p.key} if state.allocation(p.key) is not None else set()
    before = what_if(state, p.request, p.node, removed=own, added=gone)
    return 0 if before.fits else before.reasons & _USAGE


__all__ = [
    "DEFAULT_SETTLE_S",
    "DEFAULT_WINDOW_S",
    "NEEDS",
    "NEED_LABELS",
    "OTHER",
    "Nominee",
    "Preemption",
    "PreemptionTracker",
    "Victim",
    "blocking_needs",
]
