"""``decide``'s shortcuts give what evaluating every node gives, on random clusters and pods.

- Feasibility from fit counts, with the full evaluation only for the nodes counts can't decide,
  equals the full evaluation of every node and the oracle (``tests/oracle.py``: the contract's
  rules GPU by GPU, in plain Python).
- A node's plan, evaluated for that node alone when asked for, equals its plan in both; so does
  the evaluation of any subset of nodes.
- Reasons, computed only for infeasible nodes (the same evaluation, reporting failed checks),
  equal the oracle's; the explanation equals the plain grouping.

Both with the vectorized code for large tables and the plain one for small tables.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scheduler_plugins.core.decide as decide_module
from api.hami import keys as ann
from api.hami.catalog import MODELS
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc
from api.hami.keys import MPS_MAX_CLIENTS, GpuMode
from api.hami.register import GpuDevice
from scheduler_plugins.core.decide import Decision, _evaluate, decide
from scheduler_plugins.core.explain import _free_intervals, explain, node_class
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.rules import Reason, reason_names
from scheduler_plugins.core.state import ClusterState
from tests.builders import make_pod
from tests.oracle import assert_agrees

CFG = DeviceConfig()
MIG_MODELS = tuple(m for m in MODELS if m.mig_capable and CFG.allowed_profiles(m.name))


@st.composite
def gpus(draw: st.DrawFn, node: int, index: int, mps_node: bool) -> GpuDevice:
    """A GPU of any mode; on an MPS node (``mps_node``) an MPS GPU, as its node agent
    registers them all (its count capped at ``MPS_MAX_CLIENTS``, unhealthy while its control
    daemon is down)."""
    uuid = f"GPU-{node}-{index}"
    count = draw(st.sampled_from([1, 2, 4, 10]))
    healthy = draw(st.booleans() | st.just(True))
    numa = draw(st.integers(0, 1))
    if mps_node:
        model = draw(st.sampled_from(MODELS))
        clients = min(draw(st.sampled_from([1, 2, 4, 10, 64])), MPS_MAX_CLIENTS)
        return GpuDevice(
            uuid, index, clients, model.memory_mib, 100, model.name, numa, healthy, "mps"
        )
    if draw(st.booleans()):
        model = draw(st.sampled_from(MIG_MODELS))
        allowed = set(CFG.allowed_profiles(model.name))
        profiles = tuple(model.mig_profile(p) for p in model.profiles if p.name in allowed)
        return GpuDevice(
            uuid, index, count, model.memory_mib, 100, model.name, numa, healthy, "mig", profiles
        )
    model = draw(st.sampled_from(MODELS))
    mode: GpuMode = draw(st.sampled_from(["hami-core"] * 3 + ["mps"]))
    return GpuDevice(uuid, index, count, model.memory_mib, 100, model.name, numa, healthy, mode)


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    """Nodes of hami-core, MIG and MPS GPUs on two NUMA nodes; some GPUs cordoned, some
    holding a device HAMi <= v2.9 placed on MIG, some nodes with GPU pair scores."""
    state = ClusterState(CFG)
    for n in range(draw(st.integers(1, 6))):
        mps_node = draw(st.integers(0, 3)) == 0
        devices = tuple(draw(gpus(n, i, mps_node)) for i in range(draw(st.integers(0, 4))))
        uuids = [d.id for d in devices]
        cordoned = frozenset(
            draw(st.lists(st.sampled_from(uuids), max_size=1))
            if uuids and draw(st.booleans())
            else ()
        )
        pair_scores = None
        if len(uuids) > 1 and draw(st.booleans()):
            pair_scores = {
                a: {b: draw(st.sampled_from([0, 10, 60, 200])) for b in uuids if b != a}
                for a in uuids
            }
        name = f"node-{n}"
        state.upsert_node(
            name,
            devices,
            cpu_milli=32_000,
            memory_bytes=2**38,
            cordoned=cordoned,
            pair_scores=pair_scores,
        )
        if uuids and draw(st.integers(0, 9)) == 0:
            key = f"default/legacy-{n}"
            legacy = DeviceAlloc(draw(st.sampled_from(uuids)), 4864, 15, legacy="1-1")
            state.upsert_pod(PodAllocation(key, name, (legacy,), ()), key)
    return state


GPU_POLICIES = (
    None,
    "binpack",
    "spread",
    "numa",
    "numa,binpack",
    "binpack, numa",
    "spread,numa",
    "mutex",
    "binpack,mutex",
    "topology-aware",
    "topology-aware,spread",
    "numa,mutex,binpack",
)


@st.composite
def requests(draw: st.DrawFn, i: int) -> PodRequest:
    pod = make_pod(f"p{i}")
    for _ in range(draw(st.integers(1, 3))):
        memory = draw(st.sampled_from(["abs", "pct", "none"]))
        pod.gpu(
            draw(st.integers(1, 3)),
            mem=draw(st.sampled_from([500, 3000, 9000, 20_000])) if memory == "abs" else None,
            pct=draw(st.sampled_from([10, 25, 50, 100])) if memory == "pct" else None,
            cores=draw(st.sampled_from([None, 0, 30, 100])),
        )
    mode = draw(
        st.sampled_from(
            [
                None,
                "hami-core",
                "mig",
                "mps",
                "hami-core,mig",
                "mps,hami-core",
                "mig,mps",
                "hami-core,mig,mps",
            ]
        )
    )
    if mode:
        pod.annotate(ann.VGPU_MODE, mode)
    node_policy = draw(st.sampled_from([None, "binpack", "spread"]))
    if node_policy:
        pod.annotate(ann.NODE_POLICY, node_policy)
    gpu_policy = draw(st.sampled_from(GPU_POLICIES))
    if gpu_policy:
        pod.annotate(ann.GPU_POLICY, gpu_policy)
    if draw(st.integers(0, 3)) == 0:
        pod.annotate(ann.NUMA_BIND, draw(st.sampled_from(["true", "false", "1"])))
    if draw(st.integers(0, 3)) == 0:
        weights = draw(
            st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)).filter(any)
        )
        pod.annotate(ann.SCORING_WEIGHTS, "slot={},core={},memory={}".format(*weights))
    selector = draw(st.sampled_from([None, ann.USE_GPUTYPE, ann.NOUSE_GPUTYPE]))
    if selector:
        pod.annotate(selector, draw(st.sampled_from(["A100", "H100", "V100"])))
    return parse_request(pod.build(), CFG)


def plain_explain(d: Decision, state: ClusterState) -> str:
    """The grouping ``explain`` does, written out node by node."""
    layout = d.layout
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    for i in np.flatnonzero(~d.feasible).tolist():
        groups[(node_class(state, layout.names[i]), int(d.reasons[i]))].append(layout.names[i])
    for name in layout.gpu_less:
        groups[("no GPUs", int(Reason.NO_GPU))].append(name)
    clauses = []
    for (cls, bits), names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names.sort()
        clause = f"{len(names)} node{'s' if len(names) != 1 else ''} [{cls}]: "
        clause += "; ".join(reason_names(bits)) or "does not fit"
        if bits & Reason.MIG_FRAGMENTATION:
            clause += " — " + _free_intervals(state, names[:3])
        elif len(names) <= 3:
            clause += f" ({', '.join(names)})"
        clauses.append(clause)
    head = f"{d.feasible_count()}/{len(layout.names) + len(layout.gpu_less)} nodes are available"
    return head + (": " + "; ".join(clauses) if clauses else "")


def check(state: ClusterState, request: PodRequest, subset: list[int]) -> Decision:
    d = decide(state, request)
    layout = state.layout()
    full_ok, full_plans = _evaluate(state, layout, request, d._masks, None, False)
    assert d.feasible.tolist() == full_ok.tolist()
    assert_agrees(state, request, d)  # verdicts, reasons and feasible nodes' plans
    assert explain(d, state) == plain_explain(d, state)
    for s, name in enumerate(layout.names):
        if not d.feasible[s]:
            assert d.plan_for(name) is None
            continue
        assert d.plan_for(name) is not None
        plans, row = d._plans_of(s)
        for got, full in zip(plans, full_plans, strict=True):
            for field in ("rows", "mig_rank", "mig_start", "gpu_score"):
                assert getattr(got, field)[row].tolist() == getattr(full, field)[s].tolist()
    segs = np.array(sorted({s for s in subset if s < len(layout.names)}), np.int64)
    if segs.size:
        sub_ok, sub_plans = _evaluate(state, layout, request, d._masks, segs, False)
        assert sub_ok.tolist() == full_ok[segs].tolist()
        for sub, full in zip(sub_plans, full_plans, strict=True):
            assert sub.rows[sub_ok].tolist() == full.rows[segs][sub_ok].tolist()
            assert sub.gpu_score[sub_ok].tolist() == full.gpu_score[segs][sub_ok].tolist()
    return d


@settings(max_examples=80, deadline=None)
@given(clusters(), st.data())
def test_shortcuts_agree_with_evaluating_every_node(state: ClusterState, data: Any) -> None:
    small = data.draw(st.sampled_from([0, decide_module._SMALL]), label="plain-code limit")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decide_module, "_SMALL", small)
        for i in range(data.draw(st.integers(1, 8), label="pods")):
            request = data.draw(requests(i), label=f"pod {i}")
            subset = data.draw(st.lists(st.integers(0, 5), max_size=4), label="subset")
            d = check(state, request, subset)
            best = d.best_node()
            if best is not None and data.draw(st.booleans(), label="place it"):
                plan = d.plan_for(best)
                assert plan is not None
                state.assume(plan.allocation(request.cpu_milli, request.memory_bytes))
