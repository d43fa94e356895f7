"""Hostile plugin-protocol messages (``api/plugin/v1``) reaching the plugin server.

- Direct: the real ``SchedulerServicer`` called with random fields (versions, pod refs,
  pod JSON, nodes, decision ids, FilterWhatIf's removed and added pods), in random call
  sequences, and with random bytes decoded as
  request messages. Every call answers or aborts with a status other than INTERNAL/UNKNOWN
  and a message; nothing is left reserved once every fuzzed pod is unreserved, and the
  running pods' records never change.
- Wire: a real gRPC server on a Unix socket fed raw payload bytes (valid HTTP/2, garbage
  protobuf), unknown methods, and non-HTTP/2 garbage on the socket itself; afterwards it
  still answers a well-formed PreFilter.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st

from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.server.servicer import SchedulerServicer
from tests.builders import make_pod
from tests.fuzzing import (
    NODES,
    VICTIM_KEYS,
    VICTIMS,
    FuzzLedger,
    cluster,
    fuzz_settings,
    hostile_variant,
)

V1 = pb.PROTOCOL_VERSION_1
METHODS = ("PreFilter", "Reserve", "Unreserve", "PreBind", "Explain", "FilterWhatIf")
REQUEST_TYPES: dict[str, type[Message]] = {
    "PreFilter": pb.PreFilterRequest,
    "Reserve": pb.ReserveRequest,
    "Unreserve": pb.UnreserveRequest,
    "PreBind": pb.PreBindRequest,
    "Explain": pb.ExplainRequest,
    "FilterWhatIf": pb.FilterWhatIfRequest,
}
FUZZ_PODS = ("fz-1", "fz-2", "fz-3")
# Codes the shim acts on; INTERNAL and UNKNOWN would mean a handler crashed.
CLEAR_CODES = frozenset(grpc.StatusCode) - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FakeContext:
    """The ``grpc.ServicerContext`` calls a handler makes; ``abort`` raises like grpc's."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return 1.0

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True  # the fuzzed call never ends from the client's side

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return ()

    def peer(self) -> str:
        return "unix:fuzz"


