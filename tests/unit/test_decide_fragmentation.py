"""The engine under the fragmentation node policy: which node and GPU, the fallbacks, the score
kube-scheduler gets, and the workload the state learns from the pods it holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from api.hami.config import DeviceConfig
from api.hami.policy import Policy
from scheduler_plugins.core import decide as decide_module
from scheduler_plugins.core import fragmentation as fr
from scheduler_plugins.core import ranking
from scheduler_plugins.core.decide import _FragRows, decide
from scheduler_plugins.core.requests import PodRequest, parse_request
from scheduler_plugins.core.state import ClusterState
from tests.builders import gpu, make_pod, mig_gpu

FRAG = DeviceConfig(default_node_policy=Policy.FRAGMENTATION)
POLICY = "hami.io/node-scheduler-policy"


def state(cfg: DeviceConfig = FRAG, **nodes: tuple[Any, ...]) -> ClusterState:
    st = ClusterState(cfg)
    for name, (devices, cpu) in nodes.items():
        st.upsert_node(name, devices, cpu_milli=cpu, memory_bytes=64 << 30)
    return st


def places_every_pod(st: ClusterState) -> ClusterState:
    """``st`` where Tessera places the pods without GPUs too (one asked): the policy's ties
    go to the fuller node."""
    st.kinds.host_only_asks()
    assert st.kinds.fuller_ties
    return st


def two_gpus(node: str) -> tuple[Any, ...]:
    return (gpu(f"{node}-0", index=0, mem=1000), gpu(f"{node}-1", index=1, mem=1000))


def request(
    name: str,
    pct: int,
    cpu: str = "1",
    cfg: DeviceConfig = FRAG,
    annotations: dict[str, str] | None = None,
) -> PodRequest:
    pod = make_pod(name).gpu(1, pct=pct, cores=pct).build()
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu}
    pod["metadata"]["annotations"].update(annotations or {})
    return parse_request(pod, cfg)


def place(st: ClusterState, req: PodRequest) -> tuple[str, list[str]]:
    d = decide(st, req)
    node = d.best_node()
    assert node is not None
    plan = d.plan_for(node)
    assert plan is not None
    st.assume(plan.allocation(req.cpu_milli, req.memory_bytes, uid=req.key))
    return node, [x.uuid for c in plan.containers for x in c]


def fresh(st: ClusterState, req: PodRequest) -> Any:
    """A decision that cannot use the rows kept between decisions (another holds the
    layout's work arrays): computed afresh."""
    layout = st.layout()
    assert layout.scratch.acquire()
    try:
        return decide(st, req)
    finally:
        layout.scratch.release()


def count_recomputed_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows each later one-device delta computation takes (``node_best``)."""
    recomputed: list[int] = []
    real = fr.node_best

    def counted(free: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        recomputed.append(free.shape[0])
        return real(free, *args, **kwargs)

    monkeypatch.setattr(fr, "node_best", counted)
    return recomputed


@pytest.mark.parametrize(("every_pod", "nodes"), [(True, {"a"}), (False, {"a", "b"})])
def test_half_pods_complete_half_used_gpus(every_pod: bool, nodes: set[str]) -> None:
    st = state(a=(two_gpus("a"), 16000), b=(two_gpus("b"), 16000))
    if every_pod:
        places_every_pod(st)
    placed = [place(st, request(f"p{i}", 50)) for i in range(4)]
    # two GPUs filled completely before a third is touched: binpack at the GPU level too,
    # on one node when ties go to the fuller, else spread over both
    gpus = [g for _, gs in placed for g in gs]
    assert len(set(gpus)) == 2
    assert {n for n, _ in placed} == nodes


def test_spread_gpu_policy_would_split_them() -> None:
    """The contrast: HAMi's default GPU policy (spread) puts the second half pod on the
    other, empty GPU of the node."""
    cfg = DeviceConfig()
    st = state(cfg, a=(two_gpus("a"), 16000))
    first = place(st, request("p0", 50, cfg=cfg))
    second = place(st, request("p1", 50, cfg=cfg))
    assert first[1] != second[1]


def test_a_node_whose_cpu_the_pod_would_strand_is_avoided() -> None:
    # a holds a 3-core whole-GPU pod; with one more it keeps 1 core, less than the 3 every pod
    # here asks: its third GPU would be stranded. Binpack takes a (the fuller node).
    nodes = {"a": (three_gpus("a"), 7000), "b": (three_gpus("b"), 16000)}
    for cfg, want in ((FRAG, "b"), (DeviceConfig(), "a")):
        st = state(cfg, **nodes)
        st.assume(_held("a", "a-0", 1000, 100, 3000))
        assert place(st, request("p", 100, cpu="3", cfg=cfg))[0] == want


def three_gpus(node: str) -> tuple[Any, ...]:
    return tuple(gpu(f"{node}-{i}", index=i, mem=1000) for i in range(3))


def _held(node: str, uuid: str, mem: int, cores: int, cpu: int, uid: str = "") -> Any:
    from api.hami.devices import DeviceAlloc
    from scheduler_plugins.core.requests import PodAllocation

    return PodAllocation(
        f"held/{uuid}", node, (DeviceAlloc(uuid, mem, cores),), (), cpu, 0, uid=uid
    )


def test_a_pod_naming_binpack_or_spread_gets_hamis_rule() -> None:
    st = state(a=(two_gpus("a"), 16000), b=(two_gpus("b"), 16000))
    st.assume(_held("a", "a-0", 500, 50, 1000))
    assert place(st, request("s", 50, annotations={POLICY: "spread"}))[0] == "b"
    assert place(st, request("b", 50, annotations={POLICY: "binpack"}))[0] == "a"


def test_a_named_gpu_policy_still_picks_the_gpu() -> None:
    st = state(a=(two_gpus("a"), 16000))
    st.assume(_held("a", "a-1", 500, 50, 1000))
    # fragmentation would complete a-1; the pod's own spread takes the empty a-0
    req = request("p", 50, annotations={"hami.io/gpu-scheduler-policy": "spread"})
    assert place(st, req) == ("a", ["a-0"])
    assert place(state(a=(two_gpus("a"), 16000)), request("q", 50))[0] == "a"


def test_mig_pods_fall_back_to_binpack() -> None:
    st = state(
        m1=((mig_gpu("m1-0", config=FRAG),), 16000), m2=((mig_gpu("m2-0", config=FRAG),), 16000)
    )
    pod = make_pod("mig").gpu(1, mem=5000).mode("mig").build()
    req = parse_request(pod, FRAG)
    d = decide(st, req)
    assert d.preference.policy is Policy.BINPACK
    assert d.best_node() is not None


@pytest.mark.parametrize("every_pod", [True, False])
def test_kube_scheduler_gets_the_score_on_its_scale(every_pod: bool) -> None:
    st = state(a=(two_gpus("a"), 16000), b=(two_gpus("b"), 16000))
    if every_pod:
        places_every_pod(st)
    st.assume(_held("a", "a-0", 500, 50, 1000))
    d = decide(st, request("p", 50))
    assert d.preference.policy is Policy.FRAGMENTATION
    kube = d.preference.kube_scores(d.score).tolist()
    assert kube == [int(100 * s / fr.node_score_max(every_pod)) for s in d.score]
    assert all(0 <= k <= 100 for k in kube)
    # completing a's half GPU strands no more than opening one of b's: the tie decides
    assert d.delta is not None and d.delta[d.feasible].tolist() == [0.0, 0.0]
    fuller_first = bool(d.score[d.node_index("a")] > d.score[d.node_index("b")])
    assert fuller_first is every_pod


def test_cpu_only_pods_are_ranked_by_what_they_strand() -> None:
    st = state(full=(two_gpus("full"), 8000), idle=(two_gpus("idle"), 8000))
    for uuid in ("full-0", "full-1"):
        st.assume(_held("full", uuid, 1000, 100, 1000))
    pod = make_pod("cpu").container(cpu="4").build()
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4"}
    req = parse_request(pod, FRAG)
    assert not req.wants_gpu
    d = decide(st, req)
    # its CPU on the node whose GPUs are all taken strands nothing
    assert d.best_node() == "full"


def test_the_state_learns_the_workload_from_the_pods_that_ask() -> None:
    """The workload is what asks for room, each pod once: pods no node has room for count,
    pods leaving do not take their kind with them, a pod retried counts once."""
    st = state(a=(two_gpus("a"), 16000))
    assert st.task_mix() is fr.DEFAULT_MIX
    for i in range(3):
        place(st, request(f"p{i}", 30))
    mix = st.task_mix()
    assert mix.share.tolist() == pytest.approx([0.3])  # a new kind: known at once
    assert mix.cpu.tolist() == [1000]
    for i in range(3):
        st.forget(f"default/p{i}")
    assert st.task_mix() is mix  # what comes next is still that kind
    big = request("big", 100, cpu="64")  # more CPU than the node has: fits nowhere
    for _ in range(40):
        assert decide(st, big).best_node() is None  # retried: one pod
    for i in range(13):  # 16 pods since the mix was built: it is looked at again
        assert decide(st, request(f"w{i}", 100, cpu="64")).best_node() is None
    mix = st.task_mix()
    assert mix.share.tolist() == pytest.approx([0.3, 1.0])
    assert mix.weight.tolist() == pytest.approx([3 / 17, 14 / 17])


def test_a_pod_found_holding_gpus_counts_as_asking_once() -> None:
    """A pod bound before a restart (or by another scheduler) is workload too: it counts when
    the state learns of it, and not again when it is decided for."""
    st = state(a=(two_gpus("a"), 16000))
    req = request("p", 40)
    st.assume(_held("a", "a-0", 400, 40, 1000, uid=req.uid or req.key))
    assert st.task_mix().share.tolist() == pytest.approx([0.4])
    decide(st, req)
    for i in range(16):  # 16 pods since the mix was built: it is looked at again
        decide(st, request(f"q{i}", 20))
    assert st.task_mix().weight.tolist() == pytest.approx([16 / 17, 1 / 17])


def test_a_pod_leaving_the_choice_to_tessera_is_offered_its_best_node_alone() -> None:
    st = state(a=(two_gpus("a"), 16000), b=(two_gpus("b"), 16000), c=(two_gpus("c"), 16000))
    places_every_pod(st)
    st.assume(_held("b", "b-0", 500, 50, 1000))
    d = decide(st, request("p", 50))
    layout = d.layout
    feasible = np.flatnonzero(d.feasible)
    offered = ranking.candidates(feasible, d.score, d.preference, layout.name_rank, None, 100)
    assert [layout.names[i] for i in offered] == ["b"]
    every = ranking.candidates(feasible, d.score, d.preference, layout.name_rank, None, 0)
    assert len(every) == 3 and layout.names[every[0]] == "b"


def test_kept_rows_give_what_a_fresh_computation_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores from the rows kept between decisions (refreshed where pods changed a node, CPU
    only pods included) equal those computed afresh (a decision that cannot use the kept
    rows: another holds the layout's work arrays). A new mix reaches every kept row at once
    here (how it reaches them gradually: the next test)."""
    monkeypatch.setattr(_FragRows, "ROLL_DECISIONS", 1)
    rng = np.random.default_rng(5)
    nodes = {f"n{i}": (three_gpus(f"n{i}"), 16000) for i in range(12)}
    st = state(**nodes)
    for i in range(60):
        if rng.random() < 0.25:
            pod = make_pod(f"cpu{i}").container(cpu="2").build()
            pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "2"}
            req = parse_request(pod, FRAG)
        else:
            pct = int(rng.choice([10, 25, 50, 100]))
            req = request(f"p{i}", pct, cpu=str(int(rng.integers(1, 4))))
        d = decide(st, req)
        assert d.score.tolist() == pytest.approx(fresh(st, req).score.tolist())
        node = d.best_node()
        if node is None:
            continue
        plan = d.plan_for(node)
        assert plan is not None
        st.assume(plan.allocation(req.cpu_milli, req.memory_bytes, uid=req.key))


