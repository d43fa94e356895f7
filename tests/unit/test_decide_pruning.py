"""Feasibility from fit counts, the full evaluation only where counts can't tell, and plans
computed for the node asked for: the same verdicts and plans as evaluating every node.

Each case names the nodes whose verdict needs the full evaluation (``evaluated``); the rest are
decided by counting the GPUs each container fits on the usage before the pod."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

import scheduler_plugins.core.decide as decide_module
import scheduler_plugins.core.state as state_module
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.register import GpuDevice, Placement
from scheduler_plugins.core.decide import Decision, _evaluate, decide
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState, build_state
from tests.builders import gpu, make_pod, mig_gpu, mps_gpu, state_with
from tests.oracle import assert_agrees

CFG = DeviceConfig()


def _holds(state: ClusterState, node: str, *devices: tuple[str, int, int]) -> None:
    key = f"held/{node}-{len(list(state.allocations()))}"
    alloc = PodAllocation(key, node, tuple(DeviceAlloc(u, m, c) for u, m, c in devices), ())
    state.upsert_pod(alloc, key)


def _mig_holds(
    state: ClusterState, node: str, uuid: str, profile: str, start: int, size: int
) -> None:
    key = f"held/{node}-{len(list(state.allocations()))}"
    mig = (MigAllocation(0, 0, uuid, profile, Placement(start, size)),)
    state.upsert_pod(PodAllocation(key, node, (), mig), key)


def assert_same_as_every_node_evaluated(state: ClusterState, request: PodRequest) -> Decision:
    """``decide`` agrees with the full evaluation of every node and with the oracle
    (``tests/oracle.py``): same verdicts and reasons, and for every feasible node the same
    planned devices."""
    d = decide(state, request)
    layout = state.layout()
    full_ok, full_plans = _evaluate(state, layout, request, d._masks, None, False)
    assert d.feasible.tolist() == full_ok.tolist()
    assert_agrees(state, request, d)
    for s, name in enumerate(layout.names):
        if not d.feasible[s]:
            assert d.plan_for(name) is None
            continue
        assert d.plan_for(name) is not None
        plans, row = d._plans_of(s)
        for got, full in zip(plans, full_plans, strict=True):
            for field in ("rows", "mig_rank", "mig_start", "gpu_score"):
                assert getattr(got, field)[row].tolist() == getattr(full, field)[s].tolist()
    return d


@dataclass(frozen=True)
class Case:
    name: str
    nodes: Nodes
    pod: dict[str, Any]
    feasible: set[str]
    evaluated: set[str]  # nodes the counts can't decide
    used: tuple[tuple[str, tuple[tuple[str, int, int], ...]], ...] = ()


Nodes = dict[str, tuple[GpuDevice, ...]]


def _state(nodes: Nodes) -> ClusterState:
    state = ClusterState(CFG)
    for name, devices in nodes.items():
        state.upsert_node(name, devices)
    return state


ONE_CARD: Nodes = {"n": (gpu("GPU-1", mem=1000),)}
TWO_CARDS: Nodes = {"n": (gpu("GPU-1", mem=1000), gpu("GPU-2", index=1, mem=1000))}
MIXED: Nodes = {"n": (gpu("GPU-1", mem=8192), mig_gpu("GPU-m", index=1))}
ONE_MIG_CARD: Nodes = {"n": (mig_gpu("GPU-m"),)}
BOTH_MODES: Nodes = {"core": (gpu("GPU-1"),), "mig": (mig_gpu("GPU-m"),)}
CORE_AND_MPS: Nodes = {"n": (gpu("GPU-1", mem=8192), mps_gpu("GPU-s", index=1, mem=8192))}
FOUR_SMALL_NODES: Nodes = {f"n{i}": (gpu(f"GPU-{i}", mem=1000),) for i in range(4)}

CASES = [
    Case(
        "second container shares the only card",
        ONE_CARD,
        make_pod("p").gpu(1, mem=300).gpu(1, mem=300).build(),
        {"n"},
        {"n"},
    ),
    Case(
        "second container finds the only card taken",
        ONE_CARD,
        make_pod("p").gpu(1, mem=600).gpu(1, mem=600).build(),
        set(),
        {"n"},
    ),
    Case(
        "two cards: one per container whatever the first picks",
        TWO_CARDS,
        make_pod("p").gpu(1, mem=600).gpu(1, mem=600).build(),
        {"n"},
        set(),
    ),
    Case(
        "the second container finds no other card",
        TWO_CARDS,
        make_pod("p").gpu(1, mem=600).gpu(1, mem=600).build(),
        set(),
        {"n"},
        used=(("n", (("GPU-2", 900, 0),)),),
    ),
    Case(
        "hami-core devices of a container need distinct cards",
        ONE_CARD,
        make_pod("p").gpu(2, mem=100).build(),
        set(),
        set(),
    ),
    Case(
        "two MIG instances on one card",
        ONE_MIG_CARD,
        make_pod("p").gpu(2, mem=8000).mode("mig").build(),
        {"n"},
        {"n"},
    ),
    Case(
        "three MIG instances don't fit one card",
        ONE_MIG_CARD,
        make_pod("p").gpu(3, mem=15_000).mode("mig").build(),
        set(),
        {"n"},
    ),
    Case(
        "no profile large enough: not even possible",
        ONE_MIG_CARD,
        make_pod("p").gpu(1, mem=50_000).mode("mig").build(),
        set(),
        set(),
    ),
    Case(
        "a node on both paths: one card each",
        MIXED,
        make_pod("p").gpu(1, mem=4000).gpu(1, mem=4000).build(),
        {"n"},
        {"n"},
    ),
    Case(
        "a hami-core and an MPS card: one container's devices are of one mode",
        CORE_AND_MPS,
        make_pod("p").gpu(2, mem=1000).build(),
        set(),
        set(),
    ),
    Case(
        "a hami-core and an MPS card: one card each for two containers",
        CORE_AND_MPS,
        make_pod("p").gpu(1, mem=4000).gpu(1, mem=4000).build(),
        {"n"},
        {"n"},
    ),
    Case(
        "MPS asked of a node with both: only the MPS card counts",
        CORE_AND_MPS,
        make_pod("p").gpu(1, mem=6000).gpu(1, mem=6000).mode("mps").build(),
        set(),
        {"n"},
    ),
    Case(
        "wrong mode: the path is not considered",
        BOTH_MODES,
        make_pod("p").gpu(1, mem=1000).mode("mig").build(),
        {"mig"},
        set(),
    ),
    Case(
        "most nodes tight: every node evaluated at once",
        FOUR_SMALL_NODES,
        make_pod("p").gpu(1, mem=400).gpu(1, mem=400).build(),
        {"n0", "n1", "n2", "n3"},
        {"n0", "n1", "n2", "n3"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_counts_decide_and_the_rest_is_evaluated(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(case.nodes)
    for node, devices in case.used:
        _holds(state, node, *devices)
    request = parse_request(case.pod, CFG)
    evaluated: set[str] = set()

    def spy(*args: Any) -> Any:
        segs = args[4]
        names = state.layout().names
        evaluated.update(names if segs is None else [names[s] for s in segs.tolist()])
        return _evaluate(*args)

    monkeypatch.setattr(decide_module, "_evaluate", spy)
    d = decide(state, request)
    assert evaluated == case.evaluated
    assert {n for i, n in enumerate(d.layout.names) if d.feasible[i]} == case.feasible
    monkeypatch.undo()
    assert_same_as_every_node_evaluated(state, request)


def test_the_best_nodes_plan_comes_from_the_evaluation_the_decision_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With nodes the counts can't decide, the decision evaluates them and the best node the
    counts do find feasible: the plan of the best node is never evaluated again."""
    nodes: Nodes = {f"a{i}": (gpu(f"GPU-a{i}"), gpu(f"GPU-b{i}", index=1)) for i in range(6)}
    nodes["tight"] = (gpu("GPU-t", mem=1000),)
    state = _state(nodes)
    _holds(state, "tight", ("GPU-t", 100, 0))
    pod = make_pod("p").gpu(1, mem=300).gpu(1, mem=300).build()
    calls: list[list[str] | None] = []

    def spy(*args: Any) -> Any:
        segs = args[4]
        calls.append(None if segs is None else [state.layout().names[s] for s in segs.tolist()])
        return _evaluate(*args)

    monkeypatch.setattr(decide_module, "_evaluate", spy)
    for extra in ((), (("GPU-t", 500, 0),)):  # the tight node feasible (best), then not
        if extra:
            _holds(state, "tight", *extra)
        calls.clear()
        d = decide(state, parse_request(pod, CFG))
        assert calls == [["a0", "tight"]]
        best = d.best_node()
        assert best == ("a0" if extra else "tight")
        assert d.plan_for(best) is not None
        assert len(calls) == 1, "the best node's plan was evaluated again"
        assert d.plan_for("a1") is not None and len(calls) == 2
    monkeypatch.undo()
    assert_same_as_every_node_evaluated(state, parse_request(pod, CFG))


