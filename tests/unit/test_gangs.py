"""Gangs in the plugin server: the gang book (what PreFilter found for each member), the
readers of PodGroups, and the reporter that counts ``tessera_gangs_total`` and posts the
``TesseraGangUnschedulable`` Event when kube-scheduler refuses a gang."""

from __future__ import annotations

from typing import Any

import pytest

from api.kube.errors import KubeError, NotFoundError
from scheduler_plugins.core.gangs import GangBook, gang_policy, pod_gang, scheduled_condition
from scheduler_plugins.server.events import GANG_REASON, EventRecorder
from scheduler_plugins.server.gangs import GROUP_VERSION, GangReporter
from scheduler_plugins.server.metrics import SchedulingMetrics


def podgroup(
    name: str,
    *,
    min_count: object = 4,
    condition: tuple[str, str] | None = None,
    basic: bool = False,
) -> dict[str, Any]:
    policy: dict[str, Any] = {"basic": {}} if basic else {"gang": {"minCount": min_count}}
    pg: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {"schedulingPolicy": policy},
    }
    if condition is not None:
        pg["status"] = {
            "conditions": [
                {"type": "PodGroupScheduled", "status": condition[0], "reason": condition[1]}
            ]
        }
    return pg


def member(name: str, group: str | None = "train") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": []}
    if group is not None:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec}


# ----- readers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "want"),
    [
        (member("a"), "ml/train"),
        (member("a", None), None),
        (
            {"metadata": {"name": "a"}, "spec": {"schedulingGroup": {"podGroupName": "g"}}},
            "default/g",
        ),
        ({"metadata": {}, "spec": {"schedulingGroup": {"podGroupName": ""}}}, None),
        ({"metadata": {}, "spec": {"schedulingGroup": "not an object"}}, None),
        ({"metadata": {}, "spec": {"schedulingGroup": {"podGroupName": 7}}}, None),
        ({}, None),
    ],
)
def test_pod_gang(pod: dict[str, Any], want: str | None) -> None:
    assert pod_gang(pod) == want


@pytest.mark.parametrize(
    ("pg", "want"),
    [
        (podgroup("g", min_count=4), 4),
        (podgroup("g", min_count=1), 1),
        (podgroup("g", basic=True), None),
        (podgroup("g", min_count=0), None),
        (podgroup("g", min_count=-2), None),
        (podgroup("g", min_count="4"), None),
        (podgroup("g", min_count=True), None),
        ({"spec": None}, None),
        ({}, None),
    ],
)
def test_gang_policy(pg: dict[str, Any], want: int | None) -> None:
    assert gang_policy(pg) == want


def test_scheduled_condition() -> None:
    assert scheduled_condition(podgroup("g")) is None
    assert scheduled_condition(podgroup("g", condition=("False", "Unschedulable"))) == (
        "False",
        "Unschedulable",
    )
    other = {"status": {"conditions": [{"type": "Other", "status": "True"}, "junk"]}}
    assert scheduled_condition(other) is None
    assert scheduled_condition({"status": {"conditions": "junk"}}) is None


# ----- the book ------------------------------------------------------------------------------


def test_summary_names_the_members_that_did_not_fit_and_why() -> None:
    book = GangBook()
    for pod in ("ml/w-0", "ml/w-1", "ml/w-2"):
        book.offered("ml/train", pod, None)
    book.offered("ml/train", "ml/w-3", "0/3 nodes: insufficient GPU memory")
    text = book.summary("ml/train", 4)
    assert text.startswith("gang ml/train (minCount 4): 3 of 4 members fit")
    assert "not placed: ml/w-3: 0/3 nodes: insufficient GPU memory" in text

    # The member's next PreFilter fits: the book keeps only the latest answer per member.
    book.offered("ml/train", "ml/w-3", None)
    assert "all 4 members fit" in book.summary("ml/train", 4)
    assert "not seen a member" in book.summary("ml/other", None)


def test_summary_counts_members_beyond_the_named_ones() -> None:
    book = GangBook()
    for i in range(8):
        book.offered("ml/big", f"ml/w-{i}", f"reason {i}")
    text = book.summary("ml/big", 8)
    assert "0 of 8 members fit" in text and "reason 4" in text and "reason 5" not in text
    assert text.endswith("; and 3 more")


def test_a_release_counts_once_per_admission() -> None:
    book = GangBook()
    book.offered("ml/train", "ml/w-0", None)
    book.offered("ml/train", "ml/w-1", None)
    assert book.released("ml/unknown") is None
    assert book.released("ml/w-0") is None  # not admitted (a basic PodGroup, a trial)
    book.admitted("ml/train")
    assert book.released("ml/w-0") == "ml/train"
    assert book.released("ml/w-1") is None  # the same gang, the same admission
    book.admitted("ml/train")
    assert book.released("ml/w-1") == "ml/train"