def test_several_devices_take_the_tightest_gpus() -> None:
    st = state(a=(three_gpus("a"), 16000))
    st.assume(_held("a", "a-0", 500, 50, 1000))
    pod = make_pod("two").gpu(2, pct=50, cores=50).build()
    req = parse_request(pod, FRAG)
    node, gpus = place(st, req)
    # a-0 (half free) first, then of the two empty GPUs the last, as the engine picks
    assert (node, sorted(gpus)) == ("a", ["a-0", "a-2"])


def test_a_nodes_new_allocatable_reaches_the_kept_rows() -> None:
    four = {n: (tuple(gpu(f"{n}-{i}", index=i, mem=1000) for i in range(4)), 16000) for n in "ab"}
    st = places_every_pod(state(**four))
    st.assume(_held("a", "a-0", 1000, 100, 1000))
    st.assume(_held("a", "a-1", 1000, 100, 3000))
    assert decide(st, request("q", 100, cpu="3")).best_node() == "a"  # the fuller node
    # a now shows 8 cores, 4 left: after q, 1, and its last GPU stranded for 3-core pods
    st.upsert_node("a", four["a"][0], cpu_milli=8000, memory_bytes=64 << 30)
    assert decide(st, request("q", 100, cpu="3")).best_node() == "b"


