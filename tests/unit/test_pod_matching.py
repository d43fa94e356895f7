"""Which pod an Allocate is for: the count rule, its one blind spot, preferred_gpus() and
ambiguous()."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from api.hami.devices import RuntimeIdentity, encode_mig_allocations
from api.hami.keys import DEVICES_TO_ALLOCATE, MIG_ALLOCATIONS, USE_GPUTYPE
from api.hami.matching import (
    ambiguous,
    interchange_key,
    interchangeable,
    next_container,
)
from api.kube.objects import annotations_of
from node_agent.deviceplugin.ids import InvalidDeviceIdError
from node_agent.pod_matching import AmbiguousPodError, NoMatchingPodError, match_pod, preferred_gpus
from tests.node_agent_fakes import make_pod, mig_alloc

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
    ("the count decides, not the ids' GPU", [make_pod("p", devices=one())], [f"{B}-0"], "p", 0),
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
        "same GPU twice, ids on two GPUs",
        [make_pod("p", devices=[[(A, 1, 1), (A, 1, 1)]])],
        [f"{A}-0", f"{B}-0"],
        "p",
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
        "different counts pick the right pod (one device)",
        [make_pod("p", devices=one(A)), make_pod("q", devices=[[(A, 1, 1), (B, 1, 1)]])],
        [f"{B}-0"],
        "p",
        0,
    ),
    (
        "different counts pick the right pod (two devices)",
        [make_pod("p", devices=one(A)), make_pod("q", devices=[[(A, 1, 1), (B, 1, 1)]])],
        [f"{A}-0", f"{A}-1"],
        "q",
        0,
    ),
    (
        "ambiguous: same count on different GPUs",
        [make_pod("p", devices=one(A)), make_pod("q", devices=[[(B, 2000, 10)]])],
        [f"{B}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "ambiguous: same GPU set and count",
        [
            make_pod("p", devices=one(), bind_time=5),
            make_pod("q", devices=[[(A, 1000, 20)]], bind_time=6),
        ],
        [f"{A}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "interchangeable: the one on the ids' GPU",
        [make_pod("p", devices=one(A)), make_pod("q", devices=one(B))],
        [f"{B}-0"],
        "q",
        0,
    ),
    (
        "interchangeable on one GPU: the first in admission order",
        [make_pod("p", devices=one(), bind_time=6), make_pod("q", devices=one(), bind_time=5)],
        [f"{A}-0"],
        "q",
        0,
    ),
    (
        "interchangeable, ids on neither GPU: the first in admission order",
        [make_pod("p", devices=one(A), bind_time=5), make_pod("q", devices=one(A), bind_time=6)],
        [f"{B}-0"],
        "p",
        0,
    ),
    (
        "another selector: not interchangeable",
        [
            make_pod("p", devices=one(A)),
            make_pod("q", devices=one(B), extra_annotations={USE_GPUTYPE: "A100"}),
        ],
        [f"{B}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "other container resources: not interchangeable",
        [
            make_pod("p", devices=one(A)),
            make_pod(
                "q",
                devices=one(B),
                containers=[{"name": "c0", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            ),
        ],
        [f"{B}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "a pod in progress is no exception: same count is ambiguous",
        [
            make_pod("fresh", devices=[[(A, 1000, 10)], [(A, 1000, 10)]]),
            partly_done(make_pod("started", devices=[[(A, 1000, 10)], [(A, 1000, 10)]])),
        ],
        [f"{A}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "a pod in progress moves on to its next container",
        [partly_done(make_pod("started", devices=[[(A, 1000, 10)], [(A, 1000, 10)]]))],
        [f"{A}-0"],
        "started",
        1,
    ),
    (
        "an unreadable candidate might be the one: ambiguous",
        [
            make_pod("bad", devices=one(), extra_annotations={DEVICES_TO_ALLOCATE: "garbage"}),
            make_pod("p", devices=one()),
        ],
        [f"{A}-0"],
        AmbiguousPodError,
        0,
    ),
    (
        "an unreadable candidate alone matches nothing",
        [make_pod("bad", devices=one(), extra_annotations={DEVICES_TO_ALLOCATE: "garbage"})],
        [f"{A}-0"],
        NoMatchingPodError,
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
        make_pod("late", devices=[[(A, 2000, 10)]], bind_time=9),
        make_pod("early", devices=one(), bind_time=3),
    ]
    with pytest.raises(AmbiguousPodError, match="default/early, default/late"):
        match_pod(pods, NODE, [f"{A}-0"])


def test_malformed_device_id_is_rejected() -> None:
    with pytest.raises(InvalidDeviceIdError):
        match_pod([make_pod("p", devices=one())], NODE, ["no-slot-x"])


AMBIGUOUS_CASES = [
    ("same single GPU", [[(A, 1, 1)]], [[(A, 5, 50)]], True),
    ("different GPUs, same count", [[(A, 1, 1)]], [[(B, 2, 1)]], True),
    ("the same request on another GPU: interchangeable", [[(A, 1, 1)]], [[(B, 1, 1)]], False),
    ("the same request on the same GPU: interchangeable", [[(A, 1, 1)]], [[(A, 1, 1)]], False),
    ("different counts on different GPUs", [[(A, 1, 1), (B, 1, 1)]], [[(B, 1, 1)]], False),
    (
        "a later container's count collides",
        [[(A, 1, 1)], [(A, 1, 1), (B, 1, 1)]],
        [[(B, 1, 1), (B, 1, 1)]],
        True,
    ),
    ("different counts on one GPU", [[(A, 1, 1), (A, 1, 1)]], [[(A, 1, 1)]], False),
    ("a later container collides", [[(B, 1, 1)], [(A, 1, 1)]], [[(A, 1, 1)]], True),
    ("nothing left to allocate", [], [[(A, 1, 1)]], False),
]


@pytest.mark.parametrize(
    ("name", "a", "b", "expected"), AMBIGUOUS_CASES, ids=[c[0] for c in AMBIGUOUS_CASES]
)
def test_ambiguous(name: str, a: Any, b: Any, expected: bool) -> None:
    pod_a, pod_b = make_pod("a", devices=a), make_pod("b", devices=b)
    pa, pb = annotations_of(pod_a), annotations_of(pod_b)
    ka, kb = interchange_key(pod_a), interchange_key(pod_b)
    assert ambiguous(pa, pb, keys=(ka, kb)) is expected
    assert ambiguous(pb, pa, keys=(kb, ka)) is expected


def test_interchange_key_reads_the_extended_resources_not_cpu_or_memory() -> None:
    def pod(resources: dict[str, Any]) -> dict[str, Any]:
        return make_pod("p", devices=one(), containers=[{"name": "c0", "resources": resources}])

    base = interchange_key(pod({"limits": {"nvidia.com/gpu": "1", "cpu": "1"}}))
    assert base is not None
    more_cpu = {"limits": {"nvidia.com/gpu": "1", "cpu": "2", "hugepages-2Mi": "1Mi"}}
    assert interchange_key(pod(more_cpu)) == base
    other_memory = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"memory": "1Gi"}}
    assert interchange_key(pod(other_memory)) == base
    priority = {"limits": {"nvidia.com/gpu": "1", "nvidia.com/priority": "1"}}
    assert interchange_key(pod(priority)) != base
    control = make_pod(
        "p",
        devices=one(),
        containers=[
            {
                "name": "c0",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}],
            }
        ],
    )
    assert interchange_key(control) != base


def test_interchange_key_needs_one_unallocated_gpu_container_and_a_readable_record() -> None:
    assert interchange_key(make_pod("p", devices=one())) is not None
    two = make_pod(
        "p", devices=[[(A, 1, 1)], [(B, 1, 1)]], containers=[{"name": "x"}, {"name": "y"}]
    )
    assert interchange_key(two) is None
    done = make_pod("p", devices=one())
    done["metadata"]["annotations"][DEVICES_TO_ALLOCATE] = ";"
    assert interchange_key(done) is None
    mig = make_pod("p", devices=one(), extra_annotations={MIG_ALLOCATIONS: "[]x"})
    assert interchange_key(mig) is None
    bad = make_pod("p", devices=one(), extra_annotations={DEVICES_TO_ALLOCATE: "garbage"})
    assert interchange_key(bad) is None
    # The scheduler's bind annotations (not on the pod yet) count as the pod's.
    bare = make_pod("p", devices=[])
    assert interchange_key(bare) is None
    assert interchange_key(bare, annotations_of(make_pod("p", devices=one()))) == interchange_key(
        make_pod("p", devices=one())
    )


def _mig_pod(name: str, *reserved: tuple[str, str, int]) -> dict[str, Any]:
    """A pod of one MIG container: one device per (GPU, profile, start)."""
    return make_pod(
        name,
        devices=[[(gpu, 9984, 29) for gpu, _, _ in reserved]],
        mig=[mig_alloc(0, i, gpu, prof, start, 2) for i, (gpu, prof, start) in enumerate(reserved)],
    )


# (case, the other pod, interchangeable, ambiguous: the node agent could not tell them apart)
MIG_KEYS: list[tuple[str, dict[str, Any], bool, bool]] = [
    ("the same profile on another GPU", _mig_pod("b", (B, "2g.10gb", 2)), True, False),
    ("the same profile at another placement", _mig_pod("b", (A, "2g.10gb", 4)), True, False),
    ("another profile", _mig_pod("b", (A, "3g.20gb", 4)), False, True),
    (
        "two devices: told apart by count",
        _mig_pod("b", (A, "2g.10gb", 2), (B, "2g.10gb", 2)),
        False,
        False,
    ),
    (
        "the same entry without a MIG reservation",
        make_pod("b", devices=[[(A, 9984, 29)]]),
        False,
        True,
    ),
]


@pytest.mark.parametrize(
    ("case", "other", "alike", "blind"), MIG_KEYS, ids=[c[0] for c in MIG_KEYS]
)
def test_mig_pods_are_interchangeable_when_each_device_asks_one_profile(
    case: str, other: dict[str, Any], alike: bool, blind: bool
) -> None:
    """Either pod may be handed the other's reserved instance: the set of reserved
    placements is the same whichever pod holds which, and the record follows the kubelet's."""
    base = _mig_pod("a", (A, "2g.10gb", 2))
    ka, kb = interchange_key(base), interchange_key(other)
    assert ka is not None and kb is not None
    assert interchangeable(ka, kb) is alike
    assert ambiguous(annotations_of(base), annotations_of(other), keys=(ka, kb)) is blind