def test_the_book_is_bounded_and_forgets_members_with_their_gang() -> None:
    book = GangBook(max_gangs=2)
    for gang in ("ml/a", "ml/b", "ml/c"):
        book.offered(gang, f"{gang}-pod", None)
    assert book.gang_of("ml/a-pod") is None  # the least recently offered gang went
    assert book.gang_of("ml/c-pod") == "ml/c"
    book.forget("ml/c")
    assert book.gang_of("ml/c-pod") is None
    book.forget("ml/never")  # nothing to forget is fine


# ----- the reporter --------------------------------------------------------------------------


class FakeKube:
    def __init__(self, serves: bool = True, get_error: Exception | None = None) -> None:
        self.serves = serves
        self.get_error = get_error
        self.gets: list[str] = []
        self.posts: list[tuple[str, Any]] = []

    def get(self, path: str) -> Any:
        self.gets.append(path)
        if self.get_error is not None:
            raise self.get_error
        if not self.serves:
            raise NotFoundError(
                "GET", path, 404, "NotFound", "the server could not find the requested resource"
            )
        return {"groupVersion": GROUP_VERSION}

    def list(self, path: str) -> Any:
        return {"metadata": {"resourceVersion": "1"}, "items": []}

    def watch(self, path: str, resource_version: str | None = None, *, timeout_s: int = 60) -> Any:
        raise KubeError("no watch in this test")

    def post(self, path: str, body: object) -> Any:
        self.posts.append((path, body))
        return body


def reporter(kube: FakeKube) -> tuple[GangReporter, SchedulingMetrics, EventRecorder]:
    metrics = SchedulingMetrics()
    events = EventRecorder(kube, min_interval_s=60)
    return GangReporter(kube, events, metrics), metrics, events


def count(metrics: SchedulingMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("tessera_gangs_total", {"outcome": outcome})
    assert value is not None
    return value


def test_an_api_server_without_podgroups_turns_the_watch_off() -> None:
    gangs, metrics, _ = reporter(FakeKube(serves=False))
    gangs.start()
    assert not gangs.watching
    for outcome in ("admitted", "unschedulable", "timed_out"):
        assert count(metrics, outcome) == 0  # exported from the start


def test_an_unreachable_api_server_still_watches() -> None:
    gangs, _, _ = reporter(FakeKube(get_error=KubeError("connection refused")))
    gangs.start()
    try:
        assert gangs.watching
    finally:
        gangs.stop()


def test_condition_changes_count_and_a_refused_gang_gets_an_event() -> None:
    kube = FakeKube()
    gangs, metrics, events = reporter(kube)
    events.start()
    try:
        # The (re)list is the state as it is: nothing counted.
        gangs._listed([podgroup("old", condition=("True", "Scheduled"))], 0.0)
        gangs._event("MODIFIED", podgroup("old", condition=("True", "Scheduled")))
        assert count(metrics, "admitted") == 0

        for i in range(3):
            gangs.offered(member(f"w-{i}"), f"ml/w-{i}", None)
        gangs.offered(member("w-3"), "ml/w-3", "0/3 nodes: fewer fitting GPUs than requested")
        gangs.offered(member("solo", None), "ml/solo", "no GPU")  # not a gang member

        gangs._event("ADDED", podgroup("train"))  # no condition yet
        gangs._event("MODIFIED", podgroup("train", condition=("False", "Unschedulable")))
        gangs._event("MODIFIED", podgroup("train", condition=("False", "Unschedulable")))
        assert count(metrics, "unschedulable") == 1  # a change, not every update
        events.flush()
        [(path, event)] = kube.posts
        assert path == "/api/v1/namespaces/ml/events"
        assert event["reason"] == GANG_REASON
        assert event["involvedObject"] == {
            "apiVersion": GROUP_VERSION,
            "kind": "PodGroup",
            "namespace": "ml",
            "name": "train",
            "uid": "uid-train",
        }
        assert "3 of 4 members fit" in event["message"] and "ml/w-3" in event["message"]
        assert "ml/solo" not in event["message"]

        gangs._event("MODIFIED", podgroup("train", condition=("True", "Scheduled")))
        assert count(metrics, "admitted") == 1
        gangs.released("ml/w-0")
        gangs.released("ml/w-1")
        assert count(metrics, "timed_out") == 1

        # A scheduler error is neither outcome; a non-gang PodGroup is not counted.
        gangs._event("MODIFIED", podgroup("err", condition=("False", "SchedulerError")))
        gangs._event("MODIFIED", podgroup("basic", basic=True, condition=("True", "Scheduled")))
        assert count(metrics, "unschedulable") == 1 and count(metrics, "admitted") == 1

        gangs._event("DELETED", podgroup("train"))
        gangs.released("ml/w-2")  # its gang is gone: nothing to count
        assert count(metrics, "timed_out") == 1
    finally:
        events.stop()
