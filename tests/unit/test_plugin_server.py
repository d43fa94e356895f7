"""The plugin server's servicer through a real gRPC server on a Unix socket, cache fed directly."""

from __future__ import annotations

import json
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.register import GpuDevice, encode
from api.kube.errors import ServerError, UnreachableError
from api.plugin.v1 import plugin_pb2 as pb
from api.plugin.v1 import plugin_pb2_grpc as pb_grpc
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.server.app import PluginServer, ServerAddressError
from scheduler_plugins.server.events import LEGACY_MIG_REASON, REASON, EventRecorder, EventTarget
from scheduler_plugins.server.metrics import SchedulingMetrics
from scheduler_plugins.server.servicer import WAIT_ELSEWHERE, SchedulerServicer
from scheduler_plugins.server.watch import Backoff
from tests.builders import gpu, make_pod, mig_gpu

V1 = pb.PROTOCOL_VERSION_1
BIND_TIME = 1_700_000_000
OK = pb.PreFilterResponse.OK


# ----- fakes and builders ---------------------------------------------------------------------


class FakeKube:
    """Records patches and posts; ``fail_with`` makes the next patch raise."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.posts: list[tuple[str, Any]] = []
        self.fail_with: Exception | None = None
        self.lock = threading.Lock()
        self.objects: dict[str, dict[str, Any]] = {}  # GET answers; default: an unbound pod
        self.get_fails_with: Exception | None = None
        self.hold: threading.Event | None = None

    def get(self, path: str) -> Any:
        with self.lock:
            if self.get_fails_with is not None:
                raise self.get_fails_with
            return self.objects.get(path, {"metadata": {"resourceVersion": "1"}, "spec": {}})

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        if self.hold is not None:  # a slow apiserver: the patch returns when the test says
            self.hold.wait(10)
        with self.lock:
            if self.fail_with is not None:
                e, self.fail_with = self.fail_with, None
                raise e
            self.patches.append((path, json.loads(json.dumps(patch))))
            # Later GETs see the patch's annotations (None removes one), as the API would.
            obj = self.objects.setdefault(path, {"metadata": {"resourceVersion": "1"}, "spec": {}})
            have = obj["metadata"].setdefault("annotations", {})
            for k, v in ((patch.get("metadata") or {}).get("annotations") or {}).items():
                if v is None:
                    have.pop(k, None)
                else:
                    have[k] = v
        return {}

    def post(self, path: str, body: object) -> Any:
        with self.lock:
            self.posts.append((path, body))
        return {}


def node_obj(name: str, *devices: GpuDevice, register: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                ann.NODE_REGISTER: register if register is not None else encode(devices)
            },
        },
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


def bound_pod(
    name: str,
    node: str,
    devices: list[list[tuple[str, int, int]]],
    *,
    phase: str = "Running",
    bind_phase: str = "success",
    to_allocate: list[list[tuple[str, int, int]]] | None = None,
) -> dict[str, Any]:
    def enc(ds: list[list[tuple[str, int, int]]]) -> str:
        return "".join("".join(f"{u},NVIDIA,{m},{c}:" for u, m, c in cs) + ";" for cs in ds)

    pod = make_pod(name)
    for cs in devices:
        pod.gpu(len(cs))
    pod.on(node, phase)
    pod.annotate(ann.VGPU_NODE, node)
    pod.annotate(ann.BIND_PHASE, bind_phase)
    pod.annotate(ann.BIND_TIME, "1700000000")
    pod.annotate(ann.DEVICES_ALLOCATED, enc(devices))
    pod.annotate(ann.DEVICES_TO_ALLOCATE, enc(to_allocate if to_allocate is not None else devices))
    return pod.build()


def ref(name: str) -> pb.PodRef:
    return pb.PodRef(namespace="default", name=name, uid=f"uid-{name}")


def prefilter_req(pod: dict[str, Any]) -> pb.PreFilterRequest:
    name = pod["metadata"]["name"]
    pod["metadata"]["uid"] = f"uid-{name}"
    return pb.PreFilterRequest(version=V1, pod=ref(name), pod_json=json.dumps(pod).encode())


@dataclass
class Harness:
    cache: ClusterCache
    kube: FakeKube
    ready: threading.Event
    stub: pb_grpc.SchedulerStub
    events: EventRecorder
    socket: Path
    metrics: SchedulingMetrics

    def prefilter(self, pod: dict[str, Any], *, limit: int = 0) -> pb.PreFilterResponse:
        """PreFilter; ``limit``: the shim's candidate limit (a pod leaving the choice to
        Tessera), 0 for a pod with placement constraints of its own."""
        req = prefilter_req(pod)
        req.candidate_nodes = limit
        return self.stub.PreFilter(req, timeout=10)  # type: ignore[no-any-return]

    def reserve(
        self, name: str, node: str, decision_id: int = 0, *, hand_over: bool = False
    ) -> pb.ReserveResponse:
        return self.stub.Reserve(  # type: ignore[no-any-return]
            pb.ReserveRequest(
                version=V1, pod=ref(name), node=node, decision_id=decision_id, hand_over=hand_over
            ),
            timeout=10,
        )

    def schedule(self, pod: dict[str, Any], node: str | None = None) -> str:
        """PreFilter + Reserve on ``node`` (default: the highest-scored one)."""
        r = self.prefilter(pod)
        assert r.code == OK, r.message
        if node is None:
            node = r.feasible_nodes[0]  # the best comes first
        self.reserve(pod["metadata"]["name"], node, r.decision_id)
        return node

    def prebind(
        self, name: str, node: str, timeout: float = 10, *, hand_over: bool = False
    ) -> pb.PreBindResponse:
        return self.stub.PreBind(  # type: ignore[no-any-return]
            pb.PreBindRequest(version=V1, pod=ref(name), node=node, hand_over=hand_over),
            timeout=timeout,
        )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tps-", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _harness(
    short_dir: Path, prebind_wait_s: float, ready: bool, max_prebind_waiters: int = 16
) -> Iterator[Harness]:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    kube = FakeKube()
    ev = threading.Event()
    if ready:
        ev.set()
    events = EventRecorder(kube, min_interval_s=60)
    events.start()
    metrics = SchedulingMetrics()
    servicer = SchedulerServicer(
        cache,
        kube,
        ev,
        metrics=metrics,
        events=events,
        prebind_wait_s=prebind_wait_s,
        max_prebind_waiters=max_prebind_waiters,
        wall_clock=lambda: BIND_TIME,
    )
    executor = ThreadPoolExecutor(8)
    server = grpc.server(executor)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    sock = short_dir / "plugin.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{sock}")
    try:
        stub = pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        yield Harness(cache, kube, ev, stub, events, sock, metrics)
    finally:
        channel.close()
        server.stop(0).wait()
        executor.shutdown(wait=True)
        events.stop()


@pytest.fixture
def h(short_dir: Path) -> Iterator[Harness]:
    yield from _harness(short_dir, prebind_wait_s=5.0, ready=True)


@pytest.fixture
def h_short_wait(short_dir: Path) -> Iterator[Harness]:
    yield from _harness(short_dir, prebind_wait_s=0.5, ready=True)


@pytest.fixture
def h_one_waiter(short_dir: Path) -> Iterator[Harness]:
    yield from _harness(short_dir, prebind_wait_s=5.0, ready=True, max_prebind_waiters=1)


@pytest.fixture
def h_not_ready(short_dir: Path) -> Iterator[Harness]:
    yield from _harness(short_dir, prebind_wait_s=5.0, ready=False)


def _code(e: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return e.value.code()


def _details(e: pytest.ExceptionInfo[grpc.RpcError]) -> str:
    return str(e.value.details())


def seed_cluster(cache: ClusterCache) -> None:
    """Seed 004: node1 3/4 slots, 240/400 cores, 20480/32768 MiB; node2 2/4, 120, 8192."""
    cache.apply_node(node_obj("node1", *(gpu(f"GPU-1{i}", index=i, count=1) for i in range(4))))
    cache.apply_node(node_obj("node2", *(gpu(f"GPU-2{i}", index=i, count=1) for i in range(4))))
    cache.apply_pod(
        bound_pod(
            "a", "node1", [[("GPU-10", 8192, 80), ("GPU-11", 8192, 80), ("GPU-12", 4096, 80)]]
        )
    )
    cache.apply_pod(bound_pod("b", "node2", [[("GPU-20", 4096, 60), ("GPU-21", 4096, 60)]]))


# ----- PreFilter ------------------------------------------------------------------------------


def _undo(written: Any) -> dict[str, Any]:
    """The patch that takes bind annotations (and the label written with them) back."""
    return {
        "metadata": {
            "annotations": dict.fromkeys(written),
            "labels": {ann.VGPU_NODE_LABEL: None},
        }
    }


def _scores(r: pb.PreFilterResponse) -> dict[str, int]:
    return dict(zip(r.feasible_nodes, r.scores, strict=True))


# The seed's node scores, 19.75 and 10.50 of 30, on kube-scheduler's 0..100 scale.
@pytest.mark.parametrize(
    ("policy", "scores"),
    [("binpack", {"node1": 66, "node2": 35}), ("spread", {"node1": 34, "node2": 65})],
)
def test_prefilter_scores_seed_nodes_by_node_policy(
    h: Harness, policy: str, scores: dict[str, int]
) -> None:
    seed_cluster(h.cache)
    pod = make_pod("p").gpu(1, mem=1000).annotate(ann.NODE_POLICY, policy).build()
    r = h.prefilter(pod)
    assert r.code == OK
    assert dict(zip(r.feasible_nodes, r.scores, strict=True)) == scores
    assert r.decision_id > 0
    assert r.infeasible_message == ""


def test_a_nodes_score_depends_on_that_node_alone(h: Harness) -> None:
    """Absolute, not stretched per cycle: a node's score stays when other nodes come or go."""
    seed_cluster(h.cache)
    pod = make_pod("p").gpu(1, mem=1000).build()
    assert _scores(h.prefilter(pod)) == {"node1": 66, "node2": 35}
    h.cache.delete_node("node2")
    assert _scores(h.prefilter(make_pod("p2").gpu(1, mem=1000).build())) == {"node1": 66}
    h.cache.apply_node(node_obj("node3", gpu("GPU-30")))
    got = _scores(h.prefilter(make_pod("p3").gpu(1, mem=1000).build()))
    assert got == {"node1": 66, "node3": 0}