class RecordingKube:
    """Accepts every patch (PreBind, Unreserve) and event; every pod reads as unbound."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.patches: list[tuple[str, Any]] = []

    def get(self, path: str) -> Any:
        return {"metadata": {"resourceVersion": "1"}, "spec": {}}

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        with self.lock:
            self.patches.append((path, patch))
        return {}

    def post(self, path: str, body: object) -> Any:
        return {}


@dataclass
class Server:
    cache: ClusterCache
    servicer: SchedulerServicer
    kube: RecordingKube


def make_server() -> Server:
    cache = cluster()
    kube = RecordingKube()
    ready = threading.Event()
    ready.set()
    servicer = SchedulerServicer(cache, kube, ready, prebind_wait_s=0.0, wall_clock=lambda: 1e9)
    return Server(cache, servicer, kube)


# ----- hostile messages ----------------------------------------------------------------------

names = st.sampled_from([*FUZZ_PODS, *VICTIMS, ""]) | st.text(max_size=12)
pod_refs = st.builds(
    pb.PodRef,
    namespace=st.sampled_from(["default", "", "kube-system"]) | st.text(max_size=10),
    name=names,
    uid=st.sampled_from(["", "uid-1"]) | st.text(max_size=8),
)
versions = st.sampled_from([V1, V1, V1, 0, 2]) | st.integers(-(2**31), 2**31 - 1)
node_names = st.sampled_from([*NODES, "node-x", ""]) | st.text(max_size=10)
decision_ids = st.sampled_from([0, 1, 2, 3]) | st.integers(0, 2**64 - 1)


@st.composite
def pod_json(draw: st.DrawFn, name: str) -> bytes:
    builder = make_pod(name if draw(st.booleans()) else draw(names))
    for _ in range(draw(st.integers(0, 2))):
        builder.gpu(draw(st.integers(0, 3)), mem=draw(st.sampled_from([None, 1000, 9000])))
    if draw(st.booleans()):
        builder.mode(draw(st.sampled_from(["mig", "hami-core"])))
    canonical = json.dumps(builder.build())
    how = draw(st.sampled_from(["valid", "hostile", "bytes"]))
    if how == "valid":
        return canonical.encode()
    if how == "hostile":
        return hostile_variant(canonical, draw(st.data()), is_json=True).encode("utf-8", "replace")
    return draw(st.binary(max_size=200))


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, Message]:
    method = draw(st.sampled_from(METHODS))
    ref = draw(pod_refs)
    if method in ("PreFilter", "Reserve") and ref.name in VICTIMS:
        ref.name = FUZZ_PODS[0]  # a bound pod is never scheduled again
    version = draw(versions)
    if method == "PreFilter":
        return method, pb.PreFilterRequest(
            version=version, pod=ref, pod_json=draw(pod_json(ref.name))
        )
    if method == "Reserve":
        return method, pb.ReserveRequest(
            version=version,
            pod=ref,
            node=draw(node_names),
            decision_id=draw(decision_ids),
            hand_over=draw(st.booleans()),
        )
    if method == "Explain":
        return method, pb.ExplainRequest(version=version, pod=ref, decision_id=draw(decision_ids))
    if method == "FilterWhatIf":
        return method, pb.FilterWhatIfRequest(
            version=version,
            pod=ref,
            decision_id=draw(decision_ids),
            pod_json=draw(st.just(b"") | pod_json(ref.name)),
            node=draw(node_names),
            removed_pod_uids=draw(st.lists(st.sampled_from(["", "uid-1"]) | names, max_size=3)),
            added_pods_json=draw(st.lists(pod_json(ref.name), max_size=2)),
        )
    request_type = pb.UnreserveRequest if method == "Unreserve" else pb.PreBindRequest
    return method, request_type(version=version, pod=ref, node=draw(node_names))


@st.composite
def cycles(draw: st.DrawFn) -> list[tuple[str, Message]]:
    """A scheduling cycle as the shim runs it (PreFilter, Reserve, PreBind, maybe Unreserve),
    with at most one field of one call made hostile."""
    name = draw(st.sampled_from(FUZZ_PODS))
    ref = pb.PodRef(namespace="default", name=name, uid=f"uid-{name}")
    builder = make_pod(name)
    for _ in range(draw(st.integers(1, 2))):
        builder.gpu(draw(st.integers(1, 2)), mem=draw(st.sampled_from([None, 1000, 9000])))
    if draw(st.booleans()):
        builder.mode(draw(st.sampled_from(["mig", "hami-core"])))
    node = draw(st.sampled_from(sorted(NODES)))
    out: list[tuple[str, Message]] = [
        ("PreFilter", pb.PreFilterRequest(
            version=V1, pod=ref, pod_json=json.dumps(builder.build()).encode()
        )),
        ("Reserve", pb.ReserveRequest(
            version=V1, pod=ref, node=node, decision_id=draw(st.integers(0, 4)),
            hand_over=draw(st.booleans()),
        )),
        ("PreBind", pb.PreBindRequest(version=V1, pod=ref, node=node)),
    ]  # fmt: skip
    if draw(st.booleans()):  # the cycle failed elsewhere: PostFilter asks why
        out.insert(1, ("Explain", pb.ExplainRequest(
            version=V1, pod=ref, decision_id=draw(st.integers(0, 4))
        )))  # fmt: skip
    if draw(st.booleans()):  # ... and preemption's dry run asks about a node
        out.insert(1, ("FilterWhatIf", pb.FilterWhatIfRequest(
            version=V1, pod=ref, decision_id=draw(st.integers(0, 4)), node=node,
            removed_pod_uids=draw(st.lists(st.sampled_from(["uid-1", "uid-2", ""]), max_size=2)),
        )))  # fmt: skip
    if draw(st.booleans()):
        out.append(("Unreserve", pb.UnreserveRequest(version=V1, pod=ref, node=node)))
    if draw(st.booleans()):
        request: Any = out[draw(st.integers(0, len(out) - 1))][1]
        field = draw(st.sampled_from(["version", "name", "uid", "node"]))
        if field == "version":
            request.version = draw(versions)
        elif field in ("name", "uid"):
            value = draw(names)
            setattr(request.pod, field, "fz-x" if value in VICTIMS else value)
        elif hasattr(request, "node"):
            request.node = draw(node_names)
    return out


call_sequences = st.lists(
    st.lists(calls(), min_size=1, max_size=2) | cycles(), min_size=1, max_size=4
).map(lambda chunks: [c for chunk in chunks for c in chunk])


def call(server: Server, method: str, request: Message) -> tuple[str, str]:
    """("ok", "") or ("aborted", details); anything else escapes as a crash."""
    try:
        getattr(server.servicer, method)(request, FakeContext())
    except Aborted as e:
        assert e.code in CLEAR_CODES, e
        assert e.details.strip(), e
        return "aborted", e.details
    return "ok", ""


def unreserve_all(server: Server, refs: Sequence[pb.PodRef]) -> None:
    for ref in refs:
        try:
            server.servicer.Unreserve(pb.UnreserveRequest(version=V1, pod=ref), FakeContext())
        except Aborted as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e  # a name no pod can have


# ----- direct calls -------------------------------------------------------------------------------


@fuzz_settings(100)
@given(sequence=call_sequences)
def test_hostile_call_sequences_answer_clearly_and_leave_nothing_behind(
    fuzz_ledger: FuzzLedger, sequence: list[tuple[str, Message]]
) -> None:
    server = make_server()
    before = server.cache.state.usage_snapshot()
    victims_before = {k: server.cache.state.allocation(k) for k in VICTIM_KEYS}
    for method, request in sequence:
        with fuzz_ledger.case(f"plugin-protocol/{method}") as case:
            outcome, details = call(server, method, request)
            if outcome == "aborted":
                case.rejected(details)
            assert {k: server.cache.state.allocation(k) for k in VICTIM_KEYS} == victims_before
    refs = [r.pod for _, r in sequence]  # type: ignore[attr-defined]
    unreserve_all(server, refs)
    assert server.cache.state.usage_snapshot() == before


@fuzz_settings(100)
@given(
    method=st.sampled_from(METHODS),
    # Half of them start with "version: 1" (field 1, varint 1) to get past the version check.
    raw=st.binary(max_size=300) | st.binary(max_size=300).map(lambda b: b"\x08\x01" + b),
)
def test_random_bytes_as_messages_are_refused_or_answered(
    fuzz_ledger: FuzzLedger, method: str, raw: bytes
) -> None:
    server = make_server()
    before = server.cache.state.usage_snapshot()
    with fuzz_ledger.case("plugin-protocol/raw-message") as case:
        try:
            request = REQUEST_TYPES[method].FromString(raw)
        except DecodeError as e:
            case.rejected(f"not a {method}Request: {e}")  # grpc: "Exception deserializing"
            return
        outcome, details = call(server, method, request)
        if outcome == "aborted":
            case.rejected(details)
        unreserve_all(server, [request.pod])  # type: ignore[attr-defined]
        assert server.cache.state.usage_snapshot() == before


_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_CYCLE_FIELDS = {"PreFilter": "pre_filter", "Reserve": "reserve"}


class CycleStream:
    """One Cycle stream into the servicer, driven call by call in this thread."""

    def __init__(self, servicer: SchedulerServicer) -> None:
        self._out: queue.SimpleQueue[pb.CycleRequest | None] = queue.SimpleQueue()
        self._answers = servicer.Cycle(iter(self._out.get, None), FakeContext())  # type: ignore[arg-type]
        self._next = 0

    def call(self, request: pb.CycleRequest) -> pb.CycleResponse:
        self._next += 1
        request.id = self._next
        self._out.put(request)
        answer = next(self._answers)
        assert answer.id == self._next, (answer.id, self._next)
        return answer

    def close(self) -> None:
        self._out.put(None)
        assert next(self._answers, None) is None  # the stream ends when the shim's does


def _check_cycle_answer(case: Any, request: pb.CycleRequest, answer: pb.CycleResponse) -> None:
    """OK with the call's answer, or a clear status code and a message saying why."""
    if answer.code == 0:
        call = request.WhichOneof("call")
        assert call is not None and answer.WhichOneof("answer") == call, (request, answer)
        return
    code = _BY_VALUE.get(answer.code)
    assert code in CLEAR_CODES, (answer.code, answer.message)
    assert answer.message.strip(), answer
    assert answer.WhichOneof("answer") is None
    case.rejected(f"{code.name}: {answer.message}")