def test_a_mig_reservation_is_nobodys_twin_once_realized_or_when_it_misses_a_device() -> None:
    realized = _mig_pod("a", (A, "2g.10gb", 2))
    [res] = [mig_alloc(0, 0, A, "2g.10gb", 2, 2)]
    done = replace(res, runtime=RuntimeIdentity("MIG-x", 1, 0))
    realized["metadata"]["annotations"][MIG_ALLOCATIONS] = encode_mig_allocations([done])
    assert interchange_key(realized) is None
    short = make_pod(
        "b", devices=[[(A, 9984, 29), (B, 9984, 29)]], mig=[mig_alloc(0, 0, A, "2g.10gb", 2, 2)]
    )
    assert interchange_key(short) is None
    elsewhere = make_pod(
        "c",
        devices=[[(A, 9984, 29)], []],
        mig=[mig_alloc(1, 0, A, "2g.10gb", 2, 2)],
        containers=[{"name": "x"}, {"name": "y"}],
    )
    assert interchange_key(elsewhere) is None


def test_ambiguous_is_true_for_unreadable_annotations() -> None:
    assert ambiguous({DEVICES_TO_ALLOCATE: "x"}, annotations_of(make_pod("b", devices=one())))


def progressed(name: str, devices: Any, done: int) -> dict[str, Any]:
    """The pod with its first ``done`` containers allocated already."""
    pod = make_pod(name, devices=devices)
    pending = [[] if i < done else e for i, e in enumerate(devices)]
    pod["metadata"]["annotations"][DEVICES_TO_ALLOCATE] = annotations_of(
        make_pod(name, devices=pending)
    )[DEVICES_TO_ALLOCATE]
    return pod


