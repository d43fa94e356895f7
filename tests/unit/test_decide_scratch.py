"""Work arrays reused across decisions: results never alias them, and a decision that finds
them taken (another one in progress) computes the same with arrays of its own."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from api.hami.config import DeviceConfig
from benchmarks.decision_latency import make_nodes, make_pods, request_mix
from scheduler_plugins.core.decide import Decision, decide
from scheduler_plugins.core.state import ClusterState, Scratch, build_state
from scheduler_plugins.server.malloc import tune_allocator

CFG = DeviceConfig()


def _cluster(seed: int = 3, nodes: int = 40, pods: int = 150) -> ClusterState:
    rng = random.Random(seed)
    specs = make_nodes(nodes, CFG, rng)
    return build_state(CFG, specs, make_pods(specs, pods, CFG, rng))


def _snapshot(d: Decision) -> tuple[object, ...]:
    """The verdicts and the plan of every feasible node (computed now, if not yet)."""
    plans = {name: d.plan_for(name) for i, name in enumerate(d.layout.names) if d.feasible[i]}
    return d.feasible.copy(), d.score.copy(), d.desirability.copy(), plans


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    fa, sa, da, pa = a
    fb, sb, db, pb = b
    arrays = [(fa, fb), (sa, sb), (da, db)]
    return pa == pb and all(np.array_equal(x, y) for x, y in arrays)  # type: ignore[arg-type]


def test_a_decision_keeps_its_arrays_while_later_ones_reuse_the_work_arrays() -> None:
    state = _cluster()
    mix = request_mix(CFG)
    before = [_snapshot(decide(state, r)) for _, r in mix]
    kept = [(kind, decide(state, r)) for kind, r in mix]  # plans not asked for yet
    for _ in range(2):  # the same work arrays, overwritten by every request type
        for _, r in reversed(mix):
            decide(state, r)
    for (kind, d), snap in zip(kept, before, strict=True):
        assert _same(_snapshot(d), snap), kind
        feasible = snap[0]
        assert isinstance(feasible, np.ndarray) and feasible.any(), f"{kind}: nothing to plan"


def test_results_share_no_memory_with_the_work_arrays() -> None:
    state = _cluster()
    layout = state.layout()
    tables = [t for _, t in layout.tables() if t is not None]
    for kind, r in request_mix(CFG):
        d = decide(state, r)
        best = d.best_node()
        assert best is not None and d.plan_for(best) is not None
        kept = [d.feasible, d.score, d.desirability]
        kept += [
            a
            for plans, _ in d._plans.values()
            for p in plans
            for a in (p.rows, p.mig_rank, p.mig_start, p.gpu_score)
        ]
        work = [
            a for s in (layout.scratch, *(t.scratch for t in tables)) for a in s._arrays.values()
        ]
        assert work, "decide used no work arrays"
        for a in kept:
            assert not any(np.shares_memory(a, w) for w in work), kind


def test_a_decision_while_the_work_arrays_are_taken_computes_the_same() -> None:
    state = _cluster(seed=5)
    for i, (kind, r) in enumerate(request_mix(CFG) * 2):
        r = replace(r, key=f"t/{kind}-{i}")
        ref = _snapshot(decide(state, r))
        layout = state.layout()
        assert layout.scratch.acquire()
        try:
            d = decide(state, r)  # as if another decision were in progress: private arrays
        finally:
            layout.scratch.release()
        assert _same(_snapshot(d), ref), kind
        assert layout.scratch.acquire(), "decide left the work arrays taken"
        layout.scratch.release()
        best = d.best_node()
        if best is not None:
            plan = d.plan_for(best)
            assert plan is not None
            state.assume(plan.allocation(r.cpu_milli, r.memory_bytes))


def test_work_arrays_are_dropped_with_the_layout() -> None:
    state = _cluster(nodes=10, pods=20)
    r = request_mix(CFG)[0][1]
    decide(state, r)
    old = state.layout()
    name, devices, cpu, mem = make_nodes(1, CFG, random.Random(9))[0]
    state.upsert_node("extra-" + name, devices, cpu_milli=cpu, memory_bytes=mem)
    decide(state, r)
    new = state.layout()
    assert new is not old
    assert new.core is not None and old.core is not None
    assert new.core.scratch is not old.core.scratch


def test_scratch_get_reuses_by_name_shape_and_dtype() -> None:
    s = Scratch()
    a = s.get("x", (3, 2), np.float64)
    assert s.get("x", (3, 2), np.float64) is a
    assert s.get("x", (3, 1), np.float64) is not a
    assert s.get("x", (3, 2), np.int64) is not a
    assert s.acquire() and not s.acquire()
    s.release()


def test_tune_allocator_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    text = tune_allocator()
    assert text.startswith(("tuned", "default")), text
    assert tune_allocator(-1, 1 << 20).startswith("default")
    assert tune_allocator(1 << 20, 1 << 20, 1 << 40).startswith("default")
    monkeypatch.setattr("sys.platform", "darwin")
    assert tune_allocator().startswith("default")
