"""kwok mode's pod index, annotation-guarded patches and per-node work queues."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from api.hami.config import DeviceConfig
from api.hami.keys import BIND_PHASE, DEVICES_TO_ALLOCATE
from node_agent.kwok_mode import KwokAgents, NodeQueues, PodIndex, guarded_ops
from tests.node_agent_fakes import FakeKube
from tests.waiting import eventually


def pod(name: str, rv: int, node: str = "n1", **annotations: str) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": str(rv),
            "annotations": dict(annotations),
        },
        "spec": {"nodeName": node} if node else {},
    }


def modified(p: dict[str, Any]) -> bytes:
    """A MODIFIED watch event of ``p`` as the apiserver writes it (compact, kind first)."""
    obj = {"kind": "Pod", "apiVersion": "v1", **p}
    return json.dumps({"type": "MODIFIED", "object": obj}, separators=(",", ":")).encode()


# PodIndex --------------------------------------------------------------------------------------


def test_index_holds_the_versions_it_has_or_older_and_counts_what_it_spares() -> None:
    idx = PodIndex()
    idx.offer(pod("a", 5))
    assert idx.holds(modified(pod("a", 5)))  # the echo of a write whose answer is indexed
    assert idx.holds(modified(pod("a", 4)))
    assert not idx.holds(modified(pod("a", 6)))  # newer: decoded and offered
    assert not idx.holds(modified(pod("b", 1)))  # not indexed
    added = modified(pod("a", 5)).replace(b'"MODIFIED"', b'"ADDED"')
    assert not idx.holds(added)
    idx.delete(pod("a", 8))
    assert idx.holds(modified(pod("a", 7)))  # older than the deletion
    assert idx.echoes == 3


@pytest.mark.parametrize(
    ("held_annotations", "status", "deleting", "skipped"),
    [
        # kwok marking an allocated pod running: nothing the agent reads changes
        ({BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}, {"phase": "Running"}, False, True),
        # ... but its end must reach the agent (it reclaims MIG instances)
        ({BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}, {"phase": "Succeeded"}, False, False),
        ({BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}, {"phase": "Failed"}, False, False),
        ({BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}, {"phase": "Running"}, True, False),
        # a pod with work left, or whose allocation failed, is always decoded
        (
            {BIND_PHASE: "allocating", DEVICES_TO_ALLOCATE: "GPU-1,NVIDIA,1000,10:;"},
            {},
            False,
            False,
        ),
        ({BIND_PHASE: "success", DEVICES_TO_ALLOCATE: "GPU-1,NVIDIA,1000,10:;"}, {}, False, False),
        ({BIND_PHASE: "failed"}, {"phase": "Running"}, False, False),
    ],
)
def test_index_spares_newer_versions_of_a_pod_done_allocating_unless_they_may_end_it(
    held_annotations: dict[str, str], status: dict[str, str], deleting: bool, skipped: bool
) -> None:
    idx = PodIndex()
    idx.offer(pod("a", 5, **held_annotations))
    newer = pod("a", 6, **held_annotations)
    newer["status"] = status
    if deleting:
        newer["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert idx.holds(modified(newer)) is skipped
    assert (idx.settled, idx.echoes) == (int(skipped), 0)
    held = idx.get("ns/a")
    assert held is not None and held["metadata"]["resourceVersion"] == "5"  # kept as it was


def test_index_keeps_the_newest_version_whatever_the_arrival_order() -> None:
    idx = PodIndex()
    assert idx.offer(pod("a", 5, phase="x"))
    assert not idx.offer(pod("a", 4, phase="old"))  # a late watch event behind our write
    assert not idx.offer(pod("a", 5, phase="x"))
    assert idx.offer(pod("a", 7, phase="new"))
    got = idx.get("ns/a")
    assert got is not None and got["metadata"]["annotations"] == {"phase": "new"}


def test_index_groups_by_node_and_follows_moves() -> None:
    idx = PodIndex()
    idx.offer(pod("a", 1, node=""))
    assert idx.on_node("n1") == []
    idx.offer(pod("a", 2, node="n1"))
    idx.offer(pod("b", 3, node="n1"))
    idx.offer(pod("c", 4, node="n2"))
    assert sorted(p["metadata"]["name"] for p in idx.on_node("n1")) == ["a", "b"]
    assert [p["metadata"]["name"] for p in idx.on_node("n2")] == ["c"]


def test_a_deleted_pod_is_not_brought_back_by_an_older_answer() -> None:
    idx = PodIndex()
    idx.offer(pod("a", 3))
    idx.delete(pod("a", 6))
    assert idx.get("ns/a") is None and idx.on_node("n1") == []
    assert not idx.offer(pod("a", 5))  # our patch's answer, sent before the delete
    assert idx.offer(pod("a", 9))  # a new pod of the same name


def test_index_remembers_recent_versions_of_metadata() -> None:
    idx = PodIndex()
    for rv in range(1, 7):
        idx.offer(pod("a", rv, step=str(rv)))
    meta = pod("a", 6, step="6")["metadata"]
    assert idx.metadata_at("ns/a", "6") == {
        "uid": meta["uid"],
        "resourceVersion": "6",
        "annotations": {"step": "6"},
    }
    assert idx.metadata_at("ns/a", "3") is not None
    assert idx.metadata_at("ns/a", "1") is None  # forgotten: older than the last four
    assert idx.metadata_at("ns/b", "1") is None


def test_replace_all_is_the_whole_truth() -> None:
    idx = PodIndex()
    idx.offer(pod("a", 1))
    idx.delete(pod("b", 9))
    idx.replace_all([pod("b", 2), {"metadata": {"name": "c", "namespace": "ns"}, "spec": {}}])
    assert idx.get("ns/a") is None
    assert idx.get("ns/b") is not None  # the tombstone went with the old truth
    assert idx.get("ns/c") is not None  # list items carry no kind


def test_replace_all_keeps_a_newer_known_version() -> None:
    idx = PodIndex()
    idx.offer(pod("a", 8, phase="ours"))  # our patch's answer, newer than the list
    idx.replace_all([pod("a", 5, phase="listed")])
    got = idx.get("ns/a")
    assert got is not None and got["metadata"]["annotations"] == {"phase": "ours"}


def test_replace_all_never_shows_a_half_filled_index() -> None:
    """A reconcile reading the index during a re-list must find every pod that stays."""
    idx = PodIndex()
    idx.offer(pod("keep", 1))
    listed = [pod(f"p{i}", i + 2) for i in range(3000)] + [pod("keep", 1)]
    missing = 0
    done = threading.Event()

    def read() -> None:
        nonlocal missing
        while not done.is_set():
            if not any(p["metadata"]["name"] == "keep" for p in idx.on_node("n1")):
                missing += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            idx.replace_all(listed)
    finally:
        done.set()
        reader.join(5)
    assert missing == 0


def test_index_keeps_only_what_allocation_reads() -> None:
    idx = PodIndex()
    p = pod("a", 1, x="y")
    p["metadata"]["managedFields"] = [{"manager": "kwok", "fieldsV1": {"f:status": {}}}]
    p["spec"].update(containers=[{"name": "c"}], tolerations=[{"key": "k"}], volumes=[])
    p["status"] = {"phase": "Running", "conditions": [{"type": "Ready"}]}
    idx.offer(p)
    assert idx.get("ns/a") == {
        "kind": "Pod",
        "metadata": {k: v for k, v in p["metadata"].items() if k != "managedFields"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c"}]},
        "status": {"phase": "Running"},
    }
    assert "managedFields" in p["metadata"]  # the caller's object is left alone


def test_non_pods_are_ignored() -> None:
    idx = PodIndex()
    assert not idx.offer({"kind": "Status", "metadata": {"name": "x"}})


# guarded_ops -----------------------------------------------------------------------------------


def test_guarded_ops_test_uid_and_changed_annotations() -> None:
    current = pod("a", 3, **{"hami.io/bind-phase": "allocating", "x~y": "1"})
    patch = {"metadata": {"annotations": {"hami.io/bind-phase": "success", "new/key": "v"}}}
    assert guarded_ops(current, patch) == [
        {"op": "test", "path": "/metadata/uid", "value": "uid-a"},
        {"op": "test", "path": "/metadata/annotations/hami.io~1bind-phase", "value": "allocating"},
        {"op": "add", "path": "/metadata/annotations/hami.io~1bind-phase", "value": "success"},
        {"op": "add", "path": "/metadata/annotations/new~1key", "value": "v"},
    ]
    escaped = guarded_ops(current, {"metadata": {"annotations": {"x~y": "2"}}})
    assert escaped is not None and escaped[1]["path"] == "/metadata/annotations/x~0y"


@pytest.mark.parametrize(
    "patch",
    [
        {"metadata": {"annotations": {"a": "1"}, "labels": {"b": "2"}}},
        {"metadata": {"annotations": {"a": None}}},  # a removal: not expressible as a test+add
        {"status": {"phase": "Failed"}},
        {"metadata": {"annotations": "x"}},
    ],
)
def test_guarded_ops_leave_other_patches_alone(patch: dict[str, Any]) -> None:
    assert guarded_ops(pod("a", 1, a="0"), patch) is None


def test_guarded_ops_need_the_pod_read() -> None:
    patch = {"metadata": {"annotations": {"a": "1"}}}
    assert guarded_ops(None, patch) is None
    assert guarded_ops({"metadata": {"annotations": {"a": "0"}}}, patch) is None  # no uid


# NodeQueues ------------------------------------------------------------------------------------


def test_one_node_runs_in_order_nodes_run_in_parallel() -> None:
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()
    gate = threading.Event()
    both_running = threading.Barrier(2, timeout=5)

    def handler(node: str, item: str) -> None:
        if item == "first":
            both_running.wait()  # n1 and n2 are worked on at the same time
            gate.wait(5)
        with lock:
            seen.append((node, item))

    q = NodeQueues(handler, workers=4)
    try:
        q.submit("n1", "first")
        q.submit("n2", "first")
        for i in range(5):
            q.submit("n1", f"i{i}")
        gate.set()
        eventually(q.idle, timeout_s=5, interval_s=0.01)
    finally:
        q.close()
    assert [i for n, i in seen if n == "n1"] == ["first", "i0", "i1", "i2", "i3", "i4"]
    assert ("n2", "first") in seen


class _Recorder:
    """A queue handler that records the items it runs and holds the item "busy" until
    ``release`` is set (``started`` tells it is running)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, node: str, item: str) -> None:
        self.calls.append(item)
        if item == "busy":
            self.started.set()
            self.release.wait(5)