def test_a_new_mix_moves_the_kept_rows_a_few_per_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new workload mix never recomputes every kept row in one decision: the rows pods
    changed move to it at once, the rest a few per decision; once every row has moved, the
    scores are those of a fresh computation under the new mix."""
    names = [f"n{i:03d}" for i in range(480)]
    st = state(**{n: (three_gpus(n), 64000) for n in names})
    for n in names[:4]:
        st.assume(_held(n, f"{n}-0", 500, 50, 1000))
    req = request("q", 30)
    decide(st, req)  # rows kept under a mix of half-GPU pods
    first = st.task_mix()
    for i in range(16):  # a new kind, most of what asked, on two nodes
        n = names[100 + i % 2]
        st.assume(_held(n, f"{n}-{i % 3}", 100, 10, 1000, uid=f"new{i}"))
    assert st.task_mix() is not first
    recomputed = count_recomputed_rows(monkeypatch)
    step = -(-len(names) // 32)
    for _ in range(32):
        recomputed.clear()
        d = decide(st, req)
        assert 0 < sum(recomputed) <= 2 + step  # the two changed nodes, then a step of rows
    recomputed.clear()
    d = decide(st, req)
    assert recomputed == []  # every row moved: nothing left to recompute
    want = fresh(st, req)
    assert d.score.tolist() == pytest.approx(want.score.tolist())


def test_a_kind_asked_again_after_a_move_catches_up_a_step_per_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kind of request not asked while the rows moved to a new mix follows them a step of
    rows per decision too (never every row at once), its other rows scored as under the mix
    before until then; once caught up, its scores are those of a fresh computation."""
    names = [f"n{i:03d}" for i in range(480)]
    st = state(**{n: (three_gpus(n), 64000) for n in names})
    for n in names[:4]:
        st.assume(_held(n, f"{n}-0", 500, 50, 1000))
    other, req = request("o", 60), request("q", 30)
    decide(st, req)  # q's deltas kept under the first mix
    first = st.task_mix()
    for i in range(16):
        n = names[100 + i % 2]
        st.assume(_held(n, f"{n}-{i % 3}", 100, 10, 1000, uid=f"new{i}"))
    assert st.task_mix() is not first
    for _ in range(32):  # every row moves while only another kind is asked
        decide(st, other)
    recomputed = count_recomputed_rows(monkeypatch)
    step = -(-len(names) // 32)
    total = 0
    for _ in range(32):
        recomputed.clear()
        decide(st, req)
        assert len(recomputed) == 1 and recomputed[0] <= step + 2  # + the two changed nodes
        total += recomputed[0]
    assert total == len(names)  # each row once
    recomputed.clear()
    d = decide(st, req)
    assert recomputed == []
    assert d.score.tolist() == pytest.approx(fresh(st, req).score.tolist())


def test_pods_differing_only_in_cpu_share_the_kept_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CPU and memory are plenty, a pod's delta does not depend on them: a pod asking
    other CPU than the last, same GPU request, recomputes only the nodes where its CPU can
    decide what still fits, and scores as a fresh computation does."""
    names = [f"n{i:02d}" for i in range(40)]
    st = state(**{n: (three_gpus(n), 64000 if i else 4000) for i, n in enumerate(names)})
    st.assume(_held("n05", "n05-0", 500, 50, 3000))  # the mix: half GPUs with 3 cores
    decide(st, request("a", 30, cpu="1"))
    recomputed = count_recomputed_rows(monkeypatch)
    b = request("b", 30, cpu="2")
    d = decide(st, b)
    assert recomputed == [1]  # n00: 4 cores, 2 left after b, under the 3 the mix's kind asks
    want = fresh(st, b)
    assert d.score.tolist() == pytest.approx(want.score.tolist())


def test_why_a_node_is_refused_does_not_depend_on_the_fragmentation_rule() -> None:
    """The reasons of refused nodes are the checks that failed, whatever order the policy
    tries GPUs in: the fragmentation policy's explanation names the same ones as binpack's
    (and skips the rule's per-GPU deltas, which decide nothing there)."""
    st = state(
        full=(two_gpus("full"), 16000),
        tight=(two_gpus("tight"), 16000),
        free=(two_gpus("free"), 16000),
    )
    for uuid in ("full-0", "full-1"):
        st.assume(_held("full", uuid, 1000, 100, 1000))
    st.assume(_held("tight", "tight-0", 800, 20, 1000))
    st.assume(_held("tight", "tight-1", 900, 10, 1000))
    for pct in (30, 100):
        frag_d = decide(st, request(f"f{pct}", pct))
        binpack_d = decide(st, request(f"b{pct}", pct, annotations={POLICY: "binpack"}))
        assert frag_d.preference.policy is Policy.FRAGMENTATION
        assert frag_d.reasons.tolist() == binpack_d.reasons.tolist()
        assert frag_d.reasons[frag_d.node_index("full")] != 0
        assert frag_d.reasons[frag_d.node_index("tight")] != 0


def test_rows_alike_are_computed_once_and_score_as_each_would() -> None:
    """Nodes alike (same free shares, CPU, memory, fit and mix: a young cluster's empty
    nodes) share one delta computation; every node scores as computed on its own."""
    names = [f"n{i:03d}" for i in range(300)]
    st = state(**{n: (three_gpus(n), 64000) for n in names})
    for i, n in enumerate(names[:6]):
        st.assume(_held(n, f"{n}-{i % 3}", 100 * (i + 1), 10 * (i + 1), 1000))
    req = request("q", 30)
    merged = fresh(st, req)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decide_module, "_DISTINCT_FROM", 10**9)
        alone = fresh(st, req)
    assert merged.score.tolist() == alone.score.tolist()
    assert merged.delta is not None and alone.delta is not None
    assert merged.delta.tolist() == alone.delta.tolist()


def test_distinct_rows_are_merged_only_when_equal() -> None:
    a = np.array([[0.5, 1.0], [0.5, 1.0], [0.2, 1.0], [0.5, 1.0]])
    b = np.array([3.0, 3.0, 3.0, 3.0])
    found = decide_module._distinct_rows([a, b])
    assert found is not None
    first, inverse = found
    assert first.tolist() == [2, 0] or first.tolist() == [0, 2]
    assert [a[first][j].tolist() for j in inverse] == a.tolist()
    assert decide_module._distinct_rows([np.arange(4.0)]) is None  # all distinct
    with pytest.MonkeyPatch.context() as m:  # every row projects alike: checked, not merged
        m.setattr(decide_module, "_ROW_KEY", np.zeros(64))
        assert decide_module._distinct_rows([a, b]) is None


def test_ties_go_to_the_fuller_node_only_while_tessera_places_cpu_pods() -> None:
    """a holds a whole GPU, b none; a whole-GPU pod fragments neither (delta 0 on both).
    The emptier (b) first, until a pod without GPUs asks Tessera for room: then the
    fuller (a)."""
    from scheduler_plugins.core.hostonly import place_host_only

    st = state(a=(two_gpus("a"), 16000), b=(two_gpus("b"), 16000))
    st.assume(_held("a", "a-0", 1000, 100, 1000))
    d = decide(st, request("p1", 100))
    assert d.best_node() == "b"
    assert d.delta is not None and d.delta[d.feasible].tolist() == [0.0, 0.0]
    cpu = make_pod("cpu-y").container("c").build()
    cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    place_host_only(st, parse_request(cpu, FRAG), every=False)
    assert st.kinds.fuller_ties
    assert decide(st, request("p2", 100)).best_node() == "a"
    assert fresh(st, request("p3", 100)).best_node() == "a"  # kept rows agree with a rebuild


def test_kept_rows_follow_the_tie_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows kept between decisions score each kind of request for one tie direction:
    when a pod without GPUs asks (ties to the fuller) and once the window's GPU pods came
    without one (to the emptier again), their scores are a fresh computation's (a new mix
    reaches every kept row at once here, as in the test above)."""
    monkeypatch.setattr(_FragRows, "ROLL_DECISIONS", 1)
    rng = np.random.default_rng(11)
    st = state(**{f"n{i}": (three_gpus(f"n{i}"), 32000) for i in range(8)})
    st.kinds = fr.KindCounts(window=6)
    seen = []
    for i in range(40):
        if i in (5, 6, 25):
            cpu = make_pod(f"cpu{i}").container("c").build()
            cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
            decide(st, parse_request(cpu, FRAG))
        req = request(f"p{i}", int(rng.choice([25, 50, 100])))
        d = decide(st, req)
        seen.append(st.kinds.fuller_ties)
        assert d.score.tolist() == pytest.approx(fresh(st, req).score.tolist())
        node = d.best_node()
        if node is not None:
            plan = d.plan_for(node)
            assert plan is not None
            st.assume(plan.allocation(req.cpu_milli, req.memory_bytes, uid=req.key))
    # emptier; fuller from the first pod without GPUs; emptier once 6 GPU pods counted
    # since the last (its own GPU pod the first of them)
    assert seen[:5] == [False] * 5 and seen[5:11] == [True] * 6 and not seen[11]
    assert not any(seen[11:25]) and seen[25:30] == [True] * 5 and not any(seen[30:])