@fuzz_settings(100)
@given(sequence=call_sequences, held=st.lists(st.booleans(), min_size=8, max_size=8))
def test_hostile_sequences_over_the_cycle_stream_answer_every_call(
    fuzz_ledger: FuzzLedger, sequence: list[tuple[str, Message]], held: list[bool]
) -> None:
    """The shim's stream carries PreFilter and Reserve, some held back to travel in the next
    call's ``before`` as the shim sends them; the rest stay single calls. A bad request is
    its answer's code, never the stream's end."""
    server = make_server()
    before = server.cache.state.usage_snapshot()
    victims_before = {k: server.cache.state.allocation(k) for k in VICTIM_KEYS}
    stream = CycleStream(server.servicer)
    waiting: list[pb.CycleRequest] = []  # held back: sent in the next Cycle call's before

    def send(cycle_request: pb.CycleRequest, case: Any) -> None:
        cycle_request.before.extend(waiting)
        answer = stream.call(cycle_request)
        assert [a.id for a in answer.before] == [r.id for r in waiting], answer
        for earlier, earlier_answer in zip(waiting, answer.before, strict=True):
            _check_cycle_answer(case, earlier, earlier_answer)
        waiting.clear()
        _check_cycle_answer(case, cycle_request, answer)

    for i, (method, request) in enumerate(sequence):
        field = _CYCLE_FIELDS.get(method)
        label = f"plugin-protocol/{'Cycle/' if field else ''}{method}"
        with fuzz_ledger.case(label) as case:
            if field is None:
                if waiting:  # a held call goes before any single call, as the shim's do
                    send(waiting.pop(), case)
                outcome, details = call(server, method, request)
                if outcome == "aborted":
                    case.rejected(details)
            elif held[i % len(held)]:
                waiting.append(pb.CycleRequest(id=10_000 + i, **{field: request}))
            else:
                send(pb.CycleRequest(**{field: request}), case)
            assert {k: server.cache.state.allocation(k) for k in VICTIM_KEYS} == victims_before
    if waiting:
        with fuzz_ledger.case("plugin-protocol/Cycle/held") as case:
            send(waiting.pop(), case)
    stream.close()
    unreserve_all(server, [r.pod for _, r in sequence])  # type: ignore[attr-defined]
    assert server.cache.state.usage_snapshot() == before