def test_an_item_waiting_is_not_queued_twice() -> None:
    handler = _Recorder()
    calls, started, release = handler.calls, handler.started, handler.release
    q = NodeQueues(handler, workers=1)
    try:
        q.submit("n", "busy")
        assert started.wait(5)
        for _ in range(3):
            q.submit("n", "pod")
        release.set()
        eventually(q.idle, timeout_s=5, interval_s=0.01)
    finally:
        q.close()
    assert calls == ["busy", "pod"]


def test_a_failing_item_does_not_stop_the_queue() -> None:
    calls: list[str] = []

    def handler(node: str, item: str) -> None:
        calls.append(item)
        if item == "bad":
            raise RuntimeError("boom")

    q = NodeQueues(handler, workers=1)
    try:
        q.submit("n", "bad")
        q.submit("n", "good")
        eventually(lambda: calls == ["bad", "good"] and q.idle(), timeout_s=5, interval_s=0.01)
    finally:
        q.close()


def test_close_lets_the_running_item_finish_and_drops_the_rest() -> None:
    handler = _Recorder()
    calls, started, release = handler.calls, handler.started, handler.release
    q = NodeQueues(handler, workers=2)
    q.submit("n", "busy")
    assert started.wait(5)
    q.submit("n", "waiting")
    workers = list(q._threads)
    closing = threading.Thread(target=q.close)
    closing.start()
    release.set()
    closing.join(5)
    assert not closing.is_alive()
    q.submit("n", "after")  # a closed queue takes nothing
    assert calls == ["busy"]
    assert len(workers) == 2 and not any(t.is_alive() for t in workers)  # its threads are gone


