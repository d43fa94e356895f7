"""The gRPC servicer of the plugin protocol: translates messages to core calls and back.

PreFilter decides once per cycle (``decide``) and caches the Decision for Reserve while the
cache's state is unchanged; it explains the rejected nodes only when none fits (otherwise
``Explain`` does, asked by the shim's PostFilter when the whole cycle found no node).
Reserve counts the plan at once (``assume``). The reservation's annotations go to the
shim, whose Bind writes them with the pod's nodeName in one Binding: from Reserve itself
when no pod the node agent could not tell apart from this one (``pod_matching.ambiguous``)
is allocating on the node (the shim then skips PreBind), else from PreBind once that wait
(bounded) is over. When the shim does not bind, PreBind writes them in one merge patch.
Every handler answers a status code the shim can act on; none binds without a
reservation.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn, Protocol, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
import structlog

from api.errors import InvalidInputError, short_repr
from api.hami import keys as ann
from api.kube.errors import ConflictError, KubeError, NotFoundError, TemporaryError
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core import ranking
from scheduler_plugins.core.binding import bind_annotations
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.decide import Decision, PodPlan
from scheduler_plugins.core.decide import decide as core_decide
from scheduler_plugins.core.explain import explain, node_reasons
from scheduler_plugins.core.requests import PodRequest, parse_request
from scheduler_plugins.core.rules import reason_names
from scheduler_plugins.server.events import EventRecorder, PodEventTarget
from scheduler_plugins.server.metrics import SchedulingMetrics, rejection_reasons
from scheduler_plugins.server.tracing import Tracing, record_abort, record_response

log = structlog.get_logger("tessera.plugin_server")

_MAX_CACHED = 1024
_DEADLINE_MARGIN_S = 0.2
# A waiting PreBind wakes when its node changes, its deadline comes or its RPC ends (a
# callback): this slice is only a safety net, long so hundreds of waiters stay asleep.
_WAIT_SLICE_S = 5.0
# PreBind's "not yet, nothing written, the reservation stands: ask again" (its node is still
# allocating an earlier pod the node agent could not tell apart, and this call's wait ended
# or no worker is free to wait). The shim sleeps and asks again until its bind deadline
# instead of failing the binding cycle (a failed cycle is a requeue, an event and a status
# write, and the next attempt queues at the back again).
WAIT_ELSEWHERE: Final = grpc.StatusCode.RESOURCE_EXHAUSTED

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Patcher(Protocol):
    """The part of ``KubeClient`` PreBind and Unreserve use."""

    def get(self, path: str) -> Any: ...

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any: ...


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _abort(code: grpc.StatusCode, message: str) -> NoReturn:
    raise _Abort(code, message)


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
    # What PreBind wrote or handed to the shim's Binding, for Unreserve to take back.
    patched: dict[str, str] | None = None
    writing: dict[str, str] | None = None  # what PreBind is writing now (patch in flight)
    # Unreserve came: a PreBind still waiting must not write; one whose patch is in flight
    # takes its annotations back itself when the patch returns.
    cancelled: bool = False


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """``ready`` gates every answer but Unreserve: before it the state is not rebuilt yet."""

    def __init__(
        self,
        cache: ClusterCache,
        kube: Patcher,
        ready: threading.Event,
        *,
        events: EventRecorder | None = None,
        prebind_wait_s: float = 30.0,
        max_prebind_waiters: int = 16,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
        metrics: SchedulingMetrics | None = None,
    ) -> None:
        self._cache = cache
        self._kube = kube
        self._ready = ready
        self._events = events
        self._prebind_wait_s = prebind_wait_s
        # A waiting PreBind holds an RPC worker thread; past this many, new waiters are told
        # to retry (kube-scheduler backs off and requeues) so PreFilter never starves.
        self._max_prebind_waiters = max_prebind_waiters
        self._prebind_waiters = 0  # guarded by the cache lock
        self._wall_clock = wall_clock
        self._clock = clock
        self._tracing = tracing or Tracing.off()
        self._metrics = metrics if metrics is not None else SchedulingMetrics()
        self._ids = itertools.count(1)
        # All three are guarded by the cache lock.
        self._decisions: OrderedDict[str, _Cached] = OrderedDict()
        self._requests: OrderedDict[str, PodRequest] = OrderedDict()
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

    # ----- protocol ----------------------------------------------------------------------

    def PreFilter(
        self, request: pb.PreFilterRequest, context: grpc.ServicerContext
    ) -> pb.PreFilterResponse:
        response = _handle(
            self._prefilter, request, context, "PreFilter", self._tracing, self._metrics
        )
        self._metrics.count_answer(response.code)
        return response

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        return _handle(self._reserve, request, context, "Reserve", self._tracing, self._metrics)

    def Unreserve(
        self, request: pb.UnreserveRequest, context: grpc.ServicerContext
    ) -> pb.UnreserveResponse:
        return _handle(self._unreserve, request, context, "Unreserve", self._tracing, self._metrics)

    def PreBind(
        self, request: pb.PreBindRequest, context: grpc.ServicerContext
    ) -> pb.PreBindResponse:
        return _handle(self._prebind, request, context, "PreBind", self._tracing, self._metrics)

    def Explain(
        self, request: pb.ExplainRequest, context: grpc.ServicerContext
    ) -> pb.ExplainResponse:
        return _handle(self._explain, request, context, "Explain", self._tracing, self._metrics)

    # ----- handlers ----------------------------------------------------------------------

    def _prefilter(
        self, request: pb.PreFilterRequest, context: grpc.ServicerContext
    ) -> pb.PreFilterResponse:
        self._check_version(request.version)
        self._check_ready()
        invalid = pb.PreFilterResponse.INVALID
        try:
            pod = json.loads(request.pod_json)
        except ValueError as e:  # also invalid UTF-8
            return pb.PreFilterResponse(code=invalid, message=f"pod_json is not JSON: {e}")
        except RecursionError:
            return pb.PreFilterResponse(code=invalid, message="pod_json is nested too deeply")
        if not isinstance(pod, dict):
            return pb.PreFilterResponse(code=invalid, message="pod_json is not a JSON object")
        meta = pod.setdefault("metadata", {})
        if not isinstance(meta, dict):
            return pb.PreFilterResponse(code=invalid, message="pod metadata is not an object")
        for field, value in (
            ("namespace", request.pod.namespace),
            ("name", request.pod.name),
            ("uid", request.pod.uid),
        ):
            if value and not meta.get(field):
                meta[field] = value
        bad_name = _bad_pod_name(meta.get("namespace") or "default", meta.get("name"))
        if bad_name:
            return pb.PreFilterResponse(code=invalid, message=f"pod_json: {bad_name}")
        try:
            req = parse_request(pod, self._cache.state.config)
        except InvalidInputError as e:
            return pb.PreFilterResponse(code=invalid, message=str(e))
        if not req.wants_gpu:
            return pb.PreFilterResponse(code=pb.PreFilterResponse.SKIP)
        ident = req.uid or req.key
        self._clear_leftover(req.key, ident, meta, pod.get("spec"))
        with self._tracing.span("decide"), self._cache.lock:
            started, cpu_started = self._clock(), time.thread_time()
            decision = core_decide(self._cache.state, req)
            feasible = np.flatnonzero(decision.feasible)
            limit = request.candidate_nodes
            offered = ranking.candidates(
                feasible,
                decision.score,
                decision.preference,
                decision.layout.name_rank,
                self._waits(req, decision) if limit and feasible.size else None,
                limit,
            )
            scores = decision.preference.kube_scores(decision.score[offered]).tolist()
            total = feasible.size if offered.size < feasible.size else 0
            all_names = decision.layout.names
            names = [all_names[i] for i in offered.tolist()]
            # Explaining evaluates every rejected node in full: only when no node fits is it
            # needed now; otherwise Explain answers if the cycle fails for other reasons.
            why = explain(decision, self._cache.state) if not names else ""
            per_node = node_reasons(why) if why else ""
            pending = rejection_reasons(decision) if not names else 0
            self._metrics.observe_decision(
                self._clock() - started, pending, cpu_seconds=time.thread_time() - cpu_started
            )
            decision_id = next(self._ids)
            _put(self._decisions, ident, _Cached(decision_id, decision))
            _put(self._requests, ident, req)
        if not names:
            log.info("unschedulable", pod=req.key, reason=why)
            if self._events is not None:
                ns, _, name = req.key.partition("/")
                self._events.unschedulable(PodEventTarget(ns, name, req.uid), why)
            return pb.PreFilterResponse(
                code=pb.PreFilterResponse.UNSCHEDULABLE,
                message=why,
                infeasible_message=per_node,
                decision_id=decision_id,
            )
        return pb.PreFilterResponse(
            code=pb.PreFilterResponse.OK,
            feasible_nodes=names,
            scores=scores,
            infeasible_message=per_node,
            decision_id=decision_id,
            feasible_total=total,
        )

    def _explain(
        self, request: pb.ExplainRequest, context: grpc.ServicerContext
    ) -> pb.ExplainResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        with self._tracing.span("explain"), self._cache.lock:
            decision = self._decision_for(
                ident, key, request.decision_id, grpc.StatusCode.NOT_FOUND, ""
            )
            if decision.feasible.all() and not decision.layout.gpu_less:
                return pb.ExplainResponse()  # every node fits: nothing to explain
            return pb.ExplainResponse(message=explain(decision, self._cache.state))

    def _reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        self._refuse_while_written(key)
        self._settle_unsure(key)
        node = request.node
        with self._tracing.span("reserve"), self._cache.lock:
            decision = self._decision_for(
                ident, key, request.decision_id, grpc.StatusCode.ABORTED, "; schedule it again"
            )
            self._refuse_bound(key)
            plan = decision.plan_for(node)
            if plan is None:
                _abort(grpc.StatusCode.ABORTED, _no_longer_fits(decision, key, node))
            req = decision.request
            alloc = plan.allocation(req.cpu_milli, req.memory_bytes)
            self._cache.assume(alloc, _device_counts(req))
            self._metrics.reserved(alloc.key)
            res = self._reservations[ident] = _Reservation(plan)
            self._reserved_as[key] = ident
            handed = self._hand_over_now(key, res) if request.hand_over else None
        log.info("reserved", pod=key, node=node, handed_over=handed is not None)
        return pb.ReserveResponse(annotations=handed)

    def _unreserve(
        self, request: pb.UnreserveRequest, context: grpc.ServicerContext
    ) -> pb.UnreserveResponse:
        # Idempotent and answered before ready too: after a restart nothing is reserved.
        self._check_version(request.version)
        ident, key = _ident(request.pod)
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
                log.info("unreserved during the bind patch", pod=key, node=request.node or None)
                return pb.UnreserveResponse()
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
        log.info("unreserved", pod=key, node=request.node or None)
        return pb.UnreserveResponse()

    def _prebind(
        self, request: pb.PreBindRequest, context: grpc.ServicerContext
    ) -> pb.PreBindResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        node = request.node
        with self._cache.lock:
            res = self._reservations.get(ident)
        if res is None:
            _abort(
                grpc.StatusCode.ABORTED,
                f"no reservation for pod {key}; it is never bound without one",
            )
        _check_same_pod(res.plan.pod, key, ident)
        if res.plan.node != node:
            _abort(
                grpc.StatusCode.ABORTED,
                f"pod {key} is reserved on node {res.plan.node}, not {node}",
            )
        annotations = bind_annotations(res.plan, bind_time=int(self._wall_clock()))
        with self._tracing.span("prebind.wait"):
            self._wait_and_claim(context, key, node, annotations)
        with self._cache.lock:
            if res.cancelled:  # unreserved while this PreBind waited: write nothing
                self._cache.release_claim(key)
                _abort(grpc.StatusCode.ABORTED, f"pod {key} was unreserved; not binding it")
            if request.hand_over:
                # The shim's Binding carries them (nodeName and annotations in one write):
                # from now on they may be on the pod, so Unreserve looks before releasing.
                res.patched = annotations
            else:
                res.writing = annotations
        if request.hand_over:
            log.info("bind annotations handed over", pod=key, node=node)
            return pb.PreBindResponse(annotations=annotations)
        body: dict[str, Any] = {"metadata": {"annotations": annotations}}
        if request.pod.uid:
            body["metadata"]["uid"] = request.pod.uid  # never annotate a recreated namesake
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            with self._tracing.span("prebind.patch"):
                self._kube.merge_patch(_pod_path(*key.split("/", 1)), body)
        except TemporaryError as e:  # the patch may still have gone through
            failure = (grpc.StatusCode.UNAVAILABLE, f"cannot write bind annotations of {key}: {e}")
        except KubeError as e:
            failure = (grpc.StatusCode.INTERNAL, f"cannot write bind annotations of {key}: {e}")
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
            _abort(
                grpc.StatusCode.ABORTED,
                f"pod {key} was unreserved while its bind annotations were written; taken back",
            )
        if failure is not None:
            _abort(*failure)
        log.info("bind annotations written", pod=key, node=node)
        return pb.PreBindResponse(annotations=annotations)

    # ----- helpers -----------------------------------------------------------------------

    def _hand_over_now(self, key: str, res: _Reservation) -> dict[str, str] | None:
        """Reserve's hand-over (caller holds the cache lock): claim the node for the pod
        now when no pod it must wait for is allocating there, and give the annotations to
        the shim's Binding; it then skips PreBind (one RPC less per pod). None: PreBind
        waits as usual."""
        annotations = bind_annotations(res.plan, bind_time=int(self._wall_clock()))
        if self._cache.blocking(res.plan.node, key, annotations):
            return None
        self._cache.claim(key, res.plan.node, annotations)
        res.patched = annotations  # from now on they may be on the pod
        return annotations

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

    def _decision_for(
        self, ident: str, key: str, decision_id: int, missing: grpc.StatusCode, advice: str
    ) -> Decision:
        """PreFilter's decision ``decision_id`` while the state is unchanged, else the same
        request decided again on the state as it is now (caller holds the cache lock)."""
        cached = self._decisions.get(ident)
        if cached is not None and cached.decision_id == decision_id:
            decision = cached.decision
        else:
            req = self._requests.get(ident)
            if req is None:
                _abort(missing, f"no PreFilter decision for pod {key} (server restarted?){advice}")
            decision = core_decide(self._cache.state, req)
        _check_same_pod(decision.request.key, key, ident)
        return decision

    def _waits(self, req: PodRequest, decision: Decision) -> npt.NDArray[np.int64] | None:
        """Per node of the decision, how many in-flight pods PreBind of ``req`` would wait for
        there (the node agent could not tell them apart); None when no node is busy. One
        numpy gather per device count from the cache's busy arrays: no Python work per node
        (mapping a thousand busy node names to segments per call was 4% of the server's CPU
        in a 1000-node drain)."""
        return self._cache.busy_per_node(_device_counts(req), decision.layout.names)

    def _refuse_bound(self, key: str) -> None:
        """A pod the watch shows bound is not reserved or annotated again: the scheduler
        can retry one whose Bind answer it lost (the apiserver went away) before its own
        watch shows the bind, and a second reservation would replace the pod's real one."""
        node = self._cache.bound_to(key)
        if node is not None:
            _abort(
                grpc.StatusCode.ABORTED,
                f"pod {key} is bound to node {node} already (an earlier bind went through)",
            )

    def _refuse_while_written(self, key: str) -> None:
        """A pod whose earlier PreBind patch is still in flight is not reserved again: that
        patch could land after the new one and put the old devices on the bound pod."""
        with self._cache.lock:
            writing = key in self._orphan_writes
        if writing:
            _abort(
                grpc.StatusCode.UNAVAILABLE,
                f"pod {key}: the annotations of an earlier bind attempt are still being "
                "written; retry shortly",
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
            _abort(
                grpc.StatusCode.UNAVAILABLE,
                f"pod {key}: an earlier bind on node {unsure.node} may have gone through; "
                "retry once the cluster shows whether it did",
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
        path = _pod_path(*key.split("/", 1))
        undo = {"metadata": {"annotations": dict.fromkeys(patched)}}
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
        self, context: grpc.ServicerContext, key: str, node: str, annotations: dict[str, str]
    ) -> None:
        """Claim the node for ``annotations`` once no ambiguous pod is allocating there."""
        start = self._clock()
        budget = self._prebind_wait_s
        remaining_rpc = context.time_remaining()
        if remaining_rpc is not None:
            budget = min(budget, remaining_rpc - _DEADLINE_MARGIN_S)
        deadline = start + budget
        waiting = False
        with self._cache.lock:
            try:
                while True:
                    blockers = self._cache.blocking(node, key, annotations)
                    if not blockers:
                        self._cache.claim(key, node, annotations)
                        if waiting:
                            log.info(
                                "done waiting",
                                pod=key,
                                node=node,
                                waited_s=round(self._clock() - start, 3),
                            )
                        return
                    left = deadline - self._clock()
                    if left <= 0 or not context.is_active():
                        _abort(
                            WAIT_ELSEWHERE,
                            f"pod {key}: waited {max(budget, 0):.1f}s for pod(s) "
                            f"{', '.join(blockers)} to finish allocating on node {node} (the "
                            "node agent could not tell them apart); ask again",
                        )
                    if not waiting:
                        if self._prebind_waiters >= self._max_prebind_waiters:
                            _abort(
                                WAIT_ELSEWHERE,
                                f"pod {key}: {self._prebind_waiters} binds are already waiting "
                                f"for ambiguous pods to finish allocating; ask again shortly",
                            )
                        self._prebind_waiters += 1
                        waiting = True
                        # A cancelled or timed-out RPC wakes its waiter at once.
                        context.add_callback(functools.partial(self._cache.wake, node))
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

    @property
    def reservations_held(self) -> int:
        with self._cache.lock:
            return len(self._reservations)

    def _check_version(self, version: int) -> None:
        if version != pb.PROTOCOL_VERSION_1:
            _abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {version} is not supported; this plugin server speaks "
                f"version {pb.PROTOCOL_VERSION_1} (upgrade the shim and server together)",
            )

    def _check_ready(self) -> None:
        if not self._ready.is_set():
            _abort(
                grpc.StatusCode.UNAVAILABLE,
                "plugin server is rebuilding its cluster state from the API; retry shortly",
            )


