"""Preemption in the plugin server: PreFilter's preemptible nodes and FilterWhatIf through a real
gRPC server on a Unix socket; the watch's view of a preemption (victims keep counting until
they are gone), its Event on the preemptor and its metrics."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.plugin.v1 import plugin_pb2 as pb
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.preemptions import NEED_LABELS
from scheduler_plugins.server.events import PREEMPTION_REASON, EventRecorder, PreemptionReporter
from scheduler_plugins.server.metrics import SchedulingMetrics
from tests.builders import gpu, make_pod, mig_gpu
from tests.unit.test_plugin_server import (
    OK,
    V1,
    FakeKube,
    Harness,
    _code,
    _details,
    _harness,
    bound_pod,
    node_obj,
    ref,
)

UNSCHEDULABLE = pb.PreFilterResponse.UNSCHEDULABLE


@pytest.fixture
def h() -> Iterator[Harness]:
    d = Path(tempfile.mkdtemp(prefix="tpp-", dir="/tmp"))  # Unix socket paths are short
    try:
        yield from _harness(d, prebind_wait_s=5.0, ready=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def victim(
    name: str, node: str, devices: list[tuple[str, int, int]], *, priority: int
) -> dict[str, Any]:
    """A bound pod holding ``devices`` on one container, of ``priority``."""
    pod = bound_pod(name, node, [devices])
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["priority"] = priority
    return pod


def wanting(name: str, *, mem: int, priority: int, mode: str = "") -> dict[str, Any]:
    pod = make_pod(name).gpu(1, mem=mem)
    if mode:
        pod.annotate(ann.VGPU_MODE, mode)
    obj = pod.build()
    obj["spec"]["priority"] = priority
    obj["metadata"]["uid"] = f"uid-{name}"
    return obj


def what_if(
    h: Harness,
    name: str,
    node: str,
    *,
    decision_id: int = 0,
    removed: tuple[str, ...] = (),
    added: tuple[dict[str, Any], ...] = (),
    pod_json: bytes = b"",
    version: int = V1,
) -> pb.FilterWhatIfResponse:
    return h.stub.FilterWhatIf(  # type: ignore[no-any-return]
        pb.FilterWhatIfRequest(
            version=version,
            pod=ref(name),
            decision_id=decision_id,
            pod_json=pod_json,
            node=node,
            removed_pod_uids=list(removed),
            added_pods_json=[json.dumps(p).encode() for p in added],
        ),
        timeout=10,
    )


def two_busy_nodes(h: Harness) -> None:
    """n1: one GPU, a low-priority pod holding 6000 MiB; n2: the same held by a high one."""
    h.cache.apply_node(node_obj("n1", gpu("GPU-1")))
    h.cache.apply_node(node_obj("n2", gpu("GPU-2")))
    h.cache.apply_pod(victim("low", "n1", [("GPU-1", 6000, 10)], priority=0))
    h.cache.apply_pod(victim("high", "n2", [("GPU-2", 6000, 10)], priority=100))


# ----- PreFilter ------------------------------------------------------------------------------


def test_prefilter_names_the_nodes_lower_priority_pods_would_make_room_on(h: Harness) -> None:
    two_busy_nodes(h)
    r = h.prefilter(wanting("p", mem=4000, priority=50))
    assert r.code == UNSCHEDULABLE and list(r.preemptible_nodes) == ["n1"]
    assert h.prefilter(wanting("q", mem=4000, priority=0)).preemptible_nodes == []
    assert h.prefilter(wanting("t", mem=9000, priority=500)).preemptible_nodes == []  # too big
    # With some nodes feasible too: kube-scheduler's other plugins may reject them all.
    h.cache.apply_node(node_obj("n3", gpu("GPU-3")))
    r = h.prefilter(wanting("u", mem=4000, priority=50))
    assert r.code == OK and list(r.feasible_nodes) == ["n3"]
    assert list(r.preemptible_nodes) == ["n1"]


# ----- FilterWhatIf ---------------------------------------------------------------------------


def test_filter_what_if_removes_and_adds_pods_on_one_node(h: Harness) -> None:
    two_busy_nodes(h)
    decision = h.prefilter(wanting("p", mem=4000, priority=50)).decision_id
    now = what_if(h, "p", "n1", decision_id=decision)
    assert not now.fits and now.message.startswith("Tessera: 1 node [")
    assert "insufficient GPU memory (n1)" in now.message
    assert what_if(h, "p", "n1", decision_id=decision, removed=("uid-low",)).fits
    # Removed pods of another node, unknown pods and pods without GPUs free nothing here.
    assert not what_if(h, "p", "n1", decision_id=decision, removed=("uid-high", "uid-x")).fits
    # A removed pod added back holds its devices again.
    low = victim("low", "n1", [("GPU-1", 6000, 10)], priority=0)
    back = what_if(h, "p", "n1", decision_id=decision, removed=("uid-low",), added=(low,))
    assert not back.fits
    # A nominated pod is placed first; one that does not fit there takes nothing.
    crowding = wanting("nominee", mem=5000, priority=60)
    assert not what_if(
        h, "p", "n1", decision_id=decision, removed=("uid-low",), added=(crowding,)
    ).fits
    huge = wanting("huge", mem=9000, priority=60)
    assert what_if(h, "p", "n1", decision_id=decision, removed=("uid-low",), added=(huge,)).fits
    bad_request = wanting("bad", mem=1000, priority=60)
    bad_request["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = 150
    assert what_if(
        h, "p", "n1", decision_id=decision, removed=("uid-low",), added=(bad_request,)
    ).fits
    # The state itself never changed.
    assert h.cache.state.allocation("default/low") is not None


def test_filter_what_if_frees_the_mig_placement_of_1g_victims(h: Harness) -> None:
    h.cache.apply_node(node_obj("m", mig_gpu("GPU-m")))
    mig = [
        {"containerIndex": 0, "deviceIndex": 0, "gpuUUID": "GPU-m", "profile": "1g.5gb"}
        | {"placement": {"start": start, "size": 1}}
        for start in (1, 5)
    ]
    for i, entry in enumerate(mig):
        pod = victim(f"small-{i}", "m", [("GPU-m", 4864, 15)], priority=0)
        pod["metadata"]["annotations"][ann.MIG_ALLOCATIONS] = json.dumps([entry])
        h.cache.apply_pod(pod)
    r = h.prefilter(wanting("big", mem=20_000, mode="mig", priority=10))
    assert r.code == UNSCHEDULABLE and "fragmentation" in r.message
    assert list(r.preemptible_nodes) == ["m"]
    assert what_if(h, "big", "m", decision_id=r.decision_id, removed=("uid-small-1",)).fits


def test_filter_what_if_reads_the_pod_when_the_decision_is_gone(h: Harness) -> None:
    two_busy_nodes(h)
    pod = wanting("p", mem=4000, priority=50)
    # Never PreFiltered: without pod_json there is nothing to evaluate.
    with pytest.raises(grpc.RpcError) as e:
        what_if(h, "p", "n1", removed=("uid-low",))
    assert _code(e) == grpc.StatusCode.NOT_FOUND and "no PreFilter decision" in _details(e)
    assert what_if(h, "p", "n1", removed=("uid-low",), pod_json=json.dumps(pod).encode()).fits


@pytest.mark.parametrize(
    ("change", "code", "problem"),
    [
        ({"node": "nowhere"}, grpc.StatusCode.NOT_FOUND, "'nowhere' is not in the cluster state"),
        ({"node": ""}, grpc.StatusCode.INVALID_ARGUMENT, "node is empty"),
        (  # read when the decision is no longer held
            {"pod_json": b"{not json", "decision_id": 0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "pod_json is not JSON",
        ),
        ({"added_pods_json": [b"[1]"]}, grpc.StatusCode.INVALID_ARGUMENT, "added_pods_json[0]"),
        ({"version": 0}, grpc.StatusCode.FAILED_PRECONDITION, "protocol version 0"),
        ({"pod": pb.PodRef(name="Bad_Name")}, grpc.StatusCode.INVALID_ARGUMENT, "Bad_Name"),
        (
            {"pod": pb.PodRef(namespace="default", name="other", uid="uid-p")},
            grpc.StatusCode.INVALID_ARGUMENT,
            "does not match pod default/p",
        ),
    ],
)
def test_filter_what_if_refuses_what_it_cannot_answer(
    h: Harness, change: dict[str, Any], code: grpc.StatusCode, problem: str
) -> None:
    two_busy_nodes(h)
    decision = h.prefilter(wanting("p", mem=4000, priority=50)).decision_id
    fields: dict[str, Any] = {
        "version": V1,
        "pod": ref("p"),
        "decision_id": decision,
        "node": "n1",
        "removed_pod_uids": ["uid-low"],
    }
    fields.update(change)
    with pytest.raises(grpc.RpcError) as e:
        h.stub.FilterWhatIf(pb.FilterWhatIfRequest(**fields), timeout=10)
    assert _code(e) == code and problem in _details(e)


# ----- the watch: victims, the preemptor's Event, metrics --------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def watched() -> Iterator[tuple[ClusterCache, FakeKube, EventRecorder, SchedulingMetrics, Clock]]:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    kube = FakeKube()
    events = EventRecorder(kube)
    events.start()
    metrics = SchedulingMetrics()
    clock = Clock()
    try:
        yield cache, kube, events, metrics, clock
    finally:
        events.stop()


def marked(pod: dict[str, Any], *, deleting: bool = True) -> dict[str, Any]:
    """``pod`` as kube-scheduler leaves it when it preempts it."""
    out = json.loads(json.dumps(pod))
    out["status"]["conditions"] = [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "hami-scheduler: preempting to accommodate a higher priority pod",
        }
    ]
    if deleting:
        out["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return out


def nominated(pod: dict[str, Any], node: str) -> dict[str, Any]:
    out = json.loads(json.dumps(pod))
    out["status"] = {"phase": "Pending", "nominatedNodeName": node}
    return out


def test_a_victim_keeps_counting_until_it_is_gone(
    watched: tuple[ClusterCache, FakeKube, EventRecorder, SchedulingMetrics, Clock],
) -> None:
    cache, _, _, _, _ = watched
    seen: list[str] = []
    cache.on_preemption(
        lambda pod, held: seen.append(f"victim {pod['metadata']['name']} {held is not None}"),
        lambda pod, node: seen.append(f"nominated {pod['metadata']['name']} {node}"),
    )
    cache.apply_node(node_obj("n1", gpu("GPU-1")))
    low = victim("low", "n1", [("GPU-1", 6000, 10)], priority=0)
    cache.apply_pod(low)
    held = cache.state.usage_snapshot()
    cache.apply_pod(marked(low, deleting=False))
    cache.apply_pod(marked(low))  # then deleted: terminating, its containers may still run
    cache.apply_pod(marked(low))  # an event that changes nothing read
    assert cache.state.usage_snapshot() == held  # nothing can be given its devices yet
    preemptor = wanting("p", mem=4000, priority=50)
    cache.apply_pod(nominated(preemptor, "n1"))
    cache.apply_pod(nominated(preemptor, "n1"))
    cache.delete_pod(marked(low))  # DELETED: only now are its devices free
    assert cache.state.usage_snapshot()["n1/GPU-1"][:3] == (0.0, 0.0, 0.0)
    bound = nominated(preemptor, "n1")
    bound["spec"]["nodeName"] = "n1"  # bound: no longer nominated
    cache.apply_pod(bound)
    assert seen == ["victim low True", "nominated p n1", "nominated p "]


@pytest.mark.parametrize("victims_first", [True, False])
def test_a_preemption_gets_one_event_on_the_preemptor_and_is_counted(
    watched: tuple[ClusterCache, FakeKube, EventRecorder, SchedulingMetrics, Clock],
    victims_first: bool,
) -> None:
    cache, kube, events, metrics, clock = watched
    reporter = PreemptionReporter(cache, events, metrics, clock=clock, settle_s=2.0)
    cache.apply_node(node_obj("n1", gpu("GPU-1"), gpu("GPU-2", index=1)))
    a = victim("a", "n1", [("GPU-1", 3000, 10)], priority=0)
    b = victim("b", "n1", [("GPU-1", 3000, 10)], priority=1)
    bystander = victim("c", "n1", [("GPU-2", 7000, 10)], priority=0)
    for pod in (a, b, bystander):
        cache.apply_pod(pod)
    preemptor = wanting("p", mem=5000, priority=50)
    steps = [lambda: cache.apply_pod(marked(a)), lambda: cache.apply_pod(marked(b))]
    nominate = [lambda: cache.apply_pod(nominated(preemptor, "n1"))]
    for step in steps + nominate if victims_first else nominate + steps:
        step()
        clock.now += 0.5
    cache.delete_pod(a)  # one of them is gone before the report: its devices still count
    assert reporter.tick() == 0  # a victim joined 0.5 s ago: more may come
    clock.now += 2
    assert reporter.tick() == 1
    assert reporter.tick() == 0  # once
    events.flush()
    [(path, event)] = kube.posts
    assert path == "/api/v1/namespaces/default/events"
    assert event["reason"] == PREEMPTION_REASON and event["type"] == "Normal"
    assert event["involvedObject"]["uid"] == "uid-p"
    message = event["message"]
    assert "preempted 2 pods on node n1" in message
    assert "default/a (priority 0, held GPU GPU-1 3000MiB 10% cores)" in message
    assert "default/b (priority 1" in message and "default/c" not in message
    assert "did not fit there with them: insufficient GPU memory. Preempted: " in message
    sample = metrics.registry.get_sample_value
    assert sample("tessera_preemptions_total", {"reason": "memory"}) == 1
    assert sample("tessera_preemptions_total", {"reason": "cores"}) == 0
    assert sample("tessera_preemption_victims_total") == 2
    assert all(sample("tessera_preemptions_total", {"reason": r}) is not None for r in NEED_LABELS)


def test_victims_without_a_preemptor_that_outranks_them_are_not_reported(
    watched: tuple[ClusterCache, FakeKube, EventRecorder, SchedulingMetrics, Clock],
) -> None:
    cache, kube, events, metrics, clock = watched
    reporter = PreemptionReporter(cache, events, metrics, clock=clock, window_s=10)
    cache.apply_node(node_obj("n1", gpu("GPU-1")))
    cache.apply_node(node_obj("n2", gpu("GPU-2")))
    high = victim("high", "n1", [("GPU-1", 3000, 10)], priority=100)
    cache.apply_pod(high)
    cache.apply_pod(marked(high))
    cache.apply_pod(nominated(wanting("p", mem=5000, priority=50), "n1"))  # outranked
    cache.apply_pod(nominated(wanting("q", mem=5000, priority=500), "n2"))  # another node
    no_gpu = make_pod("cpu").container(cpu="1").on("n1").build()
    cache.apply_pod(nominated(no_gpu, "n1"))
    clock.now += 60
    assert reporter.tick() == 0
    events.flush()
    assert kube.posts == []
    assert metrics.registry.get_sample_value("tessera_preemption_victims_total") == 0


def test_one_bad_object_does_not_stop_the_rest(
    watched: tuple[ClusterCache, FakeKube, EventRecorder, SchedulingMetrics, Clock],
) -> None:
    cache, kube, events, metrics, clock = watched
    reporter = PreemptionReporter(cache, events, metrics, clock=clock)
    cache.apply_node(node_obj("n1", gpu("GPU-1")))
    low = victim("low", "n1", [("GPU-1", 6000, 10)], priority=0)
    cache.apply_pod(low)
    broken = nominated(wanting("bad", mem=1000, priority=50), "n1")
    broken["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = "lots"
    cache.apply_pod(broken)  # its request cannot be read: left out
    cache.apply_pod(nominated(wanting("p", mem=4000, priority=50), "n1"))
    cache.apply_pod(marked(low))
    cache.delete_node("n1")  # the node goes too: the report says nothing of GPUs, but comes
    clock.now += 5
    assert reporter.tick() == 1
    events.flush()
    [(_, event)] = kube.posts
    assert event["involvedObject"]["name"] == "p"
    assert metrics.registry.get_sample_value("tessera_preemptions_total", {"reason": "other"}) == 1


def test_pods_being_preempted_count_for_placement_but_not_for_another_dry_run(
    h: Harness,
) -> None:
    """kube-scheduler may have seen a victim deleted before this server's watch did: its
    next dry run for the same room must not find more victims (the pod being preempted is
    gone for every what-if), while nothing may be placed on what it still holds."""
    h.cache.apply_node(node_obj("n1", gpu("GPU-1"), gpu("GPU-2", index=1)))
    going = victim("going", "n1", [("GPU-1", 6000, 10)], priority=0)
    staying = victim("staying", "n1", [("GPU-2", 6000, 10)], priority=0)
    h.cache.apply_pod(going)
    h.cache.apply_pod(staying)
    h.cache.apply_pod(marked(going))
    r = h.prefilter(wanting("p", mem=4000, priority=50))
    assert r.code == UNSCHEDULABLE  # GPU-1 is still held: nothing is placed on it yet
    assert list(r.preemptible_nodes) == ["n1"]
    # The dry run: with the remaining lower pod removed, then added back, it fits: no victim.
    assert what_if(h, "p", "n1", decision_id=r.decision_id, removed=("uid-staying",)).fits
    assert what_if(h, "p", "n1", decision_id=r.decision_id).fits
    # Even added back by the dry run, it stays gone.
    back = what_if(h, "p", "n1", decision_id=r.decision_id, removed=("uid-going",), added=(going,))
    assert back.fits
    h.cache.delete_pod(going)
    assert h.prefilter(wanting("p", mem=4000, priority=50)).code == OK


def test_a_pod_whose_victims_are_still_leaving_preempts_nowhere_else(h: Harness) -> None:
    """kube-scheduler may see the victims on a pod's nominated node deleted before this
    server does; it would then preempt again elsewhere for the same pod. Until they are gone
    here, the nominated node is the only preemptible one."""
    h.cache.apply_node(node_obj("n1", gpu("GPU-1")))
    h.cache.apply_node(node_obj("n2", gpu("GPU-2")))
    going = victim("going", "n1", [("GPU-1", 6000, 10)], priority=0)
    h.cache.apply_pod(going)
    h.cache.apply_pod(victim("other", "n2", [("GPU-2", 6000, 10)], priority=0))
    preemptor = wanting("p", mem=4000, priority=50)
    assert sorted(h.prefilter(preemptor).preemptible_nodes) == ["n1", "n2"]
    h.cache.apply_pod(marked(going))  # preempted for p, nominated to n1
    preemptor["status"] = {"nominatedNodeName": "n1"}
    assert list(h.prefilter(preemptor).preemptible_nodes) == ["n1"]
    # Nominated elsewhere (no victim of its own leaving there): every node, as before.
    preemptor["status"] = {"nominatedNodeName": "n2"}
    assert sorted(h.prefilter(preemptor).preemptible_nodes) == ["n1", "n2"]
    h.cache.delete_pod(going)  # gone: the pod now fits n1
    preemptor["status"] = {"nominatedNodeName": "n1"}
    assert h.prefilter(preemptor).code == OK
