"""What-ifs of preemption equal the state rebuilt without (and with) those pods, on random
clusters, pods and priorities.

- ``what_if`` on a node with some of its pods removed, some of them added back and a pod
  nominated there gives the oracle's verdict and reasons (``tests/oracle.py``) on a fresh
  ``ClusterState`` built from the same nodes and the pods that remain, the nominated one placed
  where ``decide`` would place it on that node; the state itself is left as it was.
- ``preemptible_nodes`` (every node at once, from the state's device ledger) names exactly the
  nodes that do not fit but fit once their lower-priority pods (and the pods being preempted
  already) are removed, node by node.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.core.whatif import preemptible_nodes, what_if
from tests.builders import make_pod
from tests.oracle import evaluate
from tests.property.test_decide_props import CFG, clusters, requests


@st.composite
def simple_requests(draw: st.DrawFn, i: int) -> PodRequest:
    """One container of one or two devices, of a fixed size or a share of the card."""
    pod = make_pod(f"s{i}")
    if draw(st.booleans()):
        pod.gpu(draw(st.integers(1, 2)), mem=draw(st.sampled_from([1000, 4000, 9000, 20_000])))
    else:
        pod.gpu(draw(st.integers(1, 2)), pct=draw(st.sampled_from([25, 50, 100])))
    return parse_request(pod.build(), CFG)


def any_request(i: int) -> st.SearchStrategy[PodRequest]:
    return st.one_of(simple_requests(i), requests(i))


def populate(state: ClusterState, data: Any) -> None:
    """Pods of random priorities placed one after another, as the scheduler places them."""
    for i in range(data.draw(st.integers(0, 14), label="pods")):
        request = data.draw(simple_requests(100 + i), label=f"pod {i}")
        decision = decide(state, request)
        best = decision.best_node()
        if best is None:
            continue
        plan = decision.plan_for(best)
        assert plan is not None
        priority = data.draw(st.integers(0, 3), label=f"priority {i}")
        state.assume(plan.allocation(uid=f"uid-{i}", priority=priority))


def rebuilt(state: ClusterState, pods: list[PodAllocation]) -> ClusterState:
    """A fresh state of the same nodes holding ``pods``."""
    fresh = ClusterState(CFG)
    for name, e in state.nodes.items():
        fresh.upsert_node(
            name,
            e.devices,
            cpu_milli=e.cpu_milli,
            memory_bytes=e.memory_bytes,
            cordoned=e.cordoned,
            pair_scores=e.pair_scores,
        )
    for alloc in pods:
        fresh.upsert_pod(alloc, alloc.key)
    return fresh


def subset(items: list[str]) -> st.SearchStrategy[set[str]]:
    return st.sets(st.sampled_from(items)) if items else st.just(set())


def with_priority(request: PodRequest, priority: int) -> PodRequest:
    return replace(request, priority=priority)


@settings(max_examples=150, deadline=None)
@given(clusters(), st.data())
def test_what_if_equals_the_node_rebuilt_without_and_with_those_pods(
    state: ClusterState, data: Any
) -> None:
    populate(state, data)
    gpu_nodes = sorted(n for n, e in state.nodes.items() if e.devices)
    if not gpu_nodes:
        return
    busy = [n for n in gpu_nodes if state.pods_on(n)]
    node = data.draw(st.sampled_from(busy or gpu_nodes), label="node")
    on_node = state.pods_on(node)
    removed = data.draw(subset([a.key for a in on_node]), label="removed")
    back = data.draw(subset(sorted(removed)), label="added back")
    nominated = data.draw(any_request(200), label="nominated") if data.draw(st.booleans()) else None
    request = data.draw(any_request(300), label="pod")
    before = state.usage_snapshot()

    added: list[PodAllocation | PodRequest] = [a for a in on_node if a.key in back]
    if nominated is not None:
        added.append(nominated)
    got = what_if(state, request, node, removed=removed, added=added)
    assert state.usage_snapshot() == before  # the state itself never changes

    kept = [a for a in state.allocations() if a.key not in removed or a.key in back]
    fresh = rebuilt(state, kept)
    if nominated is not None:
        plan = decide(fresh, nominated).plan_for(node)
        if plan is not None:  # placed as decide places it there; else it takes nothing
            fresh.assume(plan.allocation())
    want = evaluate(fresh, request)[node]
    event(f"fits: {got.fits}, removed: {bool(removed)}, nominated: {nominated is not None}")
    assert got.fits == want.feasible, (got, want)
    if not got.fits:
        assert got.reasons == want.reasons, (got, want)
        assert node in got.message and got.message.startswith("Tessera: 1 node [")


@settings(max_examples=150, deadline=None)
@given(clusters(), st.data())
def test_preemptible_nodes_are_those_that_fit_once_their_lower_pods_are_gone(
    state: ClusterState, data: Any
) -> None:
    populate(state, data)
    priority = data.draw(st.integers(0, 4), label="priority")
    request = with_priority(data.draw(any_request(400), label="pod"), priority)
    # Pods being preempted already (for another pod) count as gone too, whatever their priority.
    leaving = data.draw(subset(sorted(a.key for a in state.allocations())), label="leaving")
    decision = decide(state, request)
    got = preemptible_nodes(state, request, decision.feasible, leaving)

    want = []
    for s, node in enumerate(decision.layout.names):
        lower = {
            a.key
            for a in state.pods_on(node)
            if (a.priority < priority or a.key in leaving) and a.holds_gpus
        }
        if decision.feasible[s] or not lower:
            continue
        if what_if(state, request, node, removed=lower).fits:
            want.append(node)
            # ... and the same on the node rebuilt without them (the oracle).
            kept = [a for a in state.allocations() if a.key not in lower]
            assert evaluate(rebuilt(state, kept), request)[node].feasible
    event(f"preemptible nodes: {min(len(want), 2)}")
    assert got == want
