"""Preemption's what-ifs in the core: which nodes are preemptible for a pod, what one node looks
like without some pods and with others, and kube-scheduler's choice of victims and node."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.register import GpuDevice, Placement
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.core.whatif import (
    Candidate,
    UnknownNode,
    Victims,
    pick_node,
    preemptible_nodes,
    select_victims,
    what_if,
)
from tests.builders import gpu, make_pod, mig_gpu

CFG = DeviceConfig()


def shared(key: str, node: str, uuid: str, mem: int, *, priority: int, cores: int = 0) -> Pod:
    return Pod(key, node, priority, devices=((uuid, mem, cores),))


def one_g(key: str, node: str, uuid: str, start: int, *, priority: int) -> Pod:
    return Pod(key, node, priority, mig=((uuid, "1g.5gb", start, 1),))


@dataclass(frozen=True)
class Pod:
    """A placed pod: its devices (uuid, MiB, cores) or MIG instances (uuid, profile, start,
    size), or neither (CPU only)."""

    key: str
    node: str
    priority: int
    devices: tuple[tuple[str, int, int], ...] = ()
    mig: tuple[tuple[str, str, int, int], ...] = ()
    cpu_milli: int = 0

    def alloc(self) -> PodAllocation:
        return PodAllocation(
            self.key,
            self.node,
            tuple(DeviceAlloc(u, m, c) for u, m, c in self.devices),
            tuple(
                MigAllocation(0, i, u, p, Placement(s, n))
                for i, (u, p, s, n) in enumerate(self.mig)
            ),
            self.cpu_milli,
            uid=f"uid-{self.key}",
            priority=self.priority,
        )


def cluster(nodes: dict[str, tuple[GpuDevice, ...]], pods: list[Pod]) -> ClusterState:
    state = ClusterState(CFG)
    for name, devices in nodes.items():
        state.upsert_node(name, devices, cpu_milli=16_000, memory_bytes=2**36)
    for p in pods:
        state.upsert_pod(p.alloc(), p.key)
    return state


def pod_request(
    *, mem: int | None = None, pct: int | None = None, count: int = 1, mode: str = "", priority: int
) -> PodRequest:
    pod = make_pod("preemptor").gpu(count, mem=mem, pct=pct)
    if mode:
        pod.annotate(ann.VGPU_MODE, mode)
    obj = pod.build()
    obj["spec"]["priority"] = priority
    obj["metadata"]["uid"] = "uid-preemptor"
    return parse_request(obj, CFG)


TWO_GPUS = (gpu("GPU-a0"), gpu("GPU-a1", index=1))  # 8192 MiB each
MIG = (mig_gpu("GPU-m0"),)


@dataclass(frozen=True)
class Case:
    name: str
    nodes: dict[str, tuple[GpuDevice, ...]]
    pods: list[Pod]
    request: PodRequest
    preemptible: list[str]
    # kube-scheduler's victims on each preemptible node, most important first
    victims: dict[str, list[str]] = field(default_factory=dict)


CASES = [
    Case(
        "fractional victims on one GPU: only as many as the pod needs",
        {"a": (gpu("GPU-a0"),)},
        [
            shared("ns/older", "a", "GPU-a0", 3000, priority=1),
            shared("ns/younger", "a", "GPU-a0", 3000, priority=0),
        ],
        pod_request(mem=5000, priority=10),
        ["a"],
        {"a": ["ns/younger"]},
    ),
    Case(
        "victims spread over GPUs: only one GPU needs to be freed",
        {"a": TWO_GPUS},
        [
            shared("ns/on-0", "a", "GPU-a0", 6000, priority=0),
            shared("ns/on-1", "a", "GPU-a1", 6000, priority=1),
        ],
        pod_request(mem=4000, priority=10),
        ["a"],
        {"a": ["ns/on-0"]},
    ),
    Case(
        "pods of equal or higher priority are never counted as victims",
        {"eq": (gpu("GPU-e"),), "hi": (gpu("GPU-h"),)},
        [
            shared("ns/equal", "eq", "GPU-e", 6000, priority=5),
            shared("ns/higher", "hi", "GPU-h", 6000, priority=9),
        ],
        pod_request(mem=4000, priority=5),
        [],
    ),
    Case(
        "a pod without GPUs frees nothing Tessera counts",
        {"a": (gpu("GPU-a0"),)},
        [
            shared("ns/gpu", "a", "GPU-a0", 6000, priority=9),
            Pod("ns/cpu-only", "a", 0, cpu_milli=4000),
        ],
        pod_request(mem=4000, priority=5),
        [],
    ),
    Case(
        "removing every lower pod is not enough: not preemptible",
        {"a": (gpu("GPU-a0"),)},
        [
            shared("ns/low", "a", "GPU-a0", 2000, priority=0),
            shared("ns/high", "a", "GPU-a0", 5000, priority=9),
        ],
        pod_request(mem=4000, priority=5),
        [],
    ),
    Case(
        "a node that fits is not preemptible, only the one that does not",
        {"full": (gpu("GPU-f"),), "free": (gpu("GPU-r"),)},
        [shared("ns/low", "full", "GPU-f", 6000, priority=0)],
        pod_request(mem=4000, priority=5),
        ["full"],
        {"full": ["ns/low"]},
    ),
    Case(
        "MIG: 1g instances blocking both 3g placements; one of them freed is enough",
        {"m": MIG},
        [
            one_g("ns/left", "m", "GPU-m0", 1, priority=1),
            one_g("ns/right", "m", "GPU-m0", 5, priority=0),
        ],
        pod_request(mem=20_000, mode="mig", priority=10),
        ["m"],
        {"m": ["ns/right"]},
    ),
    Case(
        "MIG: a 7g pod needs every instance gone",
        {"m": MIG},
        [
            one_g("ns/a", "m", "GPU-m0", 0, priority=1),
            one_g("ns/b", "m", "GPU-m0", 6, priority=0),
        ],
        pod_request(mem=40_000, mode="mig", priority=10),
        ["m"],
        {"m": ["ns/a", "ns/b"]},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_preemptible_nodes_and_victims(case: Case) -> None:
    state = cluster(case.nodes, case.pods)
    decision = decide(state, case.request)
    assert preemptible_nodes(state, case.request, decision.feasible) == case.preemptible
    for node in case.preemptible:
        on_node = [Candidate(a.key, a.priority) for a in state.pods_on(node)]
        chosen = select_victims(state, case.request, node, on_node)
        assert chosen is not None
        assert [v.key for v in chosen.pods] == case.victims[node]


def test_mig_what_if_frees_a_victims_placement_and_words_the_rest_as_explain_does() -> None:
    state = cluster(
        {"m": MIG},
        [
            one_g("ns/left", "m", "GPU-m0", 1, priority=0),
            one_g("ns/right", "m", "GPU-m0", 5, priority=0),
            one_g("ns/far-right", "m", "GPU-m0", 6, priority=0),
        ],
    )
    three_g = pod_request(mem=20_000, mode="mig", priority=10)
    now = what_if(state, three_g, "m")
    assert not now.fits and now.reasons == Reason.MIG_FRAGMENTATION
    assert "GPU 0 free slices [0,1) [2,5) [7,8)" in now.message
    # The what-if's occupancy is in its message: slice 5 freed, slices 1 and 6 still held.
    later = what_if(state, three_g, "m", removed={"ns/right"})
    assert not later.fits and "GPU 0 free slices [0,1) [2,6) [7,8)" in later.message
    assert what_if(state, three_g, "m", removed={"ns/right", "ns/far-right"}).fits
    assert state.allocation("ns/right") is not None  # the state itself is untouched


def test_a_nominated_pod_is_placed_first_and_one_that_does_not_fit_takes_nothing() -> None:
    state = cluster({"a": (gpu("GPU-a0"),)}, [shared("ns/low", "a", "GPU-a0", 6000, priority=0)])
    request = pod_request(mem=4000, priority=10)
    assert what_if(state, request, "a", removed={"ns/low"}).fits
    nominated = pod_request(mem=5000, priority=10)
    crowded = what_if(state, request, "a", removed={"ns/low"}, added=[nominated])
    assert not crowded.fits and crowded.reasons == Reason.MEMORY
    assert "insufficient GPU memory (a)" in crowded.message
    too_big = pod_request(mem=9000, priority=10)  # fits nowhere there: takes nothing
    assert what_if(state, request, "a", removed={"ns/low"}, added=[too_big]).fits
    # A removed pod added back holds what it held.
    low = state.allocation("ns/low")
    assert low is not None
    assert not what_if(state, request, "a", removed={"ns/low"}, added=[low]).fits


def test_unknown_and_gpu_less_nodes() -> None:
    state = cluster({"a": (gpu("GPU-a0"),), "cpu": ()}, [])
    request = pod_request(mem=1000, priority=0)
    with pytest.raises(UnknownNode, match="'nowhere' is not in the cluster state"):
        what_if(state, request, "nowhere")
    gpu_less = what_if(state, request, "cpu")
    assert not gpu_less.fits and gpu_less.reasons == Reason.NO_GPU
    assert gpu_less.message == "Tessera: 1 node [no GPUs]: no GPU registered (cpu)"
    no_gpu_request = parse_request(make_pod("plain").container(cpu="1").build(), CFG)
    assert what_if(state, no_gpu_request, "a").fits


def test_the_ledger_follows_nodes_that_register_again_and_pods_that_go() -> None:
    state = cluster(
        {"a": (gpu("GPU-a0"),), "b": (gpu("GPU-b0"),)},
        [
            shared("ns/low-a", "a", "GPU-a0", 6000, priority=0),
            shared("ns/low-b", "b", "GPU-b0", 6000, priority=0),
        ],
    )
    request = pod_request(mem=4000, priority=5)
    assert state.ledger.lowest_priority() == 0
    # Node a registers another GPU first: its rows move (the pods are counted again there).
    state.upsert_node("a", (gpu("GPU-a9", index=0), gpu("GPU-a0", index=1)))
    decision = decide(state, request)
    verdicts = dict(zip(decision.layout.names, decision.feasible.tolist(), strict=True))
    assert verdicts == {"a": True, "b": False}  # a's new GPU is free
    assert preemptible_nodes(state, request, decision.feasible) == ["b"]
    state.remove_pod("ns/low-b")
    decision = decide(state, request)
    assert preemptible_nodes(state, request, decision.feasible) == []
    state.remove_pod("ns/low-a")
    assert state.ledger.lowest_priority() is None


# ----- kube-scheduler's choice of node (pickOneNodeForPreemption) ---------------------------


def victims(node: str, *pods: tuple[int, float]) -> Victims:
    return Victims(node, tuple(Candidate(f"{node}/{i}", p, t) for i, (p, t) in enumerate(pods)))


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        ([victims("x", (5, 1.0)), victims("y", (3, 1.0), (3, 1.0))], "y"),  # lowest top priority
        ([victims("x", (3, 1), (2, 1)), victims("y", (3, 1), (1, 1))], "y"),  # smallest sum
        ([victims("x", (3, 1), (-5, 1)), victims("y", (3, 1))], "y"),  # sums offset by 2^31
        ([victims("x", (3, 1), (0, 1)), victims("y", (3, 1), (0, 1), (0, 1))], "x"),  # fewest
        ([victims("x", (3, 1.0)), victims("y", (3, 2.0))], "y"),  # latest start
        ([victims("x", (3, 1.0)), victims("y", (3, math.inf))], "y"),  # not started: "now"
        ([victims("x", (3, 1.0)), victims("y", (3, 1.0))], "x"),  # ties: the first
        ([], None),
    ],
)
def test_pick_node_follows_kube_schedulers_order(
    candidates: list[Victims], chosen: str | None
) -> None:
    got = pick_node(candidates)
    assert (got.node if got is not None else None) == chosen


def test_reprieve_goes_highest_priority_first_then_earliest_start() -> None:
    state = cluster(
        {"a": (gpu("GPU-a0"),)},
        [
            shared("ns/old", "a", "GPU-a0", 3000, priority=1),
            shared("ns/new", "a", "GPU-a0", 3000, priority=1),
        ],
    )
    request = pod_request(mem=5000, priority=10)
    pods = [Candidate("ns/old", 1, start=100.0), Candidate("ns/new", 1, start=200.0)]
    chosen = select_victims(state, request, "a", pods)
    assert chosen is not None and [v.key for v in chosen.pods] == ["ns/new"]
    pods = [Candidate("ns/old", 1, start=300.0), Candidate("ns/new", 1, start=200.0)]
    chosen = select_victims(state, request, "a", pods)
    assert chosen is not None and [v.key for v in chosen.pods] == ["ns/old"]