def test_prefilter_names_infeasible_nodes_and_unschedulable_records_event(h: Harness) -> None:
    h.cache.apply_node(node_obj("small", gpu("GPU-s", mem=4000)))
    h.cache.apply_node(node_obj("big", gpu("GPU-b", mem=16000)))
    r = h.prefilter(make_pod("p").gpu(1, mem=8000).build())
    assert (r.code, list(r.feasible_nodes)) == (OK, ["big"])
    # Some node fits: the rejected ones are explained only when asked (the shim's PostFilter).
    assert r.infeasible_message == ""
    why = h.stub.Explain(
        pb.ExplainRequest(version=V1, pod=ref("p"), decision_id=r.decision_id), timeout=10
    )
    assert why.message.startswith("1/2 nodes are available: 1 node [")
    assert "insufficient GPU memory" in why.message and "(small)" in why.message
    assert h.kube.posts == []

    for _ in range(2):  # the second is rate-limited
        r = h.prefilter(make_pod("q").gpu(1, mem=20000).build())
        assert r.code == pb.PreFilterResponse.UNSCHEDULABLE
    assert r.message.startswith("0/2 nodes are available")
    assert "insufficient GPU memory" in r.message
    h.events.flush()
    assert len(h.kube.posts) == 1
    path, event = h.kube.posts[0]
    assert path == "/api/v1/namespaces/default/events"
    assert event["reason"] == REASON and event["type"] == "Warning"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "default",
        "name": "q",
        "uid": "uid-q",
    }
    assert event["message"] == r.message


def test_a_pod_holding_hami_legacy_mig_devices_gets_one_warning_with_what_to_do(
    h: Harness,
) -> None:
    h.cache.on_legacy_mig(lambda pod, alloc: h.events.legacy_mig(EventTarget.of(pod), alloc))
    h.cache.apply_node(node_obj("n1", gpu("GPU-a"), gpu("GPU-b", index=1)))
    old = (
        make_pod("old")
        .on("n1")
        .annotate(ann.DEVICES_ALLOCATED, "GPU-a[1-1],NVIDIA,19968,28:GPU-b,NVIDIA,1000,10:;")
        .build()
    )
    old["metadata"]["uid"] = "uid-old"
    h.cache.apply_pod(old)
    old["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    h.cache.apply_pod(old)  # nothing the allocation is read from changed: no second event
    h.cache.apply_pod(
        make_pod("new").on("n1").annotate(ann.DEVICES_ALLOCATED, "GPU-b,NVIDIA,1,1:;").build()
    )
    h.events.flush()
    [(path, event)] = h.kube.posts
    assert path == "/api/v1/namespaces/default/events"
    assert event["reason"] == LEGACY_MIG_REASON and event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == "uid-old"
    assert "GPU-a[1-1]" in event["message"] and "GPU GPU-a takes no new work" in event["message"]
    assert "Delete the pod" in event["message"]
    r = h.prefilter(make_pod("p").gpu(1, mem=1000).build())
    assert [n for n in r.feasible_nodes] == ["n1"]


def test_explain_decides_again_once_the_state_moved_on_and_says_nothing_when_all_fit(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("small", gpu("GPU-s", mem=4000)))
    h.cache.apply_node(node_obj("big", gpu("GPU-b", mem=16000)))
    r = h.prefilter(make_pod("p").gpu(1, mem=3000).build())
    assert sorted(r.feasible_nodes) == ["big", "small"] and r.infeasible_message == ""
    ask = pb.ExplainRequest(version=V1, pod=ref("p"), decision_id=r.decision_id)
    assert h.stub.Explain(ask, timeout=10).message == ""
    h.cache.apply_pod(bound_pod("hog", "small", [[("GPU-s", 3500, 0)]]))  # state changes
    assert "small" in h.stub.Explain(ask, timeout=10).message  # decided again, now
    with pytest.raises(grpc.RpcError) as e:
        h.stub.Explain(pb.ExplainRequest(version=V1, pod=ref("never")), timeout=10)
    assert _code(e) == grpc.StatusCode.NOT_FOUND and "no PreFilter decision" in _details(e)


def test_pod_without_gpu_request_is_skipped(h: Harness) -> None:
    pod = make_pod("cpu").container(cpu="1").build()
    assert h.prefilter(pod).code == pb.PreFilterResponse.SKIP


def cpu_only(name: str, cpu: str) -> dict[str, Any]:
    """A pod asking for no GPU, under the fragmentation policy (``core.hostonly``)."""
    pod = make_pod(name).container("c").annotate(ann.NODE_POLICY, "fragmentation").build()
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
    return pod


def test_a_pod_without_a_gpu_is_placed_under_fragmentation_and_counted_until_bound(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("gpu", gpu("GPU-1")))
    h.cache.apply_node({**node_obj("cpu"), "metadata": {"name": "cpu"}})  # no register
    r = h.prefilter(cpu_only("p", "10"), limit=8)
    assert r.code == OK and list(r.feasible_nodes) == ["cpu"] and list(r.scores) == [100]
    assert r.feasible_total == 2  # the GPU node fits too: every one is offered if asked
    assert list(h.prefilter(cpu_only("p", "10")).feasible_nodes) == ["cpu", "gpu"]
    r = h.prefilter(cpu_only("p", "10"), limit=8)
    assert h.reserve("p", "cpu", r.decision_id).annotations == {}  # nothing to hand over
    # Counted at once: the next pod no longer fits there, so it goes to the GPU node.
    assert list(h.prefilter(cpu_only("q", "10"), limit=8).feasible_nodes) == ["gpu"]
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="cpu"))
    assert list(h.prefilter(cpu_only("q", "10"), limit=8).feasible_nodes) == ["cpu"]
    h.reserve("p", "cpu", h.prefilter(cpu_only("p", "10"), limit=8).decision_id)
    bound = cpu_only("p", "10")
    bound["metadata"]["uid"] = "uid-p"
    bound["spec"]["nodeName"] = "cpu"
    h.cache.apply_pod(bound)  # the watch shows it bound: its own record counts now
    assert list(h.prefilter(cpu_only("q", "10"), limit=8).feasible_nodes) == ["gpu"]
    # Nowhere room: kube-scheduler's own (its NodeResourcesFit explains, it may preempt).
    assert h.prefilter(cpu_only("r", "17"), limit=8).code == pb.PreFilterResponse.SKIP


@pytest.mark.parametrize(
    ("pod_json", "problem"),
    [
        (json.dumps(make_pod("p").gpu(1, cores=150).build()).encode(), "gpucores = 150"),
        (b"{not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (
            json.dumps(make_pod("p").gpu(1).annotate(ann.VGPU_MODE, "vmx").build()).encode(),
            "nvidia.com/vgpu-mode",
        ),
    ],
)
def test_invalid_request_is_answered_invalid_with_the_problem(
    h: Harness, pod_json: bytes, problem: str
) -> None:
    r = h.stub.PreFilter(pb.PreFilterRequest(version=V1, pod=ref("p"), pod_json=pod_json))
    assert r.code == pb.PreFilterResponse.INVALID
    assert problem in r.message