@pytest.mark.parametrize(
    ("name", "a", "b", "expected"), AMBIGUOUS_CASES, ids=[c[0] for c in AMBIGUOUS_CASES]
)
def test_ambiguous_agrees_with_match_pod(name: str, a: Any, b: Any, expected: bool) -> None:
    """Over every admission progress of both pods: when ``ambiguous`` is False each
    Allocate (ids deliberately on an unrelated GPU) names the right pod and container;
    when True, some progress state makes match_pod refuse."""
    refused = False
    for mine, other in ((a, b), (b, a)):
        for done in range(len(mine)):
            if not mine[done]:
                continue
            pod = progressed("mine", mine, done)
            for rival_done in range(len(other) + 1):
                rival = progressed("rival", other, rival_done)
                ids = [f"{B}-{i}" for i in range(len(mine[done]))]
                try:
                    m = match_pod([pod, rival], NODE, ids)
                except AmbiguousPodError:
                    refused = True
                    continue
                if m.key == "default/rival":  # either may be handed out: they are alike
                    assert interchangeable(interchange_key(pod), interchange_key(rival))
                    continue
                assert (m.key, m.container_index) == ("default/mine", done)
    assert refused is expected


def test_same_count_next_containers_are_ambiguous_whatever_the_gpus() -> None:
    p, q = make_pod("p", devices=one(A)), make_pod("q", devices=[[(B, 1000, 30)]])
    assert ambiguous(annotations_of(p), annotations_of(q))
    for ids in ([f"{A}-0"], [f"{B}-0"]):
        with pytest.raises(AmbiguousPodError, match="default/p, default/q"):
            match_pod([p, q], NODE, ids)