# Which events wake a node's worker ---------------------------------------------------------------


def test_only_events_with_work_queue_a_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocating pod, a pod gone, moved or ended wake the node's worker; kwok marking an
    allocated pod running does not (nothing for the worker to do)."""
    agents = KwokAgents(FakeKube(), DeviceConfig())  # type: ignore[arg-type]
    queued: list[tuple[str, str]] = []
    monkeypatch.setattr(agents._queues, "submit", lambda node, item: queued.append((node, item)))
    try:
        allocating = pod(
            "a", 1, **{BIND_PHASE: "allocating", DEVICES_TO_ALLOCATE: "GPU-1,NVIDIA,1000,10:;"}
        )
        allocated = pod("a", 2, **{BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"})
        running = {
            **pod("a", 3, **{BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}),
            "status": {"phase": "Running"},
        }
        done = {**pod("a", 4, **{BIND_PHASE: "success"}), "status": {"phase": "Succeeded"}}
        cases = [
            ("ADDED", allocating, True),
            ("MODIFIED", allocated, False),
            ("MODIFIED", running, False),
            ("MODIFIED", done, True),  # ended: its MIG instances may go
            ("DELETED", done, True),
        ]
        for event, obj, wakes in cases:
            queued.clear()
            agents.handle(event, obj)
            assert queued == ([("n1", "ns/a")] if wakes else []), (event, obj)
        # A version older than the one held decides nothing: the held one is looked at.
        agents.handle("ADDED", pod("b", 9, **{BIND_PHASE: "success", DEVICES_TO_ALLOCATE: ";"}))
        queued.clear()
        agents.handle(
            "MODIFIED",
            pod(
                "b", 8, **{BIND_PHASE: "allocating", DEVICES_TO_ALLOCATE: "GPU-1,NVIDIA,1000,10:;"}
            ),
        )
        assert queued == []
    finally:
        agents.stop()
