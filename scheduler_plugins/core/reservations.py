"""The lifecycle of a pod's reservation, from PreFilter's decision until the watch shows the pod
bound (or gone): what the plugin server does for each call of the scheduling cycle, without
the wire.

- ``offer`` (PreFilter): decide, rank the candidates (``ranking``), keep the decision for
  Reserve while the cluster state is unchanged, explain when no node fits, and name the nodes
  where preempting lower-priority pods would make room (``whatif``). Bind annotations an
  unbound pod still carries from an attempt that never bound are taken back first.
- ``what_if`` (Filter during kube-scheduler's preemption dry run): the pod on one node without
  the pods the dry run removed and with those it added (``whatif``).
- ``reserve``: count the plan at once (``ClusterCache.assume``). With *hand-over*, the
  annotations go to the shim's Binding now when no pod the node agent could not tell apart
  from this one (``api.hami.matching.ambiguous``) is allocating on the node.
- ``prebind``: once that wait (bounded by one call; then ``WaitYourTurn``) is over, claim the
  node and hand the annotations over, or write them in one merge patch.
- ``unreserve``: idempotent. A reservation goes only once its annotations are gone from the
  pod (taken back): while they may stand (bound after all, API unreachable) it keeps counting.
  A patch still in flight is settled by its PreBind.

Everything runs under the cache's lock; the Kubernetes writes (patch, take-back) and the waits
outside it. Failures are this module's errors, named by what the scheduler should do.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import structlog

from api.errors import TemporaryError as _Temporary
from api.errors import TesseraError
from api.hami import keys as ann
from api.hami.matching import interchange_key
from api.kube.errors import ConflictError, KubeError, NotFoundError, TemporaryError
from scheduler_plugins.core import hostonly, ranking
from scheduler_plugins.core.binding import bind_annotations, bind_labels
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.decide import Decision, PodPlan, decide
from scheduler_plugins.core.explain import explain, node_reasons, rejection_reasons
from scheduler_plugins.core.hostonly import place_host_only
from scheduler_plugins.core.requests import PodAllocation, PodRequest
from scheduler_plugins.core.rules import reason_names
from scheduler_plugins.core.whatif import WhatIf, host_preemptible, preemptible_nodes, what_if

log = structlog.get_logger("tessera.plugin_server")

DEFAULT_PREBIND_WAIT_S: Final = 30.0
"""How long one PreBind call waits for an ambiguous pod on its node before ``WaitYourTurn``
(``tessera plugin-server --prebind-wait``; the chart's ``prebindWait``)."""

_MAX_CACHED: Final = 1024
_DEADLINE_MARGIN_S: Final = 0.2
# A waiting PreBind wakes when its node changes, its deadline comes or its call ends: this
# slice is only a safety net, long so hundreds of waiters stay asleep.
_WAIT_SLICE_S: Final = 5.0


# ----- errors: what the scheduler should do ------------------------------------------------


class ScheduleAgain(TesseraError):
    """This attempt cannot go on (no decision, no longer fits, unreserved, bound already):
    start a new scheduling cycle."""


class NoDecision(ScheduleAgain):
    """No PreFilter decision is known for the pod (a restarted server, an evicted one)."""


class WaitYourTurn(_Temporary):
    """PreBind: the node is still allocating a pod its node agent could not tell apart from
    this one. Nothing was written and the reservation stands: ask again."""


class RetryLater(_Temporary):
    """Not now (an earlier attempt's write is unsettled, the API is unreachable): retry."""


class WriteFailed(TesseraError):
    """The API refused the bind annotations for good."""


class WrongPod(TesseraError):
    """The call names a pod other than the one its uid was scheduled as."""


# ----- what the lifecycle needs from outside -----------------------------------------------


class PodWriter(Protocol):
    """The part of the Kubernetes client the lifecycle uses (``api.kube.KubeClient``)."""

    def get(self, path: str) -> Any: ...

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any: ...


class Call(Protocol):
    """The scheduler's call a waiting PreBind serves (a gRPC context)."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...

    def on_end(self, callback: Callable[[], None]) -> None: ...


class Spans(Protocol):
    """Tracing: a child span per step that takes time (``decide``, ``prebind.wait``, ...)."""

    def span(self, name: str) -> AbstractContextManager[object]: ...


class _NoSpans:
    def span(self, name: str) -> AbstractContextManager[object]:
        return nullcontext()


class Handed(NamedTuple):
    """What the shim's Binding (or the server's patch) writes on the pod with its node."""

    annotations: dict[str, str]
    labels: dict[str, str]


@dataclass(frozen=True)
class Offer:
    """PreFilter's answer: the candidates best first with Tessera's scores (empty: no node
    fits), how many nodes fit when only some are offered (else 0), and the explanation when
    none fits. ``wall_s``/``cpu_s``: what deciding took; ``pending``: the reasons that
    rejected nodes when none fits (``explain.rejection_reasons``)."""

    decision_id: int
    nodes: list[str]
    scores: list[int]
    feasible_total: int
    why: str
    per_node: str
    pending: int
    wall_s: float
    cpu_s: float
    preemptible: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Added:
    """A pod kube-scheduler's dry run counts as placed on a node: its uid, and what it asks
    of Tessera (None: nothing Tessera would place, e.g. an invalid GPU request)."""

    uid: str
    request: PodRequest | None


@dataclass(frozen=True)
class _Unsure:
    node: str
    patched: Mapping[str, str]


@dataclass(frozen=True)
class _Cached:
    decision_id: int
    decision: Decision


@dataclass
class _Reservation:
    plan: PodPlan
    # The pod as PreFilter saw it (metadata, spec): what makes it interchangeable with
    # another allocating pod of the node (``api.hami.matching.interchange_key``).
    pod: Mapping[str, Any] = field(default_factory=dict)
    alike: str | None = None  # its interchange_key with this plan
    # What PreBind wrote or handed to the shim's Binding, for Unreserve to take back.
    patched: dict[str, str] | None = None
    writing: dict[str, str] | None = None  # what PreBind is writing now (patch in flight)
    # Unreserve came: a PreBind still waiting must not write; one whose patch is in flight
    # takes its annotations back itself when the patch returns.
    cancelled: bool = False


class Reservations:
    """Every pod's reservation. Thread-safe: state changes under the cache's lock."""

    def __init__(
        self,
        cache: ClusterCache,
        kube: PodWriter,
        *,
        wall_clock: Callable[[], float],
        clock: Callable[[], float],
        cpu_clock: Callable[[], float],
        prebind_wait_s: float = DEFAULT_PREBIND_WAIT_S,
        max_prebind_waiters: int = 16,
        spans: Spans | None = None,
        on_reserved: Callable[[str], None] | None = None,
    ) -> None:
        self._cache = cache
        self._kube = kube
        self._wall_clock = wall_clock
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._prebind_wait_s = prebind_wait_s
        # A waiting PreBind holds a worker thread of the server; past this many, new waiters
        # are told to ask again so PreFilter never starves.
        self._max_prebind_waiters = max_prebind_waiters
        self._prebind_waiters = 0  # guarded by the cache lock
        self._spans = spans or _NoSpans()
        self._on_reserved = on_reserved or (lambda key: None)
        self._ids = itertools.count(1)
        # All guarded by the cache lock.
        self._decisions: OrderedDict[str, _Cached] = OrderedDict()
        # The last PreFilter's request of each pod, with its decision's id.
        self._requests: OrderedDict[str, tuple[int, PodRequest]] = OrderedDict()
        self._pods: OrderedDict[str, Mapping[str, Any]] = OrderedDict()  # ... and its pod
        self._reservations: dict[str, _Reservation] = {}
        self._reserved_as: dict[str, str] = {}  # pod key -> ident of its reservation
        # Pods whose bind failed after PreBind wrote their annotations, which could not be
        # taken back (the pod may be bound after all): pod key -> what PreBind wrote.
        self._unsure: OrderedDict[str, _Unsure] = OrderedDict()
        # Pods unreserved while their PreBind patch was in flight: pod key -> that patch,
        # until PreBind has settled it. No new reservation for them before then.
        self._orphan_writes: dict[str, Mapping[str, str]] = {}
        # Any change of the state can change any verdict: a cached Decision is exact only
        # until then (dropping it also stops the state from copying columns for it).
        cache.on_change(self._decisions.clear)
        # Once a pod is bound (or gone) nothing will Unreserve it: drop its reservation, or
        # every pod ever scheduled would stay in memory.
        cache.on_settled(self._drop_reservation)

    @property
    def held(self) -> int:
        with self._cache.lock:
            return len(self._reservations)

    # ----- the calls ---------------------------------------------------------------------

    def offer(
        self,
        req: PodRequest,
        meta: Mapping[str, Any],
        spec: object,
        limit: int,
        nominated: str = "",
    ) -> Offer:
        """Every node's verdict for ``req``, and the ``limit`` best (0: every) nodes that fit.
        ``meta``/``spec``: the pod's, for bind annotations left over from an earlier attempt.
        ``nominated``: the node kube-scheduler's preemption made room on for the pod."""
        ident = req.uid or req.key
        if not req.wants_gpu:
            return self._offer_host_only(ident, req, limit)
        self._clear_leftover(req.key, ident, meta, spec)
        pod = {"metadata": meta, "spec": spec}
        with self._spans.span("decide"), self._cache.lock:
            started, cpu_started = self._clock(), self._cpu_clock()
            decision = decide(self._cache.state, req)
            feasible = np.flatnonzero(decision.feasible)
            offered = ranking.candidates(
                feasible,
                decision.score,
                decision.preference,
                decision.layout.name_rank,
                self._waits(req, decision, pod) if limit and feasible.size else None,
                limit,
            )
            scores: list[int] = decision.preference.kube_scores(decision.score[offered]).tolist()
            all_names = decision.layout.names
            names = [all_names[i] for i in offered.tolist()]
            # Explaining evaluates every rejected node in full: only when no node fits is it
            # needed now; otherwise Explain answers if the cycle fails for other reasons.
            why = explain(decision, self._cache.state) if not names else ""
            pending = rejection_reasons(decision) if not names else 0
            # With some nodes feasible too: kube-scheduler's other plugins may reject them all.
            leaving = self._cache.leaving()
            preemptible = preemptible_nodes(self._cache.state, req, decision.feasible, leaving)
            if not names:  # nodes only CPU or memory refuse: kube-scheduler's dry run decides
                more = host_preemptible(
                    self._cache.state, req, decision.gpus_fit, decision.feasible
                )
                preemptible += [n for n in more if n not in set(preemptible)]
            if nominated and any(a.key in leaving for a in self._cache.state.pods_on(nominated)):
                # The pods preempted for it on its nominated node are still leaving here, while
                # kube-scheduler may have seen them gone already (and so would preempt again
                # elsewhere for the same pod): until they are gone, that node is the only one.
                preemptible = [n for n in preemptible if n == nominated]
            wall_s, cpu_s = self._clock() - started, self._cpu_clock() - cpu_started
            decision_id = next(self._ids)
            _put(self._decisions, ident, _Cached(decision_id, decision))
            _put(self._requests, ident, (decision_id, req))
            _put(self._pods, ident, pod)
        if not names:
            log.info("unschedulable", pod=req.key, reason=why)
        return Offer(
            decision_id=decision_id,
            nodes=names,
            scores=scores,
            feasible_total=feasible.size if offered.size < feasible.size else 0,
            why=why,
            per_node=node_reasons(why) if why else "",
            pending=pending,
            wall_s=wall_s,
            cpu_s=cpu_s,
            preemptible=preemptible,
        )

    def _offer_host_only(self, ident: str, req: PodRequest, limit: int) -> Offer:
        """``offer`` for a pod without a GPU request (``hostonly``, fragmentation policy). No
        node fitting is no verdict of Tessera's: kube-scheduler's NodeResourcesFit says
        why, and its preemption may make room (the server then leaves the pod to it)."""
        with self._spans.span("decide"), self._cache.lock:
            started, cpu_started = self._clock(), self._cpu_clock()
            placement = place_host_only(self._cache.state, req, every=not limit)
            names, scores = placement.offered(limit)
            wall_s, cpu_s = self._clock() - started, self._cpu_clock() - cpu_started
            decision_id = next(self._ids)
            _put(self._requests, ident, (decision_id, req))
        total = placement.fitting
        return Offer(
            decision_id=decision_id,
            nodes=names,
            scores=scores,
            feasible_total=total if len(names) < total else 0,
            why="",
            per_node="",
            pending=0,
            wall_s=wall_s,
            cpu_s=cpu_s,
        )

    def explain(self, ident: str, key: str, decision_id: int) -> str:
        """Why the nodes PreFilter rejected do not fit ("" when every node fits)."""
        with self._spans.span("explain"), self._cache.lock:
            decision = self._decision_for(ident, key, decision_id)
            if decision.feasible.all() and not decision.layout.gpu_less:
                return ""
            return explain(decision, self._cache.state)

    def what_if(
        self,
        ident: str,
        key: str,
        decision_id: int,
        pod: Callable[[], PodRequest | None],
        node: str,
        removed_uids: Sequence[str],
        added: Sequence[Added],
    ) -> WhatIf:
        """The pod on ``node`` in a preemption dry run: without the pods ``removed_uids`` and
        with ``added`` (a removed pod added back holds what it held; a pod counted there
        already stays as it is; any other is placed first, as it would be, and takes nothing
        where it does not fit). The pod is PreFilter's ``decision_id`` one's, else what
        ``pod()`` reads (asked only then; None: nothing to read), else the last one PreFilter
        saw. Pods being preempted already count as gone whatever the dry run says: it may
        not see them any more (kube-scheduler's cache can be ahead of this server's watch),
        and counting them would make it preempt more pods for the room they leave."""
        with self._spans.span("what_if"), self._cache.lock:
            req = self._request_for(ident, key, decision_id, pod)
            state = self._cache.state
            leaving = self._cache.leaving()
            pods = state.pods_on(node)
            on_node = {a.uid: a for a in pods if a.uid}
            gone = set(removed_uids)
            removed = {on_node[uid].key for uid in gone if uid in on_node}
            removed |= {a.key for a in pods if a.key in leaving}
            placed: list[PodAllocation | PodRequest] = []
            for a in added:
                held = on_node.get(a.uid)
                if held is not None:
                    if a.uid in gone and held.key not in leaving:
                        placed.append(held)  # added back: what it held
                    continue
                if a.request is not None and a.request.wants_gpu:
                    placed.append(a.request)
            return what_if(state, req, node, removed=removed, added=placed)

    def reserve(
        self,
        ident: str,
        key: str,
        node: str,
        decision_id: int,
        *,
        hand_over: bool,
        trial: bool = False,
    ) -> Handed | None:
        """Count the pod's plan on ``node`` now. With ``hand_over``: the bind annotations and
        labels when nothing on the node makes the pod wait (the shim binds with them and skips
        PreBind), else None (PreBind waits and hands them over). ``trial``: kube-scheduler
        tries the pod's gang and reverts this when its cycle ends (only logged as such)."""
        self._refuse_while_written(key)
        self._settle_unsure(key)
        with self._spans.span("reserve"), self._cache.lock:
            held = self._requests.get(ident)
            if held is not None and not held[1].wants_gpu:
                self._reserve_host_only(ident, key, node, held[1])
                return None
            decision = self._decision_for(ident, key, decision_id)
            self._refuse_bound(key)
            plan = decision.plan_for(node)
            if plan is None:
                raise ScheduleAgain(_no_longer_fits(decision, key, node))
            req = decision.request
            alloc = plan.allocation(
                req.cpu_milli, req.memory_bytes, uid=req.uid, priority=req.priority
            )
            pod = self._pods.get(ident, {})
            annotations = bind_annotations(plan, bind_time=int(self._wall_clock()))
            alike = interchange_key(pod, annotations) if pod else None
            # Done with the decision: gone before the state changes, it is not told to copy
            # the GPU columns its lazy results would read (a copy of every column per pod).
            self._decisions.pop(ident, None)
            del decision
            self._cache.assume(alloc, _device_counts(req), alike)
            self._on_reserved(alloc.key)
            res = self._reservations[ident] = _Reservation(plan, pod, alike)
            self._reserved_as[key] = ident
            handed = self._hand_over_now(key, res, annotations) if hand_over else None
        log.info("reserved", pod=key, node=node, handed_over=handed is not None, trial=trial)
        return handed

    def _reserve_host_only(self, ident: str, key: str, node: str, req: PodRequest) -> None:
        """``reserve`` of a pod without a GPU request (caller holds the cache lock): its CPU
        and memory count on ``node`` until the watch shows it bound there (or Unreserve).
        Nothing to hand over or write: kube-scheduler's DefaultBinder binds it."""
        _check_same_pod(req.key, key, ident)
        self._refuse_bound(key)
        if node not in self._cache.state.nodes:
            raise ScheduleAgain(f"node {node} of pod {key} is not known here (yet)")
        self._cache.assume(hostonly.allocation(req, node), frozenset(), None)
        self._on_reserved(key)
        self._reserved_as[key] = ident  # dropped with the request once the pod is bound
        log.info("reserved", pod=key, node=node, handed_over=False, gpu=False)

    def unreserve(self, ident: str, key: str, node: str) -> None:
        """Forget the pod's reservation (idempotent; nothing reserved is fine too)."""
        with self._cache.lock:
            res = self._reservations.get(ident)
            if res is not None:
                _check_same_pod(res.plan.pod, key, ident)
                res.cancelled = True
            self._reservations.pop(ident, None)
            self._reserved_as.pop(key, None)
            if res is not None and res.writing is not None:
                # PreBind's patch is in flight: when it returns, PreBind takes it back.
                self._orphan_writes[key] = res.writing
                log.info("unreserved during the bind patch", pod=key, node=node or None)
                return
            patched = res.patched if res is not None else None
            if patched is None:
                self._release(key)
        # The reservation goes only once its annotations are gone from the pod: while they
        # may stand (the pod bound after all, or the API unreachable) it keeps counting, or
        # another pod could be given the same devices before the watch shows them.
        if res is not None and patched is not None:
            taken_back = self._take_back(key, res.plan.node, patched)
            with self._cache.lock:
                if taken_back:
                    self._release(key)
                else:
                    _put(self._unsure, key, _Unsure(res.plan.node, patched))
        log.info("unreserved", pod=key, node=node or None)

    def prebind(
        self, ident: str, key: str, node: str, uid: str, call: Call, *, hand_over: bool
    ) -> Handed:
        """Claim ``node`` for the pod once no ambiguous pod is allocating there (waiting at
        most one call's time), then hand the bind annotations over (``hand_over``: the shim
        writes them in the Binding) or write them in one merge patch (guarded by ``uid``)."""
        with self._cache.lock:
            res = self._reservations.get(ident)
        if res is None:
            raise ScheduleAgain(f"no reservation for pod {key}; it is never bound without one")
        _check_same_pod(res.plan.pod, key, ident)
        if res.plan.node != node:
            raise ScheduleAgain(f"pod {key} is reserved on node {res.plan.node}, not {node}")
        annotations = bind_annotations(res.plan, bind_time=int(self._wall_clock()))
        with self._spans.span("prebind.wait"):
            self._wait_and_claim(call, key, node, annotations, res.alike)
        with self._cache.lock:
            if res.cancelled:  # unreserved while this PreBind waited: write nothing
                self._cache.release_claim(key)
                raise ScheduleAgain(f"pod {key} was unreserved; not binding it")
            if hand_over:
                # The shim's Binding carries them (nodeName and annotations in one write):
                # from now on they may be on the pod, so Unreserve looks before releasing.
                res.patched = annotations
            else:
                res.writing = annotations
        labels = bind_labels(res.plan)
        if hand_over:
            log.info("bind annotations handed over", pod=key, node=node)
            return Handed(annotations, labels)
        body: dict[str, Any] = {"metadata": {"annotations": annotations, "labels": labels}}
        if uid:
            body["metadata"]["uid"] = uid  # never annotate a recreated namesake
        failure: TesseraError | None = None
        try:
            with self._spans.span("prebind.patch"):
                self._kube.merge_patch(_pod_path(key), body)
        except TemporaryError as e:  # the patch may still have gone through
            failure = RetryLater(f"cannot write bind annotations of {key}: {e}")
        except KubeError as e:
            failure = WriteFailed(f"cannot write bind annotations of {key}: {e}")
        with self._cache.lock:
            res.writing = None
            cancelled = res.cancelled
            if failure is None and not cancelled:
                res.patched = annotations
            elif failure is not None and not cancelled:
                self._cache.release_claim(key)
        if cancelled:
            # The scheduler gave up on this pod (its deadline passed) while the patch was in
            # flight, and its Unreserve left the reservation to us: take the annotations
            # back, or keep counting them while that cannot be done.
            self._settle_cancelled(key, node, annotations)
            raise ScheduleAgain(
                f"pod {key} was unreserved while its bind annotations were written; taken back"
            )
        if failure is not None:
            raise failure
        log.info("bind annotations written", pod=key, node=node)
        return Handed(annotations, labels)

    # ----- helpers -----------------------------------------------------------------------

    def _hand_over_now(
        self, key: str, res: _Reservation, annotations: dict[str, str]
    ) -> Handed | None:
        """Reserve's hand-over (caller holds the cache lock): claim the node for the pod
        now when no pod it must wait for is allocating there, and give its bind
        ``annotations`` to the shim's Binding; it then skips PreBind (one RPC less per pod).
        None: PreBind waits as usual."""
        if self._cache.blocking(res.plan.node, key, annotations, res.alike):
            return None
        self._cache.claim(key, res.plan.node, annotations, res.alike)
        res.patched = annotations  # from now on they may be on the pod
        return Handed(annotations, bind_labels(res.plan))

    def _settle_cancelled(self, key: str, node: str, written: Mapping[str, str]) -> None:
        """Unreserve's work for a reservation whose PreBind patch was in flight then: take
        the annotations back, or keep counting them (``_unsure``) while that cannot be done."""
        taken_back = False
        try:
            taken_back = self._take_back(key, node, written)
        finally:
            with self._cache.lock:
                self._orphan_writes.pop(key, None)
                if taken_back:
                    self._release(key)
                else:
                    _put(self._unsure, key, _Unsure(node, dict(written)))

    def _clear_leftover(self, key: str, ident: str, meta: Mapping[str, Any], spec: object) -> None:
        """The scheduler tries a pod again only once its earlier attempt is over: bind
        annotations an unbound pod still carries then (PreBind's patch landed, but the server
        died before Unreserve could take it back, or the take-back failed) are left over.
        Take them back now, or a pod that no longer fits anywhere would keep them, and the
        devices they name, while it stays Pending. Not while this server's own attempt for
        the pod is in progress, and never from a pod that is bound after all."""
        if isinstance(spec, dict) and spec.get("nodeName"):
            return
        raw = meta.get("annotations")
        left = {
            k: str(v)
            for k, v in (raw.items() if isinstance(raw, dict) else ())
            if isinstance(k, str) and k.startswith(ann.INTERNAL_PREFIXES)
        }
        if not left and key not in self._unsure:
            return  # the common case, decided without the lock (re-checked under it)
        with self._cache.lock:
            unsure = self._unsure.get(key)
            if unsure is None and not left:
                return
            if ident in self._reservations or key in self._orphan_writes:
                return
            written = dict(unsure.patched) if unsure is not None else {}
        written.update(left)
        node = unsure.node if unsure is not None else left.get(ann.VGPU_NODE, "")
        if not self._take_back(key, node, written):
            return  # still counted; Reserve refuses the pod until this is settled
        with self._cache.lock:
            self._unsure.pop(key, None)
            self._release(key)
            self._cache.drop_unbound(key)
        log.info("took back leftover bind annotations", pod=key, node=node or None)

    def _request_for(
        self, ident: str, key: str, decision_id: int, pod: Callable[[], PodRequest | None]
    ) -> PodRequest:
        """The request of PreFilter's decision ``decision_id``, else ``pod()``, else the last
        one PreFilter saw for the pod (caller holds the cache lock)."""
        held = self._requests.get(ident)
        req = held[1] if held is not None and held[0] == decision_id else pod()
        if req is None and held is not None:
            req = held[1]
        if req is None:
            raise NoDecision(f"no PreFilter decision for pod {key} (server restarted?)")
        _check_same_pod(req.key, key, ident)
        return req

    def _decision_for(self, ident: str, key: str, decision_id: int) -> Decision:
        """PreFilter's decision ``decision_id`` while the state is unchanged, else the same
        request decided again on the state as it is now (caller holds the cache lock)."""
        cached = self._decisions.get(ident)
        if cached is not None and cached.decision_id == decision_id:
            decision = cached.decision
        else:
            held = self._requests.get(ident)
            if held is None:
                raise NoDecision(f"no PreFilter decision for pod {key} (server restarted?)")
            decision = decide(self._cache.state, held[1])
        _check_same_pod(decision.request.key, key, ident)
        return decision

    def _waits(self, req: PodRequest, decision: Decision, pod: Mapping[str, Any]) -> Any:
        """Per node of the decision, how many in-flight pods PreBind of ``req`` would wait for
        there (the node agent could not tell them apart; not those interchangeable with it,
        by its plan on its best node, which Reserve then finds planned already); None when no
        node is busy. One numpy gather per
        device count from the cache's busy arrays: no Python work per node (mapping a
        thousand busy node names to segments per call was 4% of the server's CPU in a
        1000-node drain)."""
        interchange = None
        if len(req.containers) == 1 and self._cache.has_alike():
            best = decision.best_node()
            plan = decision.plan_for(best) if best is not None else None
            if plan is not None:
                interchange = _alike(pod, plan)
        return self._cache.busy_per_node(_device_counts(req), decision.layout.names, interchange)

    def _refuse_bound(self, key: str) -> None:
        """A pod the watch shows bound is not reserved or annotated again: the scheduler
        can retry one whose Bind answer it lost (the apiserver went away) before its own
        watch shows the bind, and a second reservation would replace the pod's real one."""
        node = self._cache.bound_to(key)
        if node is not None:
            raise ScheduleAgain(
                f"pod {key} is bound to node {node} already (an earlier bind went through)"
            )

    def _refuse_while_written(self, key: str) -> None:
        """A pod whose earlier PreBind patch is still in flight is not reserved again: that
        patch could land after the new one and put the old devices on the bound pod."""
        with self._cache.lock:
            writing = key in self._orphan_writes
        if writing:
            raise RetryLater(
                f"pod {key}: the annotations of an earlier bind attempt are still being "
                "written; retry shortly"
            )

    def _settle_unsure(self, key: str) -> None:
        """Before a pod is reserved again: if an earlier bind of it may have gone through
        (its reservation still counts), find out. Bound: refuse (the scheduler will see it
        bound); not bound: take the old annotations back and drop the old reservation;
        cannot tell: refuse for now. Otherwise a second reservation would replace the
        first while the first may be the pod's real allocation, and its devices could go
        to another pod."""
        with self._cache.lock:
            unsure = self._unsure.get(key)
        if unsure is None:
            return
        if not self._take_back(key, unsure.node, unsure.patched):
            raise RetryLater(
                f"pod {key}: an earlier bind on node {unsure.node} may have gone through; "
                "retry once the cluster shows whether it did"
            )
        with self._cache.lock:
            self._unsure.pop(key, None)
            self._release(key)

    def _take_back(self, key: str, node: str, patched: Mapping[str, str]) -> bool:
        """PreBind wrote the reservation but the bind failed: take it back, or the unbound
        pod would keep counting on that node (best effort; logged). Not from a pod that is
        bound after all: a Bind whose answer was lost (the apiserver went away) may have
        gone through, and then these annotations are the pod's allocation. Whether the
        annotations are gone (or the pod is)."""
        path = _pod_path(key)
        undo = {
            "metadata": {
                "annotations": dict.fromkeys(patched),
                "labels": {ann.VGPU_NODE_LABEL: None},
            }
        }
        for _ in range(3):
            try:
                pod = self._kube.get(path)
                bound_to = (pod.get("spec") or {}).get("nodeName")
                if bound_to:
                    log.warning(
                        "bind reported failed but the pod is bound; keeping its annotations",
                        pod=key,
                        node=bound_to,
                    )
                    return False
                meta = pod.get("metadata") or {}
                if not any(k in (meta.get("annotations") or {}) for k in patched):
                    return True  # none on the pod (a Binding that carried them failed)
                self._kube.merge_patch(path, undo, resource_version=meta.get("resourceVersion"))
                return True
            except NotFoundError:
                return True
            except ConflictError:
                continue  # changed since we read it (bound just now?): look again
            except KubeError as e:
                log.warning("cannot remove bind annotations", pod=key, node=node, error=str(e))
                return False
        log.warning("cannot remove bind annotations: the pod keeps changing", pod=key, node=node)
        return False

    def _wait_and_claim(
        self,
        call: Call,
        key: str,
        node: str,
        annotations: dict[str, str],
        interchange: str | None,
    ) -> None:
        """Claim the node for ``annotations`` once no ambiguous pod is allocating there."""
        start = self._clock()
        budget = self._prebind_wait_s
        remaining = call.time_remaining()
        if remaining is not None:
            budget = min(budget, remaining - _DEADLINE_MARGIN_S)
        deadline = start + budget
        waiting = False
        with self._cache.lock:
            try:
                while True:
                    blockers = self._cache.blocking(node, key, annotations, interchange)
                    if not blockers:
                        self._cache.claim(key, node, annotations, interchange)
                        if waiting:
                            log.info(
                                "done waiting",
                                pod=key,
                                node=node,
                                waited_s=round(self._clock() - start, 3),
                            )
                        return
                    left = deadline - self._clock()
                    if left <= 0 or not call.is_active():
                        raise WaitYourTurn(
                            f"pod {key}: waited {max(budget, 0):.1f}s for pod(s) "
                            f"{', '.join(blockers)} to finish allocating on node {node} (the "
                            "node agent could not tell them apart); ask again"
                        )
                    if not waiting:
                        if self._prebind_waiters >= self._max_prebind_waiters:
                            raise WaitYourTurn(
                                f"pod {key}: {self._prebind_waiters} binds are already waiting "
                                f"for ambiguous pods to finish allocating; ask again shortly"
                            )
                        self._prebind_waiters += 1
                        waiting = True
                        # A cancelled or timed-out call wakes its waiter at once.
                        call.on_end(functools.partial(self._cache.wake, node))
                        log.info(
                            "waiting for ambiguous allocating pods",
                            pod=key,
                            node=node,
                            blockers=blockers,
                        )
                    self._cache.wait_changed(min(left, _WAIT_SLICE_S), node)
            finally:
                if waiting:
                    self._prebind_waiters -= 1

    def _release(self, key: str) -> None:
        """Stop counting pod ``key``'s reservation and bind claim (caller holds the cache
        lock): its annotations are gone from the pod, or were never written."""
        self._cache.forget(key)
        self._cache.release_claim(key)

    def _drop_reservation(self, key: str) -> None:
        self._unsure.pop(key, None)
        ident = self._reserved_as.pop(key, None)
        if ident is not None:
            self._reservations.pop(ident, None)
            self._requests.pop(ident, None)
            self._pods.pop(ident, None)


