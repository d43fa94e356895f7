"""The gRPC servicer of the plugin protocol: translates messages to the reservation lifecycle
(``core.reservations``) and back, and its errors to status codes the shim acts on.

Every handler checks the protocol version and (but Unreserve: after a restart nothing is
reserved) that the state has been rebuilt from the API; pod refs and pod JSON are validated
here, so the core only sees well-formed pods. FilterWhatIf answers kube-scheduler's
preemption dry runs (Filter while pods count as removed or added) on one node. The servicer
records metrics and Unschedulable events; the lifecycle decides, reserves and binds.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, NoReturn, Protocol, TypeVar

import grpc
import orjson
import structlog

from api.errors import InvalidInputError, short_repr
from api.kube.objects import nominated_node, pod_key
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.hostonly import wants_placing
from scheduler_plugins.core.requests import PodRequest, parse_request
from scheduler_plugins.core.reservations import (
    DEFAULT_PREBIND_WAIT_S,
    Added,
    NoDecision,
    PodWriter,
    Reservations,
    RetryLater,
    ScheduleAgain,
    WaitYourTurn,
    WriteFailed,
    WrongPod,
)
from scheduler_plugins.core.whatif import UnknownNode
from scheduler_plugins.server.events import EventRecorder, EventTarget
from scheduler_plugins.server.metrics import SchedulingMetrics
from scheduler_plugins.server.tracing import Tracing, record_abort, record_response

log = structlog.get_logger("tessera.plugin_server")

# PreBind's "not yet, nothing written, the reservation stands: ask again" (its node is still
# allocating an earlier pod the node agent could not tell apart, and this call's wait ended
# or no worker is free to wait). The shim sleeps and asks again until its bind deadline
# instead of failing the binding cycle (a failed cycle is a requeue, an event and a status
# write, and the next attempt queues at the back again).
WAIT_ELSEWHERE: Final = grpc.StatusCode.RESOURCE_EXHAUSTED

# The lifecycle's errors as status codes, most specific first.
_CODES: Final[tuple[tuple[type[Exception], grpc.StatusCode], ...]] = (
    (WrongPod, grpc.StatusCode.INVALID_ARGUMENT),
    (ScheduleAgain, grpc.StatusCode.ABORTED),
    (WaitYourTurn, WAIT_ELSEWHERE),
    (RetryLater, grpc.StatusCode.UNAVAILABLE),
    (WriteFailed, grpc.StatusCode.INTERNAL),
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _InvalidPod(Exception):
    """A pod in a request is not one Tessera can read; the message says why."""


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _abort(code: grpc.StatusCode, message: str) -> NoReturn:
    raise _Abort(code, message)


class _GrpcCall:
    """A gRPC call as the lifecycle's ``Call``."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def is_active(self) -> bool:
        return bool(self._context.is_active())

    def time_remaining(self) -> float | None:
        remaining = self._context.time_remaining()
        return None if remaining is None else float(remaining)

    def on_end(self, callback: Callable[[], None]) -> None:
        self._context.add_callback(callback)