@pytest.mark.parametrize("method", ["PreFilter", "Reserve", "Unreserve", "PreBind"])
def test_other_protocol_version_is_refused(h: Harness, method: str) -> None:
    requests = {
        "PreFilter": pb.PreFilterRequest(pod=ref("p"), pod_json=b"{}"),
        "Reserve": pb.ReserveRequest(pod=ref("p"), node="n"),
        "Unreserve": pb.UnreserveRequest(pod=ref("p"), node="n"),
        "PreBind": pb.PreBindRequest(pod=ref("p"), node="n"),
    }
    with pytest.raises(grpc.RpcError) as e:
        getattr(h.stub, method)(requests[method], timeout=10)
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 0" in _details(e)


def test_unavailable_until_state_is_rebuilt(h_not_ready: Harness) -> None:
    h = h_not_ready
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    with pytest.raises(grpc.RpcError) as e:
        h.prefilter(make_pod("p").gpu(1).build())
    assert _code(e) == grpc.StatusCode.UNAVAILABLE
    assert "rebuilding" in _details(e)
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p", "n")
    assert _code(e) == grpc.StatusCode.UNAVAILABLE
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))  # idempotent: OK
    h.ready.set()
    assert h.prefilter(make_pod("p").gpu(1).build()).code == OK


# ----- Cycle (the shim's stream) --------------------------------------------------------------


class CycleStream:
    """The shim's end of a Cycle stream: send without waiting, read answers in order."""

    def __init__(self, stub: pb_grpc.SchedulerStub) -> None:
        self._out: queue.Queue[pb.CycleRequest | None] = queue.Queue()
        self._answers = stub.Cycle(iter(self._out.get, None), timeout=30)
        self._next = 0

    def send(self, **call: Any) -> int:
        self._next += 1
        self._out.put(pb.CycleRequest(id=self._next, **call))
        return self._next

    def answer(self) -> pb.CycleResponse:
        return next(self._answers)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._out.put(None)


@pytest.fixture
def stream(h: Harness) -> Iterator[CycleStream]:
    s = CycleStream(h.stub)
    yield s
    s.close()


def test_cycle_counts_a_reserve_before_the_prefilter_sent_after_it(
    h: Harness, stream: CycleStream
) -> None:
    """The shim does not wait for Reserve's answer: the next PreFilter must see it anyway."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1", count=1)))
    stream.send(pre_filter=prefilter_req(make_pod("a").gpu(1).build()))
    first = stream.answer()
    assert first.code == 0 and first.pre_filter.code == OK
    reserve = pb.ReserveRequest(
        version=V1, pod=ref("a"), node="n", decision_id=first.pre_filter.decision_id, hand_over=True
    )
    ids = (
        stream.send(reserve=reserve),
        stream.send(pre_filter=prefilter_req(make_pod("b").gpu(1).build())),
    )
    reserved, second = stream.answer(), stream.answer()
    assert (reserved.id, second.id) == ids
    assert reserved.code == 0 and reserved.reserve.annotations[ann.VGPU_NODE] == "n"
    assert second.pre_filter.code == pb.PreFilterResponse.UNSCHEDULABLE
    assert "no free vGPU slot" in second.pre_filter.message


def test_cycle_counts_a_reserve_sent_in_the_next_prefilters_before_first(
    h: Harness, stream: CycleStream
) -> None:
    """One message for the Reserve and the PreFilter after it: the Reserve is counted first
    and answered in the same response, and every response says the server handles this."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1", count=1)))
    stream.send(pre_filter=prefilter_req(make_pod("a").gpu(1).build()))
    first = stream.answer()
    assert first.handles_before and not first.before
    reserve = pb.ReserveRequest(
        version=V1, pod=ref("a"), node="n", decision_id=first.pre_filter.decision_id, hand_over=True
    )
    sent = stream.send(
        pre_filter=prefilter_req(make_pod("b").gpu(1).build()),
        before=[pb.CycleRequest(id=100, reserve=reserve)],
    )
    both = stream.answer()
    assert both.id == sent and both.handles_before
    assert [r.id for r in both.before] == [100]
    reserved = both.before[0]
    assert reserved.code == 0 and reserved.reserve.annotations[ann.VGPU_NODE] == "n"
    assert both.pre_filter.code == pb.PreFilterResponse.UNSCHEDULABLE
    assert "no free vGPU slot" in both.pre_filter.message
    calls = h.metrics.registry.get_sample_value
    assert calls("tessera_scheduler_cycle_calls_total", {"carried": "false"}) == 2
    assert calls("tessera_scheduler_cycle_calls_total", {"carried": "true"}) == 1


