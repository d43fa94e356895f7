"""kube-scheduler's CPU and memory beside Tessera: the fit rule (``rules.host_reasons``), in the
engine's verdicts and explanations (``decide``), a pod's requests as kube-scheduler counts them
(``requests.host_requests``), and the default profile's scores and node choice for pods Tessera
does not place (``core.hostfit``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from api.errors import InvalidRequestError
from api.hami.config import DeviceConfig
from scheduler_plugins.core import hostfit
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain, explain_host
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import (
    PodAllocation,
    host_requests,
    parse_allocation,
    parse_request,
)
from scheduler_plugins.core.rules import HostAmounts, Reason, host_reasons
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.core.whatif import host_preemptible
from tests.builders import gpu, make_pod

CFG = DeviceConfig()
GI = 2**30
CPU, MEM = int(Reason.HOST_CPU), int(Reason.HOST_MEMORY)


def _amounts(*pairs: tuple[float, float]) -> HostAmounts:
    return HostAmounts(
        np.array([p[0] for p in pairs], np.float64), np.array([p[1] for p in pairs], np.float64)
    )


# ----- the rule --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitCase:
    name: str
    allocatable: tuple[float, float]  # cpu (milli), memory (bytes)
    requested: tuple[float, float]
    pod: tuple[int, int]
    want: int


FIT_CASES = [
    FitCase("fits with room", (4000, 8 * GI), (1000, 2 * GI), (1000, GI), 0),
    FitCase("exactly what is left fits", (4000, 8 * GI), (1000, 2 * GI), (3000, 6 * GI), 0),
    FitCase("one millicore more does not", (4000, 8 * GI), (1000, 2 * GI), (3001, GI), CPU),
    FitCase("one byte more does not", (4000, 8 * GI), (1000, 2 * GI), (1000, 6 * GI + 1), MEM),
    FitCase("both short", (4000, 8 * GI), (4000, 8 * GI), (1, 1), CPU | MEM),
    FitCase("unknown cpu is not checked", (0, 8 * GI), (5000, 0), (9000, GI), 0),
    FitCase("unknown memory is not checked", (4000, 0), (0, 9 * GI), (1000, 99 * GI), 0),
    FitCase("unknown both: anything fits", (0, 0), (0, 0), (10**6, 2**50), 0),
    FitCase("no request fits an overcommitted node", (4000, 8 * GI), (5000, 9 * GI), (0, 0), 0),
    FitCase("cpu only is checked on cpu only", (4000, 8 * GI), (5000, 9 * GI), (1, 0), CPU),
]


@pytest.mark.parametrize("case", FIT_CASES, ids=lambda c: c.name)
def test_host_reasons_is_node_resources_fit_for_cpu_and_memory(case: FitCase) -> None:
    got = host_reasons(_amounts(case.allocatable), _amounts(case.requested), *case.pod)
    assert got.tolist() == [case.want]


def test_host_reasons_over_many_nodes_and_some_of_them() -> None:
    cases = FIT_CASES
    alloc = _amounts(*(c.allocatable for c in cases))
    req = _amounts(*(c.requested for c in cases))
    pod = (3001, 6 * GI + 1)  # one pod on every node at once
    every = host_reasons(alloc, req, *pod)
    one_by_one = [
        host_reasons(_amounts(c.allocatable), _amounts(c.requested), *pod)[0] for c in cases
    ]
    assert every.tolist() == one_by_one
    at = np.array([3, 0, 5], np.int64)
    assert host_reasons(alloc, req, *pod, at=at).tolist() == every[at].tolist()


def test_reason_texts_read_like_kube_schedulers() -> None:
    from scheduler_plugins.core.rules import reason_names

    assert reason_names(CPU | MEM) == ["insufficient cpu", "insufficient memory"]


# ----- in the engine ---------------------------------------------------------------------------


def _state() -> ClusterState:
    """Three GPU nodes with free GPUs: ``busy`` has 500m CPU left, ``full`` 2 GiB of memory
    left, ``unknown`` shows no allocatable."""
    state = ClusterState(CFG)
    state.upsert_node("busy", (gpu("GPU-b"),), cpu_milli=8000, memory_bytes=32 * GI)
    state.upsert_node("full", (gpu("GPU-f"),), cpu_milli=8000, memory_bytes=32 * GI)
    state.upsert_node("unknown", (gpu("GPU-u"),))
    state.upsert_pod(PodAllocation("x/cpu", "busy", (), (), 7500, GI), "x/cpu")
    state.upsert_pod(PodAllocation("x/mem", "full", (), (), 1000, 30 * GI), "x/mem")
    return state


def _gpu_pod(cpu: str | None = None, memory: str | None = None) -> dict[str, Any]:
    pod = make_pod("p").gpu(1, mem=1000).build()
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    pod["spec"]["containers"][0]["resources"]["requests"] = requests
    return pod


def test_a_node_without_the_pods_cpu_is_infeasible_with_that_reason() -> None:
    state = _state()
    d = decide(state, parse_request(_gpu_pod(cpu="1", memory="1Gi"), CFG))
    verdicts = {name: (ok, why) for name, ok, _, why in d.verdicts()}
    assert verdicts == {
        "busy": (False, ["insufficient cpu"]),  # its GPU is free: no GPU reason
        "full": (True, []),
        "unknown": (True, []),  # not checked
    }
    assert d.plan_for("busy") is None


def test_explanations_name_cpu_and_memory_where_that_is_what_failed() -> None:
    state = _state()
    state.upsert_node("unknown", (gpu("GPU-u", mem=100),))  # its GPU now too small
    d = decide(state, parse_request(_gpu_pod(cpu="1", memory="4Gi"), CFG))
    assert d.best_node() is None
    cls = "1 node [1× NVIDIA Tesla V100-PCIE-32GB (hami-core)]"
    assert explain(d, state) == (
        f"0/3 nodes are available: {cls}: insufficient GPU memory (unknown); "
        f"{cls}: insufficient cpu (busy); {cls}: insufficient memory (full)"
    )


def test_a_pod_without_cpu_or_memory_requests_is_not_held_back() -> None:
    state = _state()
    d = decide(state, parse_request(_gpu_pod(), CFG))
    assert d.feasible.all()


# ----- a pod's requests as kube-scheduler counts them ------------------------------------------


def _container(name: str, requests: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = requests
    if "limits" in extra:
        resources["limits"] = extra.pop("limits")
    return {"name": name, "resources": resources, **extra}


def _pod(
    *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": list(containers), "initContainers": list(init), **spec},
    }


REQUEST_CASES = [
    ("requests, not limits", _pod(_container("a", {"cpu": "1"}, limits={"cpu": "8"})), (1000, 0)),
    (
        "a limit stands for a missing request",
        _pod(_container("a", limits={"memory": "1Gi"})),
        (0, GI),
    ),
    (
        "containers add up",
        _pod(_container("a", {"cpu": "500m", "memory": "1Gi"}), _container("b", {"cpu": "250m"})),
        (750, GI),
    ),
    (
        "an init container counts only where it needs more",
        _pod(
            _container("a", {"cpu": "1", "memory": "1Gi"}),
            init=(_container("i", {"cpu": "2", "memory": "512Mi"}),),
        ),
        (2000, GI),
    ),
    (
        "a sidecar adds to the containers and to the init containers after it",
        _pod(
            _container("a", {"cpu": "1"}),
            init=(
                _container("s", {"cpu": "500m"}, restartPolicy="Always"),
                _container("i", {"cpu": "2"}),
            ),
        ),
        (2500, 0),  # max(1 + 0.5, 0.5 + 2)
    ),
    (
        "pod-level requests replace the containers' sum",
        _pod(_container("a", {"cpu": "1", "memory": "1Gi"}), resources={"requests": {"cpu": "3"}}),
        (3000, GI),
    ),
    (
        "overhead is added",
        _pod(_container("a", {"cpu": "1"}), overhead={"cpu": "100m", "memory": "64Mi"}),
        (1100, 64 * 2**20),
    ),
    ("fractions of a millicore round up", _pod(_container("a", {"cpu": "0.0001"})), (1, 0)),
]


@pytest.mark.parametrize(
    ("pod", "want"), [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES]
)
def test_host_requests_are_kube_schedulers(pod: dict[str, Any], want: tuple[int, int]) -> None:
    assert host_requests(pod, strict=True) == want


@pytest.mark.parametrize(
    ("pod", "fragment"),
    [
        (_pod(_container("a", {"cpu": "lots"})), "container 'a': invalid quantity 'lots'"),
        (_pod(_container("a", {"memory": "-1Gi"})), "container 'a': memory '-1Gi' is negative"),
        (_pod(_container("a"), overhead={"cpu": "x"}), "spec.overhead: invalid quantity 'x'"),
    ],
)
def test_unreadable_requests_name_where_they_are(pod: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match="default/p") as e:
        host_requests(pod, strict=True)
    assert fragment in str(e.value)
    assert host_requests(pod, strict=False) == (0, 0)  # an admitted pod's: counts 0


def test_a_bound_pod_holds_what_kube_scheduler_counts() -> None:
    pod = _pod(
        _container("a", {"cpu": "1"}, limits={"cpu": "4"}), init=(_container("i", {"cpu": "2"}),)
    )
    pod["spec"]["nodeName"] = "n"
    alloc = parse_allocation(pod)
    assert alloc is not None and (alloc.cpu_milli, alloc.memory_bytes) == (2000, 0)
    assert parse_request(pod, CFG).cpu_milli == 2000


# ----- nodes' allocatable ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allocatable", "want", "warning"),
    [
        ({"cpu": "4", "memory": "8Gi"}, (4000, 8 * GI), None),
        ({"cpu": "lots", "memory": "8Gi"}, (0, 8 * GI), "status.allocatable.cpu: invalid quantity"),
        (
            {"cpu": "4", "memory": "-8Gi"},
            (4000, 0),
            "status.allocatable.memory: quantity '-8Gi' is negative",
        ),
        ({}, (0, 0), None),
    ],
)
def test_unreadable_allocatable_is_unknown_with_a_warning(
    allocatable: dict[str, str], want: tuple[int, int], warning: str | None
) -> None:
    info = parse_node({"metadata": {"name": "n"}, "status": {"allocatable": allocatable}})
    assert (info.cpu_milli, info.memory_bytes) == want
    if warning is None:
        assert info.warnings == ()
    else:
        (got,) = info.warnings
        assert got.startswith(warning) and "not checked on this node" in got


# ----- kube-scheduler's scores -----------------------------------------------------------------


@dataclass(frozen=True)
class ScoreCase:
    name: str
    allocatable: tuple[float, float]
    requested: tuple[float, float]
    pod: tuple[int, int]
    least: int
    balanced: int


SCORE_CASES = [
    # cpu 2000/4000 after: 50; memory 3/8 GiB: 62 (62.5); mean 56. Balance with the pod
    # 1 − |0.5 − 0.375| / 2 = 0.9375: 93; without (0.25, 0.25): 100; 50 + (50 + 93 − 100) // 2.
    ScoreCase("both shares", (4000, 8 * GI), (1000, 2 * GI), (1000, GI), 56, 71),
    # cpu 1000/8000 after: 87 (87.5); memory 7/8: 12 (12.5); 49. Balance 62 with and without: 75.
    ScoreCase("lopsided already", (8000, 8 * GI), (0, 6 * GI), (1000, GI), 49, 75),
    # Memory unknown: left out of both; one share has no spread (100 with and without).
    ScoreCase("memory unknown", (4000, 0), (0, 0), (1000, GI), 75, 75),
    # Over what is left: 0 for that resource; shares capped at 1.
    ScoreCase(
        "over capacity", (1000, 8 * GI), (1000, 0), (1000, 4 * GI), 25, 50 + (50 + 75 - 50) // 2
    ),
    # A pod requesting nothing: BalancedAllocation skips it (0); LeastAllocated as is.
    ScoreCase("best effort", (4000, 8 * GI), (1000, 2 * GI), (0, 0), 75, 0),
    ScoreCase("nothing known", (0, 0), (0, 0), (1000, GI), 0, 75),
]


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: c.name)
def test_default_scores_by_hand(case: ScoreCase) -> None:
    args = (_amounts(case.allocatable), _amounts(case.requested), *case.pod)
    assert hostfit.least_allocated(*args).tolist() == [case.least]
    assert hostfit.balanced_allocation(*args).tolist() == [case.balanced]
    assert hostfit.kube_scores(*args).tolist() == [case.least + case.balanced]


def _cpu_cluster() -> ClusterState:
    state = ClusterState(CFG)
    state.upsert_node("gpu", (gpu("GPU-g"),), cpu_milli=4000, memory_bytes=8 * GI)
    state.upsert_node("b", (), cpu_milli=8000, memory_bytes=8 * GI)
    state.upsert_node("a", (), cpu_milli=4000, memory_bytes=8 * GI)
    state.upsert_pod(PodAllocation("x/1", "gpu", (), (), 1000, 2 * GI), "x/1")
    state.upsert_pod(PodAllocation("x/2", "b", (), (), 0, 6 * GI), "x/2")
    return state


def test_place_takes_the_highest_sum_of_both_scores_ties_by_name() -> None:
    state = _cpu_cluster()
    placement = hostfit.place(state, 1000, GI)
    got = dict(zip(placement.names, (placement.least + placement.balanced).tolist(), strict=True))
    # "gpu" is the first score case, "b" the second; the empty "a": cpu 3/4 left 75, memory
    # 7/8 left 87 (87.5): 81; balance (0.25, 0.125) 93 with the pod, 100 without: 71.
    assert got == {"gpu": 56 + 71, "b": 49 + 75, "a": 81 + 71}
    assert placement.names[placement.best()] == "a"
    # With what "gpu" holds, "a" scores as "gpu" does: a tie, to the first name.
    state.upsert_pod(PodAllocation("x/3", "a", (), (), 1000, 2 * GI), "x/3")
    placement = hostfit.place(state, 1000, GI)
    assert (placement.least + placement.balanced).tolist() == [127, 124, 127]
    assert placement.names[placement.best()] == "a"


def test_place_refuses_every_node_and_explain_host_says_why() -> None:
    state = _cpu_cluster()
    placement = hostfit.place(state, 5000, 7 * GI)
    assert placement.best() == -1
    assert explain_host(placement, state) == (
        "0/3 nodes are available: 1 node [1× NVIDIA Tesla V100-PCIE-32GB (hami-core)]: "
        "insufficient cpu; insufficient memory (gpu); 1 node [no GPUs]: insufficient cpu (a); "
        "1 node [no GPUs]: insufficient memory (b)"
    )


def test_a_placed_pod_without_devices_counts_its_cpu_and_memory_until_forgotten() -> None:
    """What ``simulate`` assumes for a pod placed by kube-scheduler's scores: only CPU and
    memory, on a GPU-less node as on a GPU node."""
    state = _cpu_cluster()
    for node in ("a", "gpu"):
        before = state.usage_snapshot()
        state.assume(PodAllocation(f"x/{node}", node, (), (), 3000, GI))
        assert not hostfit.place(state, 2000, GI).fits[list(state.nodes).index(node)]
        assert state.forget(f"x/{node}")
        assert state.usage_snapshot() == before


def test_nodes_only_cpu_refuses_are_left_to_kube_schedulers_preemption() -> None:
    """A GPU pod whose GPUs fit where lower-priority CPU-only pods hold the CPU: those nodes
    are offered to kube-scheduler's preemption (its dry run weighs CPU itself)."""
    state = ClusterState(CFG)
    state.upsert_node("busy", (gpu("GPU-b"),), cpu_milli=8000, memory_bytes=32 * GI)
    state.upsert_node("vip", (gpu("GPU-v"),), cpu_milli=8000, memory_bytes=32 * GI)
    low = PodAllocation("x/low", "busy", (), (), 7500, GI, priority=0)
    high = PodAllocation("x/high", "vip", (), (), 7500, GI, priority=100)
    state.upsert_pod(low, low.key)
    state.upsert_pod(high, high.key)
    pod = _gpu_pod(cpu="1")
    pod["spec"]["priority"] = 10
    req = parse_request(pod, CFG)
    d = decide(state, req)
    assert not d.feasible.any() and d.gpus_fit.all()
    assert host_preemptible(state, req, d.gpus_fit, d.feasible) == ["busy"]