def test_mig_card_with_one_instance_left_is_evaluated() -> None:
    state = state_with(n=(mig_gpu("GPU-m"),))
    _mig_holds(state, "n", "GPU-m", "4g.20gb", 0, 4)
    request = parse_request(make_pod("p").gpu(2, mem=9000).mode("mig").build(), CFG)
    d = assert_same_as_every_node_evaluated(state, request)
    assert d.best_node() is None  # three slices left: one 2g fits, a second does not
    request = parse_request(make_pod("p").gpu(2, mem=4000).mode("mig").build(), CFG)
    assert assert_same_as_every_node_evaluated(state, request).best_node() == "n"


def test_a_plan_asked_for_after_the_state_changed_is_the_plan_of_the_decision() -> None:
    state = state_with(n=(gpu("GPU-1", mem=8000), gpu("GPU-2", index=1, mem=8000)))
    request = parse_request(make_pod("p").gpu(1, mem=3000).build(), CFG)
    asked_now, asked_later = decide(state, request), decide(state, request)
    plan = asked_now.plan_for("n")
    assert plan is not None
    state.assume(plan.allocation())  # the later decision keeps a copy of the columns
    assert asked_later.plan_for("n") == plan
    assert decide(state, request).plan_for("n") != plan  # usage changed: a new decision differs