@fuzz_settings(100)
@given(
    raw=st.binary(max_size=300)
    | st.binary(max_size=300).map(lambda b: b"\x12\x02\x08\x01" + b)  # a PreFilter
    | st.binary(max_size=300).map(lambda b: b"\x2a\x04\x1a\x02\x08\x01" + b)  # a Reserve before
)
def test_random_bytes_as_cycle_requests_are_refused_or_answered(
    fuzz_ledger: FuzzLedger, raw: bytes
) -> None:
    server = make_server()
    before = server.cache.state.usage_snapshot()
    stream = CycleStream(server.servicer)
    with fuzz_ledger.case("plugin-protocol/Cycle/raw-message") as case:
        try:
            request = pb.CycleRequest.FromString(raw)
        except DecodeError as e:
            case.rejected(f"not a CycleRequest: {e}")
            return
        answer = stream.call(request)
        _check_cycle_answer(case, request, answer)
        assert [a.id for a in answer.before] == [r.id for r in request.before], answer
        for earlier, earlier_answer in zip(request.before, answer.before, strict=True):
            _check_cycle_answer(case, earlier, earlier_answer)
        for r in (*request.before, request):
            call_ = r.WhichOneof("call")
            if call_ is not None:
                unreserve_all(server, [getattr(r, call_).pod])
    stream.close()
    assert server.cache.state.usage_snapshot() == before