def _alike(pod: Mapping[str, Any], plan: PodPlan) -> str | None:
    """The pod's interchange_key with ``plan``'s bind annotations (None: no pod seen)."""
    return interchange_key(pod, bind_annotations(plan, bind_time=0)) if pod else None


def _device_counts(req: PodRequest) -> frozenset[int]:
    """How many devices each GPU container asks: all the node agent can tell pods apart by."""
    return frozenset(c.count for c in req.containers if c.count > 0)


def _check_same_pod(held: str, key: str, ident: str) -> None:
    """The pod ref names the pod its uid was PreFiltered/reserved as: a ref mixing one pod's
    uid with another's name must not reserve, bind or unreserve under the other's name."""
    if held != key:
        raise WrongPod(
            f"pod ref {key} (uid {ident}) does not match pod {held}, which that uid was "
            "scheduled as"
        )


def _no_longer_fits(decision: Decision, key: str, node: str) -> str:
    i = decision.node_index(node)
    if i < 0:
        return f"node {node} has no GPUs Tessera knows of for pod {key}"
    why = "; ".join(reason_names(int(decision.reasons[i]))) or "does not fit"
    return f"node {node} no longer fits pod {key}: {why}"


def _pod_path(key: str) -> str:
    namespace, _, name = key.partition("/")
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def _put(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _MAX_CACHED:
        cache.popitem(last=False)


__all__ = [
    "DEFAULT_PREBIND_WAIT_S",
    "Added",
    "Call",
    "Handed",
    "NoDecision",
    "Offer",
    "PodWriter",
    "Reservations",
    "RetryLater",
    "ScheduleAgain",
    "Spans",
    "WaitYourTurn",
    "WriteFailed",
    "WrongPod",
]