def _device_counts(req: PodRequest) -> frozenset[int]:
    """How many devices each GPU container asks: all the node agent can tell pods apart by."""
    return frozenset(c.count for c in req.containers if c.count > 0)


def _ident(ref: pb.PodRef) -> tuple[str, str]:
    if not ref.name:
        _abort(grpc.StatusCode.INVALID_ARGUMENT, "pod.name is empty")
    bad_name = _bad_pod_name(ref.namespace or "default", ref.name)
    if bad_name:
        _abort(grpc.StatusCode.INVALID_ARGUMENT, f"pod: {bad_name}")
    key = f"{ref.namespace or 'default'}/{ref.name}"
    return ref.uid or key, key


def _check_same_pod(held: str, key: str, ident: str) -> None:
    """The pod ref names the pod its uid was PreFiltered/reserved as: a ref mixing one pod's
    uid with another's name must not reserve, bind or unreserve under the other's name."""
    if held != key:
        _abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"pod ref {key} (uid {ident}) does not match pod {held}, which that uid was "
            "scheduled as",
        )


# What the API server accepts (a namespace is a DNS-1123 label, a pod name a DNS-1123
# subdomain). Names end up in API paths (PreBind's patch, events): anything else is refused.
_NAMESPACE_RE = re.compile(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_POD_NAME_RE = re.compile(r"\A[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


def _bad_pod_name(namespace: object, name: object) -> str:
    """Why ``namespace``/``name`` is not a Kubernetes pod's, or ""."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        return f"namespace {short_repr(namespace)} is not a valid Kubernetes namespace"
    if not isinstance(name, str) or not _POD_NAME_RE.match(name):
        return f"name {short_repr(name)} is not a valid Kubernetes pod name"
    return ""


def _put(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _MAX_CACHED:
        cache.popitem(last=False)


def _no_longer_fits(decision: Decision, key: str, node: str) -> str:
    i = decision.node_index(node)
    if i < 0:
        return f"node {node} has no GPUs Tessera knows of for pod {key}"
    why = "; ".join(reason_names(int(decision.reasons[i]))) or "does not fit"
    return f"node {node} no longer fits pod {key}: {why}"


def _pod_key(request: object) -> str | None:
    """``namespace/name`` of the request's pod, for logs."""
    ref = getattr(request, "pod", None)
    if ref is None or not ref.name:
        return None
    return f"{ref.namespace or 'default'}/{ref.name}"


def _handle(
    fn: Callable[[Req, grpc.ServicerContext], Resp],
    request: Req,
    context: grpc.ServicerContext,
    method: str,
    tracing: Tracing,
    metrics: SchedulingMetrics,
) -> Resp:
    started = time.perf_counter()
    code = grpc.StatusCode.OK
    with tracing.server_span(method, context, request) as span:
        try:
            response = fn(request, context)
        except _Abort as e:
            code = e.code
            record_abort(span, e.code, e.message)
            context.abort(e.code, e.message)
        except Exception as e:
            code = grpc.StatusCode.INTERNAL
            log.exception("handler failed", method=method, pod=_pod_key(request), error=repr(e))
            record_abort(span, grpc.StatusCode.INTERNAL, repr(e))
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {e!r}")
        finally:
            metrics.observe_rpc(method, code.name, time.perf_counter() - started)
        record_response(span, response)
        return response