def test_a_plan_asked_for_after_the_layout_changed_is_refused() -> None:
    state = state_with(n=(gpu("GPU-1"),))
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=100).build(), CFG))
    state.upsert_node("m", (gpu("GPU-2"),))
    with pytest.raises(RuntimeError, match="layout changed"):
        d.plan_for("n")


@pytest.mark.parametrize(("log_max", "refreshed_in_place"), [(2, False), (4096, True)])
def test_kept_usage_follows_pod_changes(
    log_max: int, refreshed_in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decisions read usage kept with the layout's tables, refreshed where pods changed rows
    (or gathered again when more changed than the state remembers): always what a state built
    from scratch gives."""
    monkeypatch.setattr(state_module, "_USAGE_LOG_MAX", log_max)
    nodes: Nodes = {
        f"c{i}": tuple(gpu(f"GPU-c{i}{j}", index=j, mem=4000) for j in range(4)) for i in range(5)
    }
    nodes |= {f"m{i}": tuple(mig_gpu(f"GPU-m{i}{j}", index=j) for j in range(4)) for i in range(5)}
    nodes |= {
        f"s{i}": tuple(mps_gpu(f"GPU-s{i}{j}", index=j, mem=4000) for j in range(4))
        for i in range(5)
    }
    state = _state(nodes)
    request = parse_request(make_pod("p").gpu(1, mem=3000).build(), CFG)
    placed: dict[str, PodAllocation] = {}
    kept: list[tuple[object, ...]] = []  # per decision, each path's kept usage
    for i in range(12):
        d = decide(state, request)
        kept.append(tuple(t.scratch.memo["usage"][1] for _, t in d.layout.tables() if t))
        rebuilt = build_state(CFG, [(n, devs, 0, 0) for n, devs in nodes.items()], placed)
        fresh = decide(rebuilt, request)
        assert d.feasible.tolist() == fresh.feasible.tolist()
        best = d.best_node()
        assert best == fresh.best_node()
        if best is None:
            break
        plan = d.plan_for(best)
        assert plan is not None and plan == fresh.plan_for(best)
        alloc = plan.allocation()
        alloc = PodAllocation(f"ns/p{i}", alloc.node, alloc.devices, alloc.mig)
        state.assume(alloc)
        placed[alloc.key] = alloc
        if i == 4:  # one of them goes away again
            assert state.forget("ns/p1")
            del placed["ns/p1"]
    assert len(kept[0]) == 3  # hami-core, MIG, MPS
    assert all(a is b for a, b in zip(kept[0], kept[-1], strict=True)) == refreshed_in_place


def test_reasons_of_nodes_no_path_considers_are_their_static_ones() -> None:
    state = state_with(
        core=(gpu("GPU-1"), gpu("GPU-2", index=1, healthy=False)), mig=(mig_gpu("GPU-m"),)
    )
    d = assert_same_as_every_node_evaluated(
        state, parse_request(make_pod("p").gpu(2, mem=1000).mode("mig").build(), CFG)
    )
    core = d.node_index("core")
    assert d.reasons[core] == int(Reason.MODE | Reason.UNHEALTHY)