# preferred_gpus: what GetPreferredAllocation steers to --------------------------------------


def test_preferred_gpus_of_the_unique_candidate_asking_that_count() -> None:
    pods = [
        make_pod("one", devices=one(B)),
        make_pod("two", devices=[[(A, 1, 1), (A, 1, 1)]]),
        make_pod("elsewhere", node="node-b", devices=one(A)),
    ]
    assert preferred_gpus(pods, NODE, 1) == Counter({B: 1})
    assert preferred_gpus(pods, NODE, 2) == Counter({A: 2})
    assert preferred_gpus(pods, NODE, 3) is None
    assert preferred_gpus(pods, NODE, 0) is None


def test_preferred_gpus_none_for_same_count_or_unreadable_candidates() -> None:
    same = [make_pod("p", devices=one(A)), make_pod("q", devices=[[(B, 5, 5)]])]
    assert preferred_gpus(same, NODE, 1) is None
    alike = [make_pod("p", devices=one(A), bind_time=7), make_pod("q", devices=one(B), bind_time=4)]
    assert preferred_gpus(alike, NODE, 1) == Counter({B: 1})  # the first of interchangeable ones
    bad = make_pod("bad", devices=one(), extra_annotations={DEVICES_TO_ALLOCATE: "garbage"})
    assert preferred_gpus([bad, make_pod("p", devices=[[(A, 1, 1), (B, 1, 1)]])], NODE, 2) is None


def test_preferred_gpus_follow_the_next_container() -> None:
    pod = partly_done(make_pod("p", devices=[[(B, 1000, 10)], [(A, 1000, 10)]]))
    nxt = next_container(annotations_of(pod))
    assert nxt is not None and nxt[0] == 1
    assert preferred_gpus([pod], NODE, 1) == Counter({A: 1})
