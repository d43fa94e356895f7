"""Which pod an Allocate is for: the matching rule, its one blind spot, and ambiguous()."""

from __future__ import annotations

from typing import Any

import pytest

from node_agent.deviceplugin.ids import InvalidDeviceIdError
from node_agent.pod_matching import (
    AmbiguousPodError,
    NoMatchingPodError,
    ambiguous,
    annotations_of,
    match_pod,
)
from scheduler_plugins.annotations import DEVICES_TO_ALLOCATE
from tests.node_agent_fakes import make_pod

A, B = "GPU-aaaa-1111", "GPU-bbbb-2222"
NODE = "node-a"


def one(uuid: str = A) -> list[list[tuple[str, int, int]]]:
    return [[(uuid, 1000, 10)]]


def partly_done(pod: dict[str, Any]) -> dict[str, Any]:
    """Container 0 allocated already, container 1 waiting."""
    pod["metadata"]["annotations"][DEVICES_TO_ALLOCATE] = ";" + f"{A},NVIDIA,1000,10:;"
    return pod


CASES: list[tuple[str, list[dict[str, Any]], list[str], str | type[Exception], int]] = [
    ("single candidate", [make_pod("p", devices=one())], [f"{A}-3"], "p", 0),
    (
        "device count differs",
        [make_pod("p", devices=one())],
        [f"{A}-0", f"{A}-1"],
        NoMatchingPodError,
        0,
    ),
    ("other GPU", [make_pod("p", devices=one())], [f"{B}-0"], NoMatchingPodError, 0),
    (
        "already allocated",
        [make_pod("p", devices=one(), phase_annotation="success")],
        [f"{A}-0"],
        NoMatchingPodError,
        0,
    ),
    (
        "other node",
        [make_pod("p", node="node-b", devices=one())],
        [f"{A}-0"],
        NoMatchingPodError,
        0,
    ),
    (
        "bound by vgpu-node only",
        [make_pod("p", node=None, vgpu_node=NODE, devices=one())],
        [f"{A}-0"],
        "p",
        0,
    ),
    (
        "next container skips empty entries",
        [make_pod("p", devices=[[], [(A, 1000, 10)]], containers=[{"name": "x"}, {"name": "y"}])],
        [f"{A}-0"],
        "p",
        1,
    ),
    (
        "two GPUs, any order",
        [make_pod("p", devices=[[(B, 1, 1), (A, 1, 1)]])],
        [f"{A}-0", f"{B}-4"],
        "p",
        0,
    ),
    (
        "same GPU twice needs two ids on it",
        [make_pod("p", devices=[[(A, 1, 1), (A, 1, 1)]])],
        [f"{A}-0", f"{B}-0"],
        NoMatchingPodError,
        0,
    ),
    (
        "same GPU twice",
        [make_pod("p", devices=[[(A, 1, 1), (A, 1, 1)]])],
        [f"{A}-0", f"{A}-1"],
        "p",
        0,
    ),
    (
        "disjoint GPU sets pick the right pod",
        [make_pod("p", devices=one(A)), make_pod("q", devices=one(B))],
        [f"{B}-0"],
        "q",
        0,
    ),
    (
        "ambiguous: same GPU set and count",
        [make_pod("p", devices=one(), bind_time=5), make_pod("q", devices=one(), bind_time=6)],
        [f"{A}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "the pod in progress wins (kubelet admits one pod at a time)",
        [
            make_pod("fresh", devices=[[(A, 1000, 10)], [(A, 1000, 10)]]),
            partly_done(make_pod("started", devices=[[(A, 1000, 10)], [(A, 1000, 10)]])),
        ],
        [f"{A}-0"],
        "started",
        1,
    ),
    (
        "malformed candidate is skipped",
        [
            make_pod("bad", devices=one(), extra_annotations={DEVICES_TO_ALLOCATE: "garbage"}),
            make_pod("p", devices=one()),
        ],
        [f"{A}-0"],
        "p",
        0,
    ),
]


@pytest.mark.parametrize(
    ("name", "pods", "ids", "expected", "container"), CASES, ids=[c[0] for c in CASES]
)
def test_match_pod(
    name: str,
    pods: list[dict[str, Any]],
    ids: list[str],
    expected: str | type[Exception],
    container: int,
) -> None:
    if isinstance(expected, str):
        m = match_pod(pods, NODE, ids)
        assert (m.key, m.container_index) == (f"default/{expected}", container)
    else:
        with pytest.raises(expected):
            match_pod(pods, NODE, ids)


def test_deleting_and_ended_pods_are_not_candidates() -> None:
    deleting = make_pod("d", devices=one())
    deleting["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:01Z"
    ended = make_pod("e", devices=one())
    ended["status"]["phase"] = "Failed"
    with pytest.raises(NoMatchingPodError):
        match_pod([deleting, ended], NODE, [f"{A}-0"])


def test_ambiguity_error_lists_pods_in_admission_order() -> None:
    pods = [
        make_pod("late", devices=one(), bind_time=9),
        make_pod("early", devices=one(), bind_time=3),
    ]
    with pytest.raises(AmbiguousPodError, match="default/early, default/late"):
        match_pod(pods, NODE, [f"{A}-0"])


def test_malformed_device_id_is_rejected() -> None:
    with pytest.raises(InvalidDeviceIdError):
        match_pod([make_pod("p", devices=one())], NODE, ["no-slot-x"])


AMBIGUOUS_CASES = [
    ("same single GPU", [[(A, 1, 1)]], [[(A, 5, 50)]], True),
    ("different GPUs", [[(A, 1, 1)]], [[(B, 1, 1)]], False),
    ("different counts on one GPU", [[(A, 1, 1), (A, 1, 1)]], [[(A, 1, 1)]], False),
    ("a later container collides", [[(B, 1, 1)], [(A, 1, 1)]], [[(A, 1, 1)]], True),
    ("nothing left to allocate", [], [[(A, 1, 1)]], False),
]


@pytest.mark.parametrize(
    ("name", "a", "b", "expected"), AMBIGUOUS_CASES, ids=[c[0] for c in AMBIGUOUS_CASES]
)
def test_ambiguous(name: str, a: Any, b: Any, expected: bool) -> None:
    pa = annotations_of(make_pod("a", devices=a))
    pb = annotations_of(make_pod("b", devices=b))
    assert ambiguous(pa, pb) is expected
    assert ambiguous(pb, pa) is expected


def test_ambiguous_is_true_for_unreadable_annotations() -> None:
    assert ambiguous({DEVICES_TO_ALLOCATE: "x"}, annotations_of(make_pod("b", devices=one())))


def test_ambiguous_agrees_with_match_pod() -> None:
    p, q = make_pod("p", devices=one()), make_pod("q", devices=one())
    assert ambiguous(annotations_of(p), annotations_of(q))
    with pytest.raises(AmbiguousPodError):
        match_pod([p, q], NODE, [f"{A}-0"])