def test_cycle_answers_each_before_call_alone_and_refuses_deeper_nesting(
    h: Harness, stream: CycleStream
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    ghost = pb.CycleRequest(
        id=11, reserve=pb.ReserveRequest(version=V1, pod=ref("ghost"), node="n", decision_id=7)
    )
    nested = pb.CycleRequest(id=12, before=[pb.CycleRequest(id=13)])
    stream.send(pre_filter=prefilter_req(make_pod("p").gpu(1).build()), before=[ghost, nested])
    answer = stream.answer()
    assert [r.id for r in answer.before] == [11, 12]
    assert answer.before[0].code == grpc.StatusCode.ABORTED.value[0]
    assert answer.before[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "nest at most one level" in answer.before[1].message
    assert answer.code == 0 and answer.pre_filter.code == OK


def test_cycle_answers_a_failed_call_with_its_code_and_goes_on(
    h: Harness, stream: CycleStream
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    stream.send(reserve=pb.ReserveRequest(version=V1, pod=ref("ghost"), node="n", decision_id=7))
    stream.send()  # no call at all
    stream.send(reserve=pb.ReserveRequest(version=V1, pod=pb.PodRef(name="Bad_Name"), node="n"))
    stream.send(pre_filter=prefilter_req(make_pod("p").gpu(1).build()))
    ghost, empty, bad, ok = (stream.answer() for _ in range(4))
    assert ghost.code == grpc.StatusCode.ABORTED.value[0] and "schedule it again" in ghost.message
    assert not ghost.HasField("reserve")
    assert empty.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "carries no call" in empty.message
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "Bad_Name" in bad.message
    assert ok.code == 0 and ok.pre_filter.code == OK


def test_cycle_is_unavailable_until_state_is_rebuilt(h_not_ready: Harness) -> None:
    h = h_not_ready
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    stream = CycleStream(h.stub)
    try:
        stream.send(pre_filter=prefilter_req(make_pod("p").gpu(1).build()))
        answer = stream.answer()
        assert answer.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "rebuilding" in answer.message
        h.ready.set()
        stream.send(pre_filter=prefilter_req(make_pod("p").gpu(1).build()))
        assert stream.answer().pre_filter.code == OK
    finally:
        stream.close()


# ----- Reserve / Unreserve / PreBind ----------------------------------------------------------

MIG_EXPECTED = {
    ann.VGPU_NODE: "n",
    ann.BIND_TIME: str(BIND_TIME),
    ann.BIND_PHASE: "allocating",
    ann.DEVICES_ALLOCATED: "GPU-m,NVIDIA,9984,29:GPU-m,NVIDIA,9984,29:;",
    ann.DEVICES_TO_ALLOCATE: "GPU-m,NVIDIA,9984,29:GPU-m,NVIDIA,9984,29:;",
}


def test_mig_reserve_then_prebind_writes_exact_annotations_in_one_patch(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", mig_gpu("GPU-m")))
    empty = h.cache.state.usage_snapshot()
    pod = make_pod("p").gpu(2, mem=8000).mode("mig").build()
    assert h.schedule(pod) == "n"
    assert h.cache.state.is_assumed("default/p")
    assert h.cache.state.usage_snapshot() != empty

    r = h.prebind("p", "n")
    mig = json.loads(r.annotations[ann.MIG_ALLOCATIONS])
    assert [(m["containerIndex"], m["deviceIndex"], m["gpuUUID"], m["profile"]) for m in mig] == [
        (0, 0, "GPU-m", "2g.10gb"),
        (0, 1, "GPU-m", "2g.10gb"),
    ]
    (a, b) = sorted((m["placement"]["start"], m["placement"]["size"]) for m in mig)
    assert a[1] == b[1] == 2 and a[0] + 2 <= b[0]
    assert {k: v for k, v in r.annotations.items() if k != ann.MIG_ALLOCATIONS} == MIG_EXPECTED
    assert dict(r.labels) == {ann.VGPU_NODE_LABEL: "n"}  # with the annotations, as HAMi writes
    assert h.kube.patches == [
        (
            "/api/v1/namespaces/default/pods/p",
            {
                "metadata": {
                    "annotations": dict(r.annotations),
                    "labels": {ann.VGPU_NODE_LABEL: "n"},
                    "uid": "uid-p",
                }
            },
        )
    ]


def test_reservation_is_replaced_by_the_pods_own_record_when_the_watch_shows_it(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    assumed = h.cache.state.usage_snapshot()
    # An event of the still-pending pod (no annotations yet) keeps the reservation.
    h.cache.apply_pod({**pod, "status": {"phase": "Pending"}})
    assert h.cache.state.is_assumed("default/p")
    written = dict(h.prebind("p", "n").annotations)
    seen = json.loads(json.dumps(pod))
    seen["metadata"]["annotations"].update(written)
    clock = h.cache.state.usage_clock
    h.cache.apply_pod(seen)
    assert not h.cache.state.is_assumed("default/p")
    assert h.cache.state.usage_snapshot() == assumed
    # Confirmed in place: no GPU row counts as changed, so kept decision work stays valid,
    # and the record is the pod's own (what it wrote: the metrics' per-container series).
    assert h.cache.state.usage_clock == clock
    held = h.cache.state.allocation("default/p")
    assert held is not None and held.devices_written == written[ann.DEVICES_ALLOCATED]
    assert not h.cache.state.forget("default/p")  # a confirmed record is no longer dropped
    assert h.cache.state.usage_snapshot() == assumed


def test_unreserve_releases_and_is_idempotent(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    empty = h.cache.state.usage_snapshot()
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    assert h.cache.state.usage_snapshot() != empty
    for _ in range(2):
        h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
        assert h.cache.state.usage_snapshot() == empty
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("never"), node="n"))
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p", "n")
    assert _code(e) == grpc.StatusCode.ABORTED  # never bound without a reservation


def test_unreserve_after_prebind_takes_the_annotations_back(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    written = h.prebind("p", "n").annotations
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    path, undo = h.kube.patches[-1]
    assert path == "/api/v1/namespaces/default/pods/p"
    assert undo == _undo(written)


def test_prebind_hand_over_writes_nothing_and_answers_the_same_annotations(h: Harness) -> None:
    """The shim's Binding carries the annotations: the server writes nothing, and the
    annotations are those it would have patched (the node agent reads the same)."""
    h.cache.apply_node(node_obj("n", mig_gpu("GPU-m")))
    h.schedule(make_pod("p").gpu(2, mem=8000).mode("mig").build(), "n")
    handed = h.prebind("p", "n", hand_over=True).annotations
    assert h.kube.patches == []
    assert {k: v for k, v in handed.items() if k != ann.MIG_ALLOCATIONS} == MIG_EXPECTED
    assert len(json.loads(handed[ann.MIG_ALLOCATIONS])) == 2
    # The node is claimed for them until the watch shows the pod bound with them.
    assert "default/p" in h.cache.allocating("n")


def _reserve_handing_over(h: Harness, pod: dict[str, Any], node: str) -> dict[str, str]:
    r = h.prefilter(pod)
    assert r.code == OK, r.message
    return dict(h.reserve(pod["metadata"]["name"], node, r.decision_id, hand_over=True).annotations)


def test_reserve_hands_over_at_once_when_nothing_on_the_node_is_ambiguous(h: Harness) -> None:
    """Reserve answers the annotations PreBind would (the shim then skips PreBind), writes
    nothing and claims the node: a second pod the node agent could not tell apart gets none
    and waits at PreBind until the first is allocated or released."""
    h.cache.apply_node(node_obj("n", mig_gpu("GPU-m"), mig_gpu("GPU-k", index=1)))
    handed = _reserve_handing_over(h, make_pod("p").gpu(2, mem=8000).mode("mig").build(), "n")
    assert (
        handed[ann.BIND_PHASE] == "allocating" and len(json.loads(handed[ann.MIG_ALLOCATIONS])) == 2
    )
    assert dict(h.prebind("p", "n", hand_over=True).annotations) == handed  # as PreBind's
    assert h.kube.patches == []
    assert "default/p" in h.cache.allocating("n")
    second = make_pod("q").gpu(2, mem=4000).mode("mig").build()
    assert _reserve_handing_over(h, second, "n") == {}  # p is allocating, same count
    assert h.cache.state.allocation("default/q") is not None  # still reserved
    waiting = h.stub.PreBind.future(
        pb.PreBindRequest(version=V1, pod=ref("q"), node="n", hand_over=True), timeout=10
    )
    time.sleep(0.3)
    assert not waiting.done()
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"), timeout=5)
    assert waiting.result().annotations[ann.VGPU_NODE] == "n"
    assert h.kube.patches == []


def test_reserve_without_hand_over_answers_nothing_and_leaves_the_claim_to_prebind(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    r = h.prefilter(make_pod("p").gpu(1, mem=1000).build())
    assert dict(h.reserve("p", "n", r.decision_id).annotations) == {}
    assert "default/p" not in h.cache.allocating("n")
    assert h.prebind("p", "n").annotations[ann.VGPU_NODE] == "n"
    assert [path for path, _ in h.kube.patches] == ["/api/v1/namespaces/default/pods/p"]


def test_unreserve_after_a_failed_reserve_hand_over_binding_releases_without_a_write(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    empty = h.cache.state.usage_snapshot()
    assert _reserve_handing_over(h, make_pod("p").gpu(1, mem=1000).build(), "n")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert h.kube.patches == []
    assert h.cache.state.usage_snapshot() == empty
    assert "default/p" not in h.cache.allocating("n")


def test_unreserve_after_a_failed_hand_over_binding_releases_without_a_write(
    h: Harness,
) -> None:
    """The Binding that carried the annotations failed: the pod shows none and is unbound,
    so the devices go back at once and nothing is patched."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    empty = h.cache.state.usage_snapshot()
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    h.prebind("p", "n", hand_over=True)
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert h.kube.patches == []
    assert h.cache.state.usage_snapshot() == empty
    assert "default/p" not in h.cache.allocating("n")


def test_unreserve_after_a_hand_over_keeps_a_pod_whose_binding_went_through(h: Harness) -> None:
    """The Binding's answer was lost but it landed: the pod is bound with the annotations,
    which are its allocation; they stay and keep counting."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    handed = dict(h.prebind("p", "n", hand_over=True).annotations)
    h.kube.objects["/api/v1/namespaces/default/pods/p"] = {
        "metadata": {"resourceVersion": "7", "annotations": handed},
        "spec": {"nodeName": "n"},
    }
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert h.kube.patches == []
    assert h.cache.state.allocation("default/p") is not None
    assert "default/p" in h.cache.allocating("n")


def test_unreserve_keeps_the_annotations_of_a_pod_bound_after_all(h: Harness) -> None:
    """The Bind's answer was lost (the apiserver restarted) but the Bind went through: the
    annotations are the bound pod's allocation and must stay."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    h.prebind("p", "n")
    patches = len(h.kube.patches)
    h.kube.objects["/api/v1/namespaces/default/pods/p"] = {
        "metadata": {"resourceVersion": "7"},
        "spec": {"nodeName": "n"},
    }
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert len(h.kube.patches) == patches
    # ... and its devices keep counting until the watch shows the pod.
    assert h.cache.state.allocation("default/p") is not None
    assert "default/p" in h.cache.allocating("n")


def test_unreserve_keeps_counting_a_reservation_it_cannot_take_back(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    h.prebind("p", "n")
    h.kube.get_fails_with = UnreachableError("GET /p failed: apiserver down")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert h.cache.state.allocation("default/p") is not None


def test_a_pod_whose_bind_went_through_is_not_reserved_again(h: Harness) -> None:
    """The scheduler did not see the bind (its answer was lost) and tries the pod again: the
    plugin server refuses while the pod is bound, so its real devices stay counted."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    h.prebind("p", "n")
    h.kube.objects["/api/v1/namespaces/default/pods/p"] = {
        "metadata": {"resourceVersion": "7"},
        "spec": {"nodeName": "n"},
    }
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    before = h.cache.state.allocation("default/p")
    with pytest.raises(grpc.RpcError) as e:
        h.schedule(pod, "n")
    assert _code(e) == grpc.StatusCode.UNAVAILABLE and "may have gone through" in _details(e)
    assert h.cache.state.allocation("default/p") == before


def test_a_pod_the_watch_shows_bound_is_not_reserved_again(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    written = dict(h.prebind("p", "n").annotations)
    bound = json.loads(json.dumps(pod))
    bound["metadata"]["annotations"].update(written)
    bound["spec"]["nodeName"] = "n"
    h.cache.apply_pod(bound)  # the bind went through; the scheduler did not hear of it
    before = h.cache.state.allocation("default/p")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    with pytest.raises(grpc.RpcError) as e:
        h.schedule(pod, "n")
    assert _code(e) == grpc.StatusCode.ABORTED and "bound to node n already" in _details(e)
    assert before is not None and h.cache.state.allocation("default/p") == before


def test_a_pod_whose_bind_did_not_go_through_is_reserved_again_cleanly(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    written = h.prebind("p", "n").annotations
    h.kube.get_fails_with = UnreachableError("GET /p failed: apiserver down")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    h.kube.get_fails_with = None  # back: the pod shows unbound
    h.schedule(pod, "n")
    _, undo = h.kube.patches[-1]
    assert undo == _undo(written)
    assert h.prebind("p", "n").annotations[ann.VGPU_NODE] == "n"


def _left_over(name: str, node: str, uuid: str, mem: int) -> dict[str, Any]:
    """Pod ``name`` as an earlier server left it: PreBind's patch landed, the bind never
    happened, and nothing took the annotations back (the server died first)."""
    pod = _allocating(name, node, [(uuid, mem, 0)])
    del pod["spec"]["nodeName"]
    pod["metadata"]["uid"] = f"uid-{name}"
    return pod


def test_prefilter_takes_back_annotations_left_over_by_an_earlier_server(h: Harness) -> None:
    """The CI failure this guards: the pod, tried again, no longer fit anywhere and stayed
    Pending for good with an allocation written on it (and counted against the GPU)."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1", mem=8192)))
    pod = _left_over("p", "n", "GPU-1", 6000)
    h.cache.apply_pod(pod)
    h.kube.objects["/api/v1/namespaces/default/pods/p"] = {
        "metadata": {"resourceVersion": "9", "annotations": dict(pod["metadata"]["annotations"])},
        "spec": {},
    }
    r = h.prefilter(pod)
    assert r.code == OK and list(r.feasible_nodes) == ["n"]  # its own leftover no longer counts
    ((path, undo),) = h.kube.patches
    assert path == "/api/v1/namespaces/default/pods/p"
    assert undo == _undo(
        k for k in pod["metadata"]["annotations"] if k.startswith(ann.INTERNAL_PREFIXES)
    )
    assert h.cache.state.allocation("default/p") is None


def test_prefilter_keeps_the_annotations_of_a_pod_bound_after_all(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1", mem=8192)))
    pod = _left_over("p", "n", "GPU-1", 6000)
    h.cache.apply_pod(pod)
    h.kube.objects["/api/v1/namespaces/default/pods/p"] = {
        "metadata": {"resourceVersion": "9"},
        "spec": {"nodeName": "n"},
    }
    h.prefilter(pod)
    assert h.kube.patches == []
    assert h.cache.state.allocation("default/p") is not None


def test_prefilter_leaves_a_pods_annotations_alone_while_its_attempt_is_in_progress(
    h: Harness,
) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    written = dict(h.prebind("p", "n").annotations)
    pod["metadata"]["annotations"].update(written)
    h.prefilter(pod)  # a confused scheduler, or a PreFilter racing its own bind
    assert len(h.kube.patches) == 1  # PreBind's own patch only


def test_an_unsure_pod_that_no_longer_fits_is_still_cleaned_up(h: Harness) -> None:
    """Unreserve could not take the annotations back (apiserver down); the pod is tried
    again once it is back, and no longer fits: PreFilter takes them back anyway."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1", count=1)))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    written = dict(h.prebind("p", "n").annotations)
    h.kube.get_fails_with = UnreachableError("GET /p failed: apiserver down")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    h.kube.get_fails_with = None
    h.cache.apply_pod(bound_pod("q", "n", [[("GPU-1", 1000, 10)]]))  # the GPU's one slot
    r = h.prefilter(make_pod("p").gpu(1, mem=1000).build())
    assert r.code == pb.PreFilterResponse.UNSCHEDULABLE
    _, undo = h.kube.patches[-1]
    assert undo == _undo(written)
    assert h.cache.state.allocation("default/p") is None


def test_unreserve_of_an_unbound_pod_releases_its_devices(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    h.prebind("p", "n")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert h.cache.state.allocation("default/p") is None
    assert h.cache.allocating("n") == {}


@pytest.mark.parametrize("seen", ["bound", "deleted"])
def test_reservation_is_dropped_once_the_pod_is_bound_or_gone(h: Harness, seen: str) -> None:
    # Nothing Unreserves a bound pod: keeping its reservation would grow without bound.
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    pod = make_pod("p").gpu(1, mem=1000).build()
    h.schedule(pod, "n")
    written = dict(h.prebind("p", "n").annotations)
    patches = len(h.kube.patches)
    bound = json.loads(json.dumps(pod))
    bound["metadata"]["annotations"].update(written)
    bound["spec"]["nodeName"] = "n"
    if seen == "bound":
        h.cache.apply_pod(bound)
    else:
        h.cache.delete_pod(bound)
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p", "n")
    assert _code(e) == grpc.StatusCode.ABORTED and "no reservation" in _details(e)
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"))
    assert len(h.kube.patches) == patches  # nothing left to take back


def test_reserve_on_a_node_that_no_longer_fits_is_aborted(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1", count=1)))
    r = h.prefilter(make_pod("p").gpu(1).build())
    assert r.code == OK
    h.cache.apply_pod(bound_pod("other", "n", [[("GPU-1", 8192, 100)]]))
    with pytest.raises(grpc.RpcError) as e:
        h.reserve("p", "n", r.decision_id)
    assert _code(e) == grpc.StatusCode.ABORTED
    assert "no longer fits" in _details(e) and "no free vGPU slot" in _details(e)


def test_reserve_with_a_stale_decision_decides_again(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    r = h.prefilter(make_pod("p").gpu(1, mem=8192).build())
    h.cache.apply_pod(bound_pod("other", "n", [[("GPU-1", 8192, 0)]]))
    h.reserve("p", "n", r.decision_id)
    alloc = h.cache.state.allocation("default/p")
    assert alloc is not None and [d.uuid for d in alloc.devices] == ["GPU-2"]


def test_reserve_without_prefilter_is_aborted(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    with pytest.raises(grpc.RpcError) as e:
        h.reserve("ghost", "n", 7)
    assert _code(e) == grpc.StatusCode.ABORTED


def test_prebind_patch_failure_is_unavailable_and_releases_the_claim(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1).build(), "n")
    h.kube.fail_with = ServerError("PATCH", "/p", 503, "ServiceUnavailable", "busy")
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p", "n")
    assert _code(e) == grpc.StatusCode.UNAVAILABLE
    assert h.cache.allocating("n") == {}
    assert h.prebind("p", "n").annotations[ann.VGPU_NODE] == "n"  # the retry goes through


# ----- PreBind serialization of ambiguous pods ------------------------------------------------


def _allocating(name: str, node: str, devices: list[tuple[str, int, int]]) -> dict[str, Any]:
    return bound_pod(name, node, [devices], phase="Pending", bind_phase="allocating")


def test_unreserve_during_the_bind_patch_leaves_the_take_back_to_prebind(h: Harness) -> None:
    """The scheduler's PreBind deadline passes while the patch is in flight: its Unreserve
    must not drop the reservation under the patch (the annotations land afterwards and the
    devices could go to another pod); PreBind takes them back when the patch returns."""
    h.cache.apply_node(node_obj("n", gpu("GPU-1")))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    held = h.cache.state.allocation("default/p")
    h.kube.hold = threading.Event()
    call = h.stub.PreBind.future(pb.PreBindRequest(version=V1, pod=ref("p"), node="n"), timeout=10)
    time.sleep(0.3)  # PreBind is in the patch now
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"), timeout=5)
    assert h.cache.state.allocation("default/p") == held  # still counted
    with pytest.raises(grpc.RpcError) as again:  # no new attempt under the old patch
        h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    assert _code(again) == grpc.StatusCode.UNAVAILABLE and "still being" in _details(again)
    h.kube.hold.set()
    with pytest.raises(grpc.RpcError) as e:
        call.result()
    assert _code(e) == grpc.StatusCode.ABORTED and "taken back" in _details(e)
    (written, undo) = [body for _, body in h.kube.patches]
    assert written["metadata"]["annotations"][ann.BIND_PHASE] == "allocating"
    assert set(undo["metadata"]["annotations"]) == set(written["metadata"]["annotations"])
    assert all(v is None for v in undo["metadata"]["annotations"].values())
    assert h.cache.state.allocation("default/p") is None
    assert h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n") == "n"  # settled: again


def test_unreserve_while_prebind_waits_means_nothing_is_written(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    q = _allocating("q", "n", [("GPU-1", 1000, 0)])
    h.cache.apply_pod(q)
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    call = h.stub.PreBind.future(pb.PreBindRequest(version=V1, pod=ref("p"), node="n"), timeout=10)
    time.sleep(0.3)  # waiting for q
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("p"), node="n"), timeout=5)
    q["metadata"]["annotations"][ann.BIND_PHASE] = "success"
    q["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
    h.cache.apply_pod(q)  # the wait ends
    with pytest.raises(grpc.RpcError) as e:
        call.result()
    assert _code(e) == grpc.StatusCode.ABORTED and "was unreserved" in _details(e)
    assert h.kube.patches == []
    assert h.cache.state.allocation("default/p") is None


def test_prebind_waits_for_an_ambiguous_allocating_pod_then_proceeds(h: Harness) -> None:
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    q = _allocating("q", "n", [("GPU-1", 1000, 0)])
    h.cache.apply_pod(q)
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    call = h.stub.PreBind.future(pb.PreBindRequest(version=V1, pod=ref("p"), node="n"), timeout=10)
    time.sleep(0.4)
    assert not call.done() and h.kube.patches == []
    q["metadata"]["annotations"][ann.BIND_PHASE] = "success"
    q["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
    h.cache.apply_pod(q)
    assert call.result().annotations[ann.BIND_PHASE] == "allocating"
    assert [p for p, _ in h.kube.patches] == ["/api/v1/namespaces/default/pods/p"]


def test_prebind_gives_up_after_its_deadline_naming_the_blocker(h_short_wait: Harness) -> None:
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    h.cache.apply_pod(_allocating("q", "n", [("GPU-2", 1000, 0)]))
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p", "n")
    assert 0.4 < time.monotonic() - t0 < 5
    # Nothing written and the reservation stands: the shim asks again until its deadline.
    assert _code(e) == WAIT_ELSEWHERE and "ask again" in _details(e)
    assert "default/q" in _details(e)
    assert h.kube.patches == []


def _two_behind_an_allocating_pod(h: Harness) -> grpc.Future:
    """p1 and p2 reserved on node n behind allocating q (same count); p1's PreBind waiting."""
    h.cache.apply_node(node_obj("n", *(gpu(f"GPU-{i}", index=i) for i in range(4))))
    h.cache.apply_pod(_allocating("q", "n", [("GPU-0", 1000, 0)]))
    h.schedule(make_pod("p1").gpu(1, mem=1000).build(), "n")
    h.schedule(make_pod("p2").gpu(1, mem=1000).build(), "n")
    first = h.stub.PreBind.future(
        pb.PreBindRequest(version=V1, pod=ref("p1"), node="n"), timeout=10
    )
    time.sleep(0.3)
    assert not first.done()
    return first


def test_waiting_prebinds_are_capped_so_rpc_workers_stay_free(h_one_waiter: Harness) -> None:
    h = h_one_waiter
    first = _two_behind_an_allocating_pod(h)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p2", "n")
    assert time.monotonic() - t0 < 2  # told to retry at once, not parked on a worker
    assert _code(e) == WAIT_ELSEWHERE and "already waiting" in _details(e)
    first.cancel()


def test_a_cancelled_waiting_prebind_frees_its_place_at_once(h_one_waiter: Harness) -> None:
    h = h_one_waiter
    first = _two_behind_an_allocating_pod(h)
    first.cancel()  # the shim gave up: its waiter wakes now, not at its next safety check
    deadline = time.monotonic() + 2
    while True:
        second = h.stub.PreBind.future(
            pb.PreBindRequest(version=V1, pod=ref("p2"), node="n"), timeout=10
        )
        time.sleep(0.2)
        if not second.done():
            break  # waiting in the one place the first held
        with pytest.raises(grpc.RpcError) as e:
            second.result()
        assert "already waiting" in _details(e)
        assert time.monotonic() < deadline, "the cancelled PreBind still holds its place"
    second.cancel()


def test_pods_the_node_agent_can_tell_apart_bind_without_waiting(h_short_wait: Harness) -> None:
    h = h_short_wait
    h.cache.apply_node(node_obj("n", *(gpu(f"GPU-{i}", index=i) for i in range(4))))
    h.cache.apply_pod(_allocating("q", "n", [("GPU-0", 1000, 0), ("GPU-1", 1000, 0)]))
    h.schedule(make_pod("one").gpu(1, mem=1000).build(), "n")
    h.schedule(make_pod("three").gpu(3, mem=1000).build(), "n")
    t0 = time.monotonic()
    h.prebind("one", "n")
    h.prebind("three", "n")  # "one" is claimed allocating but asks another count
    assert time.monotonic() - t0 < 0.4
    assert len(h.kube.patches) == 2


def test_own_claim_serializes_ambiguous_prebinds_before_the_watch_catches_up(
    h_short_wait: Harness,
) -> None:
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    h.schedule(make_pod("p1").gpu(1, mem=1000).build(), "n")
    h.schedule(make_pod("p2").gpu(1, mem=2000).build(), "n")
    h.prebind("p1", "n")
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p2", "n")
    assert _code(e) == WAIT_ELSEWHERE and "default/p1" in _details(e)


def test_a_prebind_told_to_ask_again_keeps_its_reservation_and_binds_when_asked_again(
    h_short_wait: Harness,
) -> None:
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1", count=1), gpu("GPU-2", index=1, count=1)))
    h.schedule(make_pod("p1").gpu(1, mem=1000).build(), "n")
    h.schedule(make_pod("p2").gpu(1, mem=2000).build(), "n")
    written = dict(h.prebind("p1", "n").annotations)
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p2", "n")
    assert _code(e) == WAIT_ELSEWHERE
    held = h.cache.state.allocation("default/p2")
    assert held is not None  # still counted: no third pod gets its GPU meanwhile
    r = h.prefilter(make_pod("p3").gpu(1, mem=1000).build())
    assert r.code == pb.PreFilterResponse.UNSCHEDULABLE
    p1 = make_pod("p1").gpu(1, mem=1000).build()
    p1["metadata"]["annotations"].update(written, **{ann.BIND_PHASE: "success"})
    p1["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
    p1["spec"]["nodeName"] = "n"
    h.cache.apply_pod(p1)  # bound and allocated: p2 may go
    again = h.prebind("p2", "n").annotations[ann.DEVICES_ALLOCATED]
    assert again.startswith(held.devices[0].uuid + ",")  # the devices it was reserved
    assert [path for path, _ in h.kube.patches][-1].endswith("/p2")


def test_stale_bind_annotations_of_an_unbound_pod_block_nobody(h_short_wait: Harness) -> None:
    """A pod whose PreBind patch outlived its attempt (the server died before Unreserve could
    take it back) is not allocating anywhere: it must not hold up other pods' PreBinds."""
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    stale = _allocating("q", "n", [("GPU-2", 1000, 0)])
    del stale["spec"]["nodeName"]
    h.cache.apply_pod(stale)
    h.schedule(make_pod("p").gpu(1, mem=1000).build(), "n")
    t0 = time.monotonic()
    h.prebind("p", "n")
    assert time.monotonic() - t0 < 0.4


def test_own_claim_holds_until_the_pod_is_seen_bound(h_short_wait: Harness) -> None:
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    h.schedule(make_pod("p1").gpu(1, mem=1000).build(), "n")
    h.schedule(make_pod("p2").gpu(1, mem=2000).build(), "n")
    written = dict(h.prebind("p1", "n").annotations)
    p1 = make_pod("p1").gpu(1, mem=1000).build()
    p1["metadata"]["annotations"].update(written)  # the watch shows the patch, not the bind
    h.cache.apply_pod(p1)
    with pytest.raises(grpc.RpcError) as e:
        h.prebind("p2", "n")
    assert _code(e) == WAIT_ELSEWHERE and "default/p1" in _details(e)


def test_interchangeable_pods_allocate_on_one_node_at_once(h_short_wait: Harness) -> None:
    """Replicas (same request, selectors and container) on one node: the node agent may hand
    either the other's entry, so neither waits for the other, claimed or watched."""
    h = h_short_wait
    h.cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    for name in ("p1", "p2", "p3"):
        h.schedule(make_pod(name).gpu(1, mem=1000).build(), "n")
    written = dict(h.prebind("p1", "n").annotations)
    t0 = time.monotonic()
    h.prebind("p2", "n")  # p1 claimed allocating, alike: no wait
    p1 = make_pod("p1").gpu(1, mem=1000).build()
    p1["metadata"]["annotations"].update(written)
    p1["spec"]["nodeName"] = "n"
    h.cache.apply_pod(p1)  # the watch shows p1 bound and allocating
    h.prebind("p3", "n")
    assert time.monotonic() - t0 < 0.4
    assert len(h.kube.patches) == 3
    h.schedule(make_pod("other").gpu(1, mem=2000).build(), "n")
    with pytest.raises(grpc.RpcError) as e:  # another request still waits
        h.prebind("other", "n")
    assert _code(e) == WAIT_ELSEWHERE


def test_mig_replicas_allocate_on_one_node_at_once(h_short_wait: Harness) -> None:
    """MIG pods asking one profile per device, alike otherwise, are interchangeable: the
    node agent may create either's reserved instance for the other (the set of reserved
    placements is the same) and correct the records from the kubelet's PodResources, so
    they do not wait for each other; another profile of the same device count still does."""
    h = h_short_wait
    h.cache.apply_node(node_obj("n", mig_gpu("GPU-m"), mig_gpu("GPU-k", index=1)))
    for name in ("p1", "p2"):
        h.schedule(make_pod(name).gpu(1, mem=8000).mode("mig").build(), "n")
    t0 = time.monotonic()
    first = dict(h.prebind("p1", "n").annotations)
    second = dict(h.prebind("p2", "n").annotations)  # p1 claimed allocating, alike: no wait
    assert time.monotonic() - t0 < 0.4
    placements = {
        (a["gpuUUID"], a["placement"]["start"], a["profile"])
        for w in (first, second)
        for a in json.loads(w[ann.MIG_ALLOCATIONS])
    }
    assert len(placements) == 2 and {p for _, _, p in placements} == {"2g.10gb"}
    h.schedule(make_pod("other").gpu(1, mem=4000).mode("mig").build(), "n")
    with pytest.raises(grpc.RpcError) as e:  # another profile, one device: still waits
        h.prebind("other", "n")
    assert _code(e) == WAIT_ELSEWHERE


# ----- busy nodes: a burst spreads over node agents instead of queueing behind one ------------

# n1 holds 1 of 20 slots, 10 of 200 cores, 4000 of 16384 MiB: node score 3.44 of 30 -> 11.
N1_BINPACK: Final = 11
LIMIT: Final = 100  # the shim's candidate limit for a pod with no placement constraints


def _two_nodes_n1_fuller(h: Harness) -> None:
    """n1 is the binpack choice (it already holds a pod); n2 is empty."""
    h.cache.apply_node(node_obj("n1", gpu("GPU-10"), gpu("GPU-11", index=1)))
    h.cache.apply_node(node_obj("n2", gpu("GPU-20"), gpu("GPU-21", index=1)))
    h.cache.apply_pod(bound_pod("old", "n1", [[("GPU-10", 4000, 10)]]))


def _offered(h: Harness, pod: dict[str, Any]) -> dict[str, int]:
    return _scores(h.prefilter(pod, limit=LIMIT))


@pytest.mark.parametrize("stage", ["reserved", "claimed", "allocating"])
def test_a_node_busy_with_an_indistinguishable_pod_is_left_out_while_others_fit(
    h: Harness, stage: str
) -> None:
    _two_nodes_n1_fuller(h)
    probe = make_pod("probe").gpu(1, mem=1000).build()
    assert _offered(h, probe) == {"n1": N1_BINPACK, "n2": 0}  # binpack: n1 first
    if stage == "allocating":
        h.cache.apply_pod(_allocating("q", "n1", [("GPU-11", 1000, 0)]))
    else:
        h.schedule(make_pod("q").gpu(1, mem=1500).build(), "n1")
        if stage == "claimed":
            h.prebind("q", "n1")
    r = h.prefilter(make_pod("p").gpu(1, mem=1000).build(), limit=LIMIT)
    assert _scores(r) == {"n2": 0}
    assert r.feasible_total == 2  # not every feasible node: the shim may ask for all
    # A pod with placement constraints of its own (no limit) sees every feasible node, with
    # the same scores: waiting is only a tie-breaker for pods that leave the choice to Tessera.
    full = _scores(h.prefilter(make_pod("p2").gpu(1, mem=1000).build()))
    assert set(full) == {"n1", "n2"} and full["n2"] == 0


def test_a_busy_node_is_still_first_for_a_pod_the_agent_can_tell_apart(h: Harness) -> None:
    _two_nodes_n1_fuller(h)
    h.schedule(make_pod("q").gpu(1, mem=1000).build(), "n1")
    h.prebind("q", "n1")
    r = h.prefilter(make_pod("two").gpu(2, mem=1000).build(), limit=LIMIT)
    assert list(r.feasible_nodes) == ["n1", "n2"]
    assert r.scores[1] == 0 and r.scores[0] > N1_BINPACK  # q counts now


def test_a_node_is_no_longer_busy_once_its_agent_has_allocated(h: Harness) -> None:
    _two_nodes_n1_fuller(h)
    q = _allocating("q", "n1", [("GPU-11", 1000, 0)])
    h.cache.apply_pod(q)
    assert _offered(h, make_pod("p").gpu(1, mem=1000).build()) == {"n2": 0}
    q["metadata"]["annotations"][ann.BIND_PHASE] = "success"
    q["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
    h.cache.apply_pod(q)
    assert list(_offered(h, make_pod("p2").gpu(1, mem=1000).build())) == ["n1", "n2"]


def test_once_every_node_is_busy_the_shortest_queue_wins(h: Harness) -> None:
    _two_nodes_n1_fuller(h)
    for name, node in (("q1", "n1"), ("q2", "n1"), ("q3", "n2")):
        h.schedule(make_pod(name).gpu(1, mem=1000).build(), node)
    assert list(_offered(h, make_pod("p").gpu(1, mem=1200).build())) == ["n2"]


@pytest.mark.parametrize("stage", ["reserved", "claimed"])
def test_replicas_are_not_kept_off_a_node_busy_with_their_alike(h: Harness, stage: str) -> None:
    """Interchangeable pods never wait for each other: a burst of replicas binpacks onto
    the node its alike are allocating on, and only other pods of the count go elsewhere."""
    _two_nodes_n1_fuller(h)
    h.schedule(make_pod("q1").gpu(1, mem=1000).build(), "n1")
    if stage == "claimed":
        h.prebind("q1", "n1")
    assert list(_offered(h, make_pod("replica").gpu(1, mem=1000).build())) == ["n1", "n2"]
    assert list(_offered(h, make_pod("other").gpu(1, mem=1200).build())) == ["n2"]
    h.schedule(make_pod("q2").gpu(1, mem=1200).build(), "n1")  # one not alike joins
    assert list(_offered(h, make_pod("replica2").gpu(1, mem=1000).build())) == ["n2"]
    assert h.cache.has_alike()
    for name in ("q1", "q2"):
        h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref(name), node="n1"))
    assert not h.cache.has_alike()  # nothing in flight is remembered


def test_unreserve_frees_the_node_for_the_next_pod(h: Harness) -> None:
    _two_nodes_n1_fuller(h)
    h.schedule(make_pod("q").gpu(1, mem=1000).build(), "n1")
    h.stub.Unreserve(pb.UnreserveRequest(version=V1, pod=ref("q"), node="n1"))
    assert _offered(h, make_pod("p").gpu(1, mem=1000).build()) == {"n1": N1_BINPACK, "n2": 0}


def test_unreadable_allocating_annotations_make_the_node_busy_for_everyone(h: Harness) -> None:
    _two_nodes_n1_fuller(h)
    q = _allocating("q", "n1", [("GPU-11", 1000, 0)])
    q["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = "not a device list"
    h.cache.apply_pod(q)
    assert list(_offered(h, make_pod("p").gpu(2, mem=1000).build())) == ["n2"]


# ----- cache ----------------------------------------------------------------------------------


def test_malformed_node_register_counts_the_node_gpu_less() -> None:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    cache.apply_node(node_obj("n", register="[{not json"))
    assert len(cache.state.nodes["n"].devices) == 0
    cache.apply_node(node_obj("n", gpu("GPU-1")))
    devices: tuple[GpuDevice, ...] = cache.state.nodes["n"].devices
    assert [d.id for d in devices] == ["GPU-1"]


def test_malformed_pod_allocation_keeps_the_previous_record() -> None:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    cache.apply_node(node_obj("n", gpu("GPU-1")))
    pod = bound_pod("p", "n", [[("GPU-1", 1000, 10)]])
    cache.apply_pod(pod)
    before = cache.state.usage_snapshot()
    pod["metadata"]["annotations"][ann.DEVICES_ALLOCATED] = "garbage"
    cache.apply_pod(pod)
    assert cache.state.usage_snapshot() == before
    pod["status"]["phase"] = "Succeeded"
    cache.apply_pod(pod)
    assert cache.state.allocation("default/p") is None


def test_unchanged_events_do_not_invalidate_decisions() -> None:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    cache.apply_node(node_obj("n", gpu("GPU-1")))
    pod = bound_pod("p", "n", [[("GPU-1", 1000, 10)]])
    cache.apply_pod(pod)
    gen = cache.generation
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    cache.apply_pod(pod)
    cache.apply_node(node_obj("n", gpu("GPU-1")))
    assert cache.generation == gen
    cache.delete_pod(pod)
    assert cache.generation == gen + 1 and cache.state.allocation("default/p") is None


def test_bind_phase_and_status_events_reuse_the_parsed_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import scheduler_plugins.core.cache as cache_module

    parsed: list[str] = []
    real = cache_module.parse_allocation

    def counting(pod: dict[str, Any]) -> Any:
        parsed.append(pod["metadata"]["name"])
        return real(pod)

    monkeypatch.setattr(cache_module, "parse_allocation", counting)
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2")))
    pod = bound_pod("p", "n", [[("GPU-1", 1000, 10)]], bind_phase="allocating")
    cache.apply_pod(pod)
    pod["metadata"]["annotations"][ann.BIND_PHASE] = "success"
    cache.apply_pod(pod)  # the node agent's patch: same devices
    pod["status"]["phase"] = "Failed"
    cache.apply_pod(pod)  # holds nothing now: no parse needed either
    assert parsed == ["p"] and cache.state.allocation("default/p") is None
    pod["status"]["phase"] = "Running"
    moved = bound_pod("p", "n", [[("GPU-2", 2000, 20)]])
    pod["metadata"]["annotations"][ann.DEVICES_ALLOCATED] = moved["metadata"]["annotations"][
        ann.DEVICES_ALLOCATED
    ]
    cache.apply_pod(pod)  # other devices: parsed again, and counted
    alloc = cache.state.allocation("default/p")
    assert parsed == ["p", "p"]
    assert alloc is not None and [d.uuid for d in alloc.devices] == ["GPU-2"]
    cache.delete_pod(pod)
    cache.apply_pod(pod)  # a new pod of that name is parsed afresh
    assert parsed == ["p", "p", "p"]


# ----- the served app -------------------------------------------------------------------------


class IdleWatch:
    """A watch stream with no events that ends when closed (or after its timeout)."""

    def __init__(self, timeout_s: float) -> None:
        self._closed = threading.Event()
        self._timeout_s = timeout_s

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._closed.wait(self._timeout_s)
        return iter(())

    def close(self) -> None:
        self._closed.set()


class ListingKube(FakeKube):
    def __init__(self, nodes: list[dict[str, Any]], gate: threading.Event) -> None:
        super().__init__()
        self.nodes = nodes
        self.gate = gate

    def list(self, path: str) -> dict[str, Any]:
        self.gate.wait(10)
        items = self.nodes if path.endswith("/nodes") else []
        return {"metadata": {"resourceVersion": "5"}, "items": items}

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> IdleWatch:
        return IdleWatch(timeout_s)


def test_plugin_server_socket_permissions_readiness_and_clean_stop(short_dir: Path) -> None:
    threads_before = set(threading.enumerate())
    sock_dir = short_dir / "run"
    sock = sock_dir / "tessera.sock"
    gate = threading.Event()
    kube = ListingKube([node_obj("n", gpu("GPU-1"))], gate)
    server = PluginServer(
        kube,
        DeviceConfig(),
        socket_path=sock,
        backoff=Backoff(0.01, 0.05),
    )
    server.start()
    try:
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SchedulerStub(ch)  # type: ignore[no-untyped-call]
            req = prefilter_req(make_pod("p").gpu(1).build())
            with pytest.raises(grpc.RpcError) as e:
                stub.PreFilter(req, timeout=10)
            assert _code(e) == grpc.StatusCode.UNAVAILABLE
            gate.set()
            assert server.wait_ready(10)
            r = stub.PreFilter(req, timeout=10)
            assert (r.code, list(r.feasible_nodes)) == (OK, ["n"])
    finally:
        server.stop()
    assert not sock.exists()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) - threads_before == set()


def test_stale_socket_is_replaced_and_other_files_are_refused(short_dir: Path) -> None:
    import socket as pysocket

    sock = short_dir / "s.sock"
    s = pysocket.socket(pysocket.AF_UNIX)
    s.bind(str(sock))
    s.close()  # bound, never listening: what a crashed server leaves
    gate = threading.Event()
    gate.set()
    server = PluginServer(
        ListingKube([], gate),
        DeviceConfig(),
        socket_path=sock,
    )
    with server:
        assert server.wait_ready(10)
    other = short_dir / "file"
    other.write_text("x")
    with pytest.raises(ServerAddressError, match="not a socket"):
        PluginServer(
            ListingKube([], gate),
            DeviceConfig(),
            socket_path=other,
        ).start()


def test_tcp_address_must_be_loopback_unless_allowed() -> None:
    gate = threading.Event()
    with pytest.raises(ServerAddressError, match="not loopback"):
        PluginServer(
            ListingKube([], gate),
            DeviceConfig(),
            tcp_address="0.0.0.0:0",
        )
    with pytest.raises(ServerAddressError, match="exactly one"):
        PluginServer(ListingKube([], gate), DeviceConfig())


# ----- candidate nodes: kube-scheduler filters and scores the best few only ---------------------


def test_prefilter_answers_the_best_candidates_and_reserve_takes_any_feasible_node(
    h: Harness,
) -> None:
    for i in range(5):
        h.cache.apply_node(node_obj(f"n{i}", gpu(f"GPU-{i}", mem=8192 * (i + 1))))
    pod = make_pod("p").gpu(1, mem=1000).build()
    full = h.prefilter(pod)
    assert full.feasible_total == 0 and len(full.feasible_nodes) == 5
    best = list(full.feasible_nodes[:2])  # best first
    r = h.prefilter(pod, limit=2)
    assert r.feasible_total == 5
    assert list(r.feasible_nodes) == best
    assert list(r.scores) == [full.scores[list(full.feasible_nodes).index(n)] for n in best]
    # A node outside the candidates still fits: Reserve there is not refused.
    other = next(n for n in full.feasible_nodes if n not in r.feasible_nodes)
    h.reserve("p", other, r.decision_id)
    assert h.cache.state.is_assumed("default/p")


def test_waiting_prebinds_wake_only_when_what_blocks_them_changes() -> None:
    """A node's waiters wake when a pod stops blocking there (or blocks differently), not
    when the watch shows a claimed pod bound with what was claimed, nor for the status
    updates of a pod done allocating."""
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    woken: list[tuple[str | None, ...]] = []
    notify = cache._notify

    def recording(*nodes: str | None) -> None:
        woken.append(nodes)
        notify(*nodes)

    cache._notify = recording  # type: ignore[method-assign]
    cache.apply_node(node_obj("n", gpu("GPU-0"), gpu("GPU-1", index=1)))
    bound = _allocating("p", "n", [("GPU-0", 1000, 0)])
    cache.claim("default/p", "n", dict(bound["metadata"]["annotations"]))
    cache.apply_pod(bound)  # bound with the claimed annotations: still blocks the same
    assert woken == [] and "default/p" in cache.allocating("n")
    assert "default/p" not in cache._claims  # the watch stands for the claim now
    bound["metadata"]["annotations"][ann.BIND_PHASE] = "success"
    bound["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE] = ";"
    bound["metadata"]["resourceVersion"] = "2"
    cache.apply_pod(bound)  # allocated: waiters on n may go
    assert [set(w) for w in woken] == [{"n"}]
    bound["status"]["phase"] = "Running"
    bound["metadata"]["resourceVersion"] = "3"
    cache.apply_pod(bound)  # kwok's status update: blocks nobody before or after
    assert len(woken) == 1
