"""Pairing kube-scheduler's preemptions from the watch (``core.preemptions``): victims and the
pod nominated for them, in either order, once each, and what the victims were blocking."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc
from scheduler_plugins.core.preemptions import (
    OTHER,
    Nominee,
    Preemption,
    PreemptionTracker,
    Victim,
    blocking_needs,
)
from scheduler_plugins.core.requests import PodAllocation, parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState
from tests.builders import gpu, make_pod

CFG = DeviceConfig()


def nominee(
    name: str, node: str, priority: int, at: float, mem: int = 4000, cores: int = 0
) -> Nominee:
    pod = make_pod(name).gpu(1, mem=mem, cores=cores).build()
    pod["spec"]["priority"] = priority
    return Nominee(f"default/{name}", f"uid-{name}", node, parse_request(pod, CFG), at)


def held(
    name: str, node: str, mem: int = 3000, cores: int = 10, priority: int = 0
) -> PodAllocation:
    return PodAllocation(
        f"default/{name}", node, (DeviceAlloc(f"GPU-{node}", mem, cores),), (), priority=priority
    )


def victim(name: str, node: str, priority: int, at: float) -> Victim:
    return Victim(f"default/{name}", priority, held(name, node, priority=priority), at)


@dataclass(frozen=True)
class Step:
    at: float
    what: Nominee | Victim


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[Step]
    # (preemptor, victims) reported by ``due`` at the end
    reported: list[tuple[str, list[str]]]


CASES = [
    Case(
        "victims after the nomination",
        [
            Step(0, nominee("p", "n1", 10, 0)),
            Step(0.1, victim("a", "n1", 0, 0.1)),
            Step(0.2, victim("b", "n1", 5, 0.2)),
        ],
        [("default/p", ["default/a", "default/b"])],
    ),
    Case(
        "victims before the nomination wait for it",
        [Step(0, victim("a", "n1", 0, 0)), Step(1, nominee("p", "n1", 10, 1))],
        [("default/p", ["default/a"])],
    ),
    Case(
        "a victim goes to the latest pod nominated on its node that outranks it",
        [
            Step(0, nominee("early", "n1", 10, 0)),
            Step(1, nominee("late", "n1", 10, 1)),
            Step(2, nominee("outranked", "n1", 1, 2)),
            Step(3, nominee("elsewhere", "n2", 10, 3)),
            Step(4, victim("a", "n1", 3, 4)),
        ],
        [("default/late", ["default/a"])],
    ),
    Case(
        "a victim seen twice (a re-list) counts once",
        [
            Step(0, nominee("p", "n1", 10, 0)),
            Step(1, victim("a", "n1", 0, 1)),
            Step(2, victim("a", "n1", 0, 2)),
        ],
        [("default/p", ["default/a"])],
    ),
    Case(
        "too far apart: not the same preemption",
        [Step(0, victim("a", "n1", 0, 0)), Step(500, nominee("p", "n1", 10, 500))],
        [],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pairing(case: Case) -> None:
    tracker = PreemptionTracker(settle_s=2, window_s=120)
    for step in case.steps:
        assert tracker.due(step.at) == []  # nothing settles while victims keep coming
        if isinstance(step.what, Nominee):
            tracker.nominated(step.what)
        else:
            tracker.victim(step.what)
    end = case.steps[-1].at + 2
    got = [(p.preemptor.key, [v.key for v in p.victims]) for p in tracker.due(end)]
    assert got == case.reported
    assert tracker.due(end + 1000) == []  # reported once; what waited is forgotten


def test_what_the_victims_blocked_is_the_preemptors_reasons_with_them_there() -> None:
    state = ClusterState(CFG)
    state.upsert_node("n1", (gpu("GPU-n1"),))  # 8192 MiB, 100 cores
    a, b = held("a", "n1", 3000, 60), held("b", "n1", 3000, 30)
    state.upsert_pod(a, a.key)  # b is gone already: added back for the question
    p = nominee("p", "n1", 10, 0, mem=4000, cores=20)
    preemption = Preemption(p, (Victim(a.key, 0, a, 0), Victim(b.key, 0, b, 0)))
    bits = blocking_needs(state, preemption)
    assert bits == Reason.MEMORY | Reason.CORES  # 6000 of 8192 MiB, 90 of 100 cores
    assert Preemption(p, preemption.victims, bits).needs() == ["memory", "cores"]
    message = Preemption(p, preemption.victims, bits).describe()
    assert message.startswith("kube-scheduler preempted 2 pods on node n1 for this pod")
    assert "default/a (priority 0, held GPU GPU-n1 3000MiB 60% cores)" in message
    assert (
        "did not fit there with them: insufficient GPU memory; insufficient GPU cores." in message
    )
    # Its own reservation there by now does not count against it.
    state.assume(held("p", "n1", 4000, 0))
    assert blocking_needs(state, preemption) == bits
    # Victims that blocked nothing Tessera counts (room for kube-scheduler's own resources).
    state.forget("default/p")
    nothing = Preemption(nominee("q", "n1", 10, 0, mem=100), preemption.victims)
    assert blocking_needs(state, nothing) == 0 and nothing.needs() == [OTHER]


def test_a_pod_nominated_only_until_it_binds_takes_no_victims() -> None:
    """kube-scheduler also nominates a pod it is about to bind (waiting at PreBind): once
    bound it no longer is, and a later victim waits for its real preemptor."""
    tracker = PreemptionTracker(settle_s=2, window_s=120)
    tracker.nominated(nominee("binding", "n1", 10, 0))
    tracker.withdrawn("default/binding")
    tracker.victim(victim("a", "n1", 0, 1))
    tracker.nominated(nominee("p", "n1", 10, 2))
    # A preemptor bound before its preemption was reported is still reported.
    tracker.nominated(nominee("q", "n2", 10, 0))
    tracker.victim(victim("b", "n2", 0, 0.5))
    tracker.withdrawn("default/q")
    got = {p.preemptor.key: [v.key for v in p.victims] for p in tracker.due(10)}
    assert got == {"default/p": ["default/a"], "default/q": ["default/b"]}