def test_valid_sequence_still_schedules_after_garbage() -> None:
    """The fuzzed server is not just refusing everything: a normal cycle goes through."""
    server = make_server()
    call(server, "PreFilter", pb.PreFilterRequest(version=V1, pod_json=b"[" * 5000))
    pod = make_pod("fz-ok").gpu(1, mem=1000).build()
    ref = pb.PodRef(namespace="default", name="fz-ok", uid="uid-ok")
    r = server.servicer.PreFilter(
        pb.PreFilterRequest(version=V1, pod=ref, pod_json=json.dumps(pod).encode()), FakeContext()
    )
    assert r.code == pb.PreFilterResponse.OK, r.message
    node = r.feasible_nodes[0]
    server.servicer.Reserve(
        pb.ReserveRequest(version=V1, pod=ref, node=node, decision_id=r.decision_id),
        FakeContext(),
    )
    answer = server.servicer.PreBind(
        pb.PreBindRequest(version=V1, pod=ref, node=node), FakeContext()
    )
    assert answer.annotations["hami.io/vgpu-node"] == node


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        (pb.PodRef(namespace="default", name="a/../../nodes/n"), "not a valid Kubernetes pod name"),
        (pb.PodRef(namespace="x/y", name="p"), "not a valid Kubernetes namespace"),
        (pb.PodRef(namespace="default", name="P" * 300), "not a valid Kubernetes pod name"),
        (pb.PodRef(namespace="default", name=""), "pod.name is empty"),
    ],
)
def test_pod_refs_that_no_pod_can_have_are_refused_by_name(ref: pb.PodRef, problem: str) -> None:
    server = make_server()
    for method in ("Reserve", "Unreserve", "PreBind"):
        with pytest.raises(Aborted) as e:
            getattr(server.servicer, method)(
                REQUEST_TYPES[method](version=V1, pod=ref, node="node-a"), FakeContext()
            )
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and problem in e.value.details
    assert server.kube.patches == []


def test_prefilter_refuses_pod_json_naming_an_impossible_pod() -> None:
    server = make_server()
    pod = make_pod("ok").gpu(1).build()
    pod["metadata"]["name"] = "../x"
    r = server.servicer.PreFilter(
        pb.PreFilterRequest(version=V1, pod_json=json.dumps(pod).encode()), FakeContext()
    )
    assert r.code == pb.PreFilterResponse.INVALID and "not a valid Kubernetes pod name" in r.message
    deep = server.servicer.PreFilter(
        pb.PreFilterRequest(version=V1, pod_json=b"[" * 100_000), FakeContext()
    )
    assert deep.code == pb.PreFilterResponse.INVALID and "nested too deeply" in deep.message


# ----- a real gRPC server on a Unix socket ------------------------------------------------------


@dataclass
class Live:
    server: Server
    socket: Path
    channel: grpc.Channel


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    directory = Path(tempfile.mkdtemp(prefix="tfz-", dir="/tmp"))  # short: sun_path limit
    sock = directory / "plugin.sock"
    srv = make_server()
    executor = ThreadPoolExecutor(4)
    grpc_server = grpc.server(executor)
    pb_grpc.add_SchedulerServicer_to_server(srv.servicer, grpc_server)  # type: ignore[no-untyped-call]
    assert grpc_server.add_insecure_port(f"unix:{sock}")
    grpc_server.start()
    channel = grpc.insecure_channel(f"unix:{sock}")
    try:
        yield Live(srv, sock, channel)
    finally:
        channel.close()
        grpc_server.stop(0).wait()
        executor.shutdown(wait=True)
        shutil.rmtree(directory, ignore_errors=True)


VALID_PREFILTER = pb.PreFilterRequest(
    version=V1,
    pod=pb.PodRef(namespace="default", name="fz-wire", uid="uid-wire"),
    pod_json=json.dumps(make_pod("fz-wire").gpu(1, mem=1000).build()).encode(),
).SerializeToString()