class GangRecorder(Protocol):
    """What the servicer tells about gangs (``server.gangs.GangReporter``)."""

    def offered(self, pod: Mapping[str, Any], key: str, why_not: str | None) -> None: ...

    def released(self, key: str) -> None: ...


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """``ready`` gates every answer but Unreserve: before it the state is not rebuilt yet."""

    def __init__(
        self,
        cache: ClusterCache,
        kube: PodWriter,
        ready: threading.Event,
        *,
        events: EventRecorder | None = None,
        prebind_wait_s: float = DEFAULT_PREBIND_WAIT_S,
        max_prebind_waiters: int = 16,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
        metrics: SchedulingMetrics | None = None,
        gangs: GangRecorder | None = None,
    ) -> None:
        self._cache = cache
        self._ready = ready
        self._events = events
        self._gangs = gangs
        self._tracing = tracing or Tracing.off()
        self._metrics = metrics if metrics is not None else SchedulingMetrics()
        self._lifecycle = Reservations(
            cache,
            kube,
            wall_clock=wall_clock,
            clock=clock,
            cpu_clock=time.thread_time,
            prebind_wait_s=prebind_wait_s,
            max_prebind_waiters=max_prebind_waiters,
            spans=self._tracing,
            on_reserved=self._metrics.reserved,
        )
        # A Cycle request's call (its oneof field): the method it stands for, and its handler.
        self._cycle_calls: dict[str, tuple[str, Callable[[Any, grpc.ServicerContext], Any]]] = {
            "pre_filter": ("PreFilter", self._prefilter),
            "reserve": ("Reserve", self._reserve),
        }

    @property
    def reservations_held(self) -> int:
        return self._lifecycle.held

    # ----- protocol ----------------------------------------------------------------------

    def PreFilter(
        self, request: pb.PreFilterRequest, context: grpc.ServicerContext
    ) -> pb.PreFilterResponse:
        return _handle(self._prefilter, request, context, "PreFilter", self._tracing, self._metrics)

    def Cycle(
        self, requests: Iterator[pb.CycleRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.CycleResponse]:
        """The scheduling cycle's calls, answered one at a time in the order they come (a
        request's ``before`` calls first, answered in its response): a Reserve is counted
        before the PreFilter sent after it, or with it, decides."""
        for request in requests:
            self._metrics.count_cycle_message(len(request.before))
            earlier = [self._cycle_call_alone(call, context) for call in request.before]
            response = self._cycle_call(request, context)
            response.before.extend(earlier)
            response.handles_before = True
            yield response

    def _cycle_call_alone(
        self, request: pb.CycleRequest, context: grpc.ServicerContext
    ) -> pb.CycleResponse:
        """A call of a request's ``before``: one that has no ``before`` of its own."""
        if request.before:
            return pb.CycleResponse(
                id=request.id,
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                message=f"Cycle request {request.id} is sent in another's before and has "
                f"{len(request.before)} before calls of its own; nest at most one level",
            )
        return self._cycle_call(request, context)

    def _cycle_call(
        self, request: pb.CycleRequest, context: grpc.ServicerContext
    ) -> pb.CycleResponse:
        call = request.WhichOneof("call")
        if call is None:
            return pb.CycleResponse(
                id=request.id,
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                message=f"Cycle request {request.id} carries no call (pre_filter or reserve)",
            )
        method, handler = self._cycle_calls[call]
        trace = request.trace_context.items() if self._tracing.enabled else None
        try:
            answer = _run(
                handler,
                getattr(request, call),
                context,
                method,
                trace,
                self._tracing,
                self._metrics,
            )
        except _Abort as e:
            return pb.CycleResponse(id=request.id, code=e.code.value[0], message=e.message)
        answers: dict[str, Any] = {call: answer}
        return pb.CycleResponse(id=request.id, **answers)

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

    def FilterWhatIf(
        self, request: pb.FilterWhatIfRequest, context: grpc.ServicerContext
    ) -> pb.FilterWhatIfResponse:
        return _handle(
            self._filter_what_if, request, context, "FilterWhatIf", self._tracing, self._metrics
        )

    # ----- handlers ----------------------------------------------------------------------

    def _prefilter(
        self, request: pb.PreFilterRequest, context: grpc.ServicerContext
    ) -> pb.PreFilterResponse:
        response = self._decide(request)
        self._metrics.count_answer(response.code)
        return response

    def _decide(self, request: pb.PreFilterRequest) -> pb.PreFilterResponse:
        self._check_version(request.version)
        self._check_ready()
        try:
            pod, req = self._read_pod(request.pod_json, request.pod)
        except _InvalidPod as e:
            return pb.PreFilterResponse(code=pb.PreFilterResponse.INVALID, message=str(e))
        if not wants_placing(req):
            return pb.PreFilterResponse(code=pb.PreFilterResponse.SKIP)
        meta = pod["metadata"]
        offer = _call(
            self._lifecycle.offer,
            req,
            meta,
            pod.get("spec"),
            request.candidate_nodes,
            nominated_node(pod),
        )
        self._metrics.observe_decision(offer.wall_s, offer.pending, cpu_seconds=offer.cpu_s)
        if not req.wants_gpu and not offer.nodes:
            # kube-scheduler's NodeResourcesFit says why, and its preemption may make room.
            return pb.PreFilterResponse(code=pb.PreFilterResponse.SKIP)
        if self._gangs is not None and req.wants_gpu:
            self._gangs.offered(pod, req.key, None if offer.nodes else offer.why)
        if not offer.nodes:
            if self._events is not None:
                ns, _, name = req.key.partition("/")
                self._events.unschedulable(EventTarget(ns, name, req.uid), offer.why)
            return pb.PreFilterResponse(
                code=pb.PreFilterResponse.UNSCHEDULABLE,
                message=offer.why,
                infeasible_message=offer.per_node,
                decision_id=offer.decision_id,
                preemptible_nodes=offer.preemptible,
            )
        return pb.PreFilterResponse(
            code=pb.PreFilterResponse.OK,
            feasible_nodes=offer.nodes,
            scores=offer.scores,
            infeasible_message=offer.per_node,
            decision_id=offer.decision_id,
            feasible_total=offer.feasible_total,
            preemptible_nodes=offer.preemptible,
        )

    def _filter_what_if(
        self, request: pb.FilterWhatIfRequest, context: grpc.ServicerContext
    ) -> pb.FilterWhatIfResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        if not request.node:
            _abort(grpc.StatusCode.INVALID_ARGUMENT, "node is empty")

        def pod() -> PodRequest | None:
            # Read only when the decision is no longer held (the shim always sends it: most
            # dry runs need not parse it).
            return self._read_pod(request.pod_json, request.pod)[1] if request.pod_json else None

        try:
            added = [
                self._added(raw, f"added_pods_json[{i}]")
                for i, raw in enumerate(request.added_pods_json)
            ]
            verdict = self._lifecycle.what_if(
                ident,
                key,
                request.decision_id,
                pod,
                request.node,
                list(request.removed_pod_uids),
                added,
            )
        except _InvalidPod as e:
            _abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoDecision as e:
            _abort(grpc.StatusCode.NOT_FOUND, f"{e}; send pod_json")
        except UnknownNode as e:
            _abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Exception as e:
            _translate(e)
        return pb.FilterWhatIfResponse(fits=verdict.fits, message=verdict.message)

    def _read_pod(self, pod_json: bytes, ref: pb.PodRef) -> tuple[dict[str, Any], PodRequest]:
        """The pod a request carries as JSON, its metadata completed from ``ref``, and what
        it asks; ``_InvalidPod`` says what is wrong with it."""
        pod = _json(pod_json, "pod_json")
        if not isinstance(pod, dict):
            raise _InvalidPod("pod_json is not a JSON object")
        meta = pod.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _InvalidPod("pod metadata is not an object")
        for field, value in (("namespace", ref.namespace), ("name", ref.name), ("uid", ref.uid)):
            if value and not meta.get(field):
                meta[field] = value
        bad_name = _bad_pod_name(meta.get("namespace") or "default", meta.get("name"))
        if bad_name:
            raise _InvalidPod(f"pod_json: {bad_name}")
        try:
            return pod, parse_request(pod, self._cache.state.config)
        except InvalidInputError as e:
            raise _InvalidPod(str(e)) from None

    def _added(self, raw: bytes, what: str) -> Added:
        """A pod a dry run counts as placed on the node: its uid, and what it asks of Tessera
        (None when its GPU request is invalid: Tessera would never place it)."""
        pod = _json(raw, what)
        if not isinstance(pod, dict) or not isinstance(pod.get("metadata", {}), dict):
            raise _InvalidPod(f"{what} is not a Pod object")
        uid = pod.get("metadata", {}).get("uid")
        try:
            request: PodRequest | None = parse_request(pod, self._cache.state.config)
        except InvalidInputError as e:
            log.info(
                "added pod takes nothing: its request is invalid", pod=pod_key(pod), error=str(e)
            )
            request = None
        return Added(uid if isinstance(uid, str) else "", request)

    def _explain(
        self, request: pb.ExplainRequest, context: grpc.ServicerContext
    ) -> pb.ExplainResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        try:
            message = self._lifecycle.explain(ident, key, request.decision_id)
        except NoDecision as e:
            _abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Exception as e:
            _translate(e)
        return pb.ExplainResponse(message=message)

    def _reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        try:
            handed = self._lifecycle.reserve(
                ident,
                key,
                request.node,
                request.decision_id,
                hand_over=request.hand_over and not request.trial,
                trial=request.trial,
            )
        except NoDecision as e:
            _abort(grpc.StatusCode.ABORTED, f"{e}; schedule it again")
        except Exception as e:
            _translate(e)
        if handed is None:
            return pb.ReserveResponse()
        return pb.ReserveResponse(annotations=handed.annotations, labels=handed.labels)

    def _unreserve(
        self, request: pb.UnreserveRequest, context: grpc.ServicerContext
    ) -> pb.UnreserveResponse:
        # Idempotent and answered before ready too: after a restart nothing is reserved.
        self._check_version(request.version)
        ident, key = _ident(request.pod)
        _call(self._lifecycle.unreserve, ident, key, request.node)
        if request.gang_released and self._gangs is not None:
            self._gangs.released(key)
        return pb.UnreserveResponse()

    def _prebind(
        self, request: pb.PreBindRequest, context: grpc.ServicerContext
    ) -> pb.PreBindResponse:
        self._check_version(request.version)
        self._check_ready()
        ident, key = _ident(request.pod)
        handed = _call(
            self._lifecycle.prebind,
            ident,
            key,
            request.node,
            request.pod.uid,
            _GrpcCall(context),
            hand_over=request.hand_over,
        )
        return pb.PreBindResponse(annotations=handed.annotations, labels=handed.labels)

    # ----- checks ------------------------------------------------------------------------

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


def _json(raw: bytes, what: str) -> Any:
    """``raw`` decoded (orjson: a third of the standard library's time on a pod), else
    ``_InvalidPod`` naming ``what`` and the problem."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:  # also invalid UTF-8
        if str(e).startswith("depth limit exceeded"):
            raise _InvalidPod(f"{what} is nested too deeply") from None
        raise _InvalidPod(f"{what} is not JSON: {e}") from None


T = TypeVar("T")


def _call(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)``, its lifecycle errors as aborts with their status codes."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        _translate(e)


def _translate(e: Exception) -> NoReturn:
    for kind, code in _CODES:
        if isinstance(e, kind):
            _abort(code, str(e))
    raise e


def _ident(ref: pb.PodRef) -> tuple[str, str]:
    if not ref.name:
        _abort(grpc.StatusCode.INVALID_ARGUMENT, "pod.name is empty")
    bad_name = _bad_pod_name(ref.namespace or "default", ref.name)
    if bad_name:
        _abort(grpc.StatusCode.INVALID_ARGUMENT, f"pod: {bad_name}")
    key = f"{ref.namespace or 'default'}/{ref.name}"
    return ref.uid or key, key


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
    """A unary call: ``_run``, its failure as the call's status."""
    trace = context.invocation_metadata() if tracing.enabled else None
    try:
        return _run(fn, request, context, method, trace, tracing, metrics)
    except _Abort as e:
        context.abort(e.code, e.message)


def _run(
    fn: Callable[[Req, grpc.ServicerContext], Resp],
    request: Req,
    context: grpc.ServicerContext,
    method: str,
    trace: Iterable[tuple[str, str | bytes]] | None,
    tracing: Tracing,
    metrics: SchedulingMetrics,
) -> Resp:
    """``fn``'s answer to one call of ``method``, in its span (a child of ``trace``'s), timed;
    a failure is an ``_Abort`` with its status code (an unexpected error: INTERNAL, logged)."""
    started = time.perf_counter()
    code = grpc.StatusCode.OK
    with tracing.server_span(method, trace, request) as span:
        try:
            response = fn(request, context)
        except _Abort as e:
            code = e.code
            record_abort(span, e.code, e.message)
            raise
        except Exception as e:
            code = grpc.StatusCode.INTERNAL
            log.exception("handler failed", method=method, pod=_pod_key(request), error=repr(e))
            record_abort(span, grpc.StatusCode.INTERNAL, repr(e))
            raise _Abort(grpc.StatusCode.INTERNAL, f"{method} failed: {e!r}") from e
        finally:
            metrics.observe_rpc(method, code.name, time.perf_counter() - started)
        record_response(span, response)
        return response