def _corrupt(payload: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    """``payload`` truncated at ``cut`` (0: whole) with some bytes overwritten."""
    out = bytearray(payload[: cut or len(payload)])
    for at, value in flips:
        if out:
            out[at % len(out)] = value
    return bytes(out)


wire_payloads = (
    st.binary(max_size=300)
    | st.sampled_from([b"", b"\x0a\xff\xff\xff\xff\x0f", b"\x1a" * 50])
    | st.builds(
        _corrupt,
        st.just(VALID_PREFILTER),
        st.integers(0, 400),
        st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3),
    )
)


def _healthy(live: Live) -> None:
    stub = pb_grpc.SchedulerStub(live.channel)  # type: ignore[no-untyped-call]
    pod = make_pod("fz-live").gpu(1, mem=1000).build()
    r = stub.PreFilter(
        pb.PreFilterRequest(version=V1, pod_json=json.dumps(pod).encode()), timeout=5
    )
    assert r.code == pb.PreFilterResponse.OK, r.message


@fuzz_settings(100)
@given(method=st.sampled_from([*METHODS, "Nope"]), raw=wire_payloads)
def test_raw_payloads_over_the_socket_get_a_status(
    fuzz_ledger: FuzzLedger, live: Live, method: str, raw: bytes
) -> None:
    rpc = live.channel.unary_unary(f"/tessera.plugin.v1.Scheduler/{method}")
    with fuzz_ledger.case("plugin-protocol/grpc-wire") as case:
        try:
            rpc(raw, timeout=5)
        except grpc.RpcError as e:
            assert isinstance(e, grpc.Call)
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.INTERNAL:
                # grpc's own answer to a payload that is not the request message; a handler
                # crash would read "<Method> failed: …" instead.
                assert "deserializ" in details.lower(), details
            else:
                assert code in CLEAR_CODES, (code, details)
            case.rejected(f"{code.name}: {details or 'no details'}")


@fuzz_settings(40)
@given(
    garbage=st.binary(min_size=1, max_size=400)
    | st.builds(lambda b: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b, st.binary(max_size=200))
)
def test_non_grpc_garbage_on_the_socket_leaves_the_server_serving(
    fuzz_ledger: FuzzLedger, live: Live, garbage: bytes
) -> None:
    with fuzz_ledger.case("plugin-protocol/socket-garbage") as case:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(live.socket))
            try:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except OSError as e:
                case.rejected(f"connection closed by the server: {e}")
        _healthy(live)


def test_a_ref_mixing_one_pods_uid_with_anothers_name_is_refused() -> None:
    """Reserve, PreBind and Unreserve find the reservation by uid: a ref with that uid and
    another pod's name must not bind, or strip the bind annotations of, the other pod (nor
    Explain, which answers from the uid's decision, explain it)."""
    server = make_server()
    ref = pb.PodRef(namespace="default", name="fz-1", uid="uid-1")
    pod = make_pod("fz-1").gpu(1, mem=1000).build()
    r = server.servicer.PreFilter(
        pb.PreFilterRequest(version=V1, pod=ref, pod_json=json.dumps(pod).encode()), FakeContext()
    )
    node = r.feasible_nodes[0]
    reserve = pb.ReserveRequest(version=V1, pod=ref, node=node, decision_id=r.decision_id)
    server.servicer.Reserve(reserve, FakeContext())
    server.servicer.PreBind(pb.PreBindRequest(version=V1, pod=ref, node=node), FakeContext())
    victim = VICTIM_KEYS[0]
    record = server.cache.state.allocation(victim)
    mixed = pb.PodRef(namespace="default", name=victim.split("/")[1], uid="uid-1")
    for method in ("Reserve", "PreBind", "Unreserve"):
        with pytest.raises(Aborted) as e:
            getattr(server.servicer, method)(
                REQUEST_TYPES[method](version=V1, pod=mixed, node=node), FakeContext()
            )
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not match pod default/fz-1" in e.value.details
    explain = pb.ExplainRequest(version=V1, pod=mixed, decision_id=r.decision_id)
    with pytest.raises(Aborted) as e:
        server.servicer.Explain(explain, FakeContext())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not match pod default/fz-1" in e.value.details
    assert [path for path, _ in server.kube.patches] == ["/api/v1/namespaces/default/pods/fz-1"]
    assert server.cache.state.allocation(victim) == record
